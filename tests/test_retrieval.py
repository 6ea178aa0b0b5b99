"""Retrieval drafter: hashing, table build, proposals, greedy identity, cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from specjax import testing
from specjax import data
from specjax.core import bucketing, engine
from specjax.drafters import Context, LookupDrafter, retrieval
from specjax.drafters.retrieval import (Datastore, RetrievalDrafter,
                                        build_datastore, context_hashes,
                                        sharegpt_datastore)
from specjax.models.decoder import Decoder
from specjax.models.tokenizer import Tokenizer

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 1, 9, 1, 9],
           [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3], [20]]

# "1 2 3" is followed by 9 twice and by 4 once; "7 2 3" only by 4; "2 3 4" by
# 5; nothing ever follows 5 or 9 (they end streams).
CORPUS = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 9], [7, 2, 3, 4]]


@pytest.fixture(scope="module")
def tiny():
  return testing.tiny("llama_gqa_tied", seed=0)


def test_numpy_and_jax_hashes_agree():
  """Invariant: the numpy hashes (table build) and the jitted jnp hashes
  (lookup) are the same uint32 values for every order, ids up to 2**31 - 1,
  so a numpy-built table can be read from the engine."""
  rng = np.random.default_rng(0)
  ctx = rng.integers(0, 2**31, (512, 5)).astype(np.uint32)
  ctx[:4] = [[0] * 5, [2**31 - 1] * 5, [1, 2, 3, 4, 5], [5, 4, 3, 2, 1]]
  on_host = context_hashes(ctx, 1, 5)
  on_device = jax.jit(lambda c: context_hashes(c, 1, 5))(jnp.asarray(ctx))
  assert sorted(on_host) == sorted(on_device) == [1, 2, 3, 4, 5]
  for n in on_host:
    for h_np, h_jax in zip(on_host[n], on_device[n]):
      assert h_np.dtype == np.uint32 and h_jax.dtype == jnp.uint32
      np.testing.assert_array_equal(h_np, np.asarray(h_jax))
  # Orders are hashed apart, and so are the two hashes of one context.
  assert (on_host[1][0] != on_host[2][0]).mean() > 0.99
  assert (on_host[3][0] != on_host[3][1]).mean() > 0.99


def test_build_counts_most_frequent_continuation():
  """Invariants: each stored context keeps its most frequent next token with
  confidence count(next) / count(context); n-grams never span streams;
  on a full table the context with the larger count wins its slot."""
  ds = build_datastore(CORPUS, num_slots=64)
  # 13 distinct contexts of length 1..4 that have a next token.
  assert int((ds.next_token >= 0).sum()) == 13
  prop = RetrievalDrafter().propose(
      ds, None, Context(jnp.array([[1, 2, 3]]), jnp.array([3])), None, 1, None)
  assert prop.tokens.tolist() == [[9]]
  conf = ds.confidence[ds.next_token >= 0]
  assert sorted(np.round(conf, 4).tolist())[:2] == [0.5, 0.5]  # "3", "2 3"
  assert np.isclose(conf, 2 / 3).sum() == 1  # "1 2 3"
  # Stream boundaries: nothing follows 5 or 9 although 5 precedes the next
  # stream's 1 in the concatenation.
  prop = RetrievalDrafter().propose(
      ds, None, Context(jnp.array([[5], [9]]), jnp.array([1, 1])), None, 2,
      None)
  assert prop.num_drafted.tolist() == [0, 0]
  # One slot: only the single most frequent pair survives ("2" -> 3, 4x).
  one = build_datastore(CORPUS, num_slots=1)
  assert one.next_token.tolist() == [3] and one.confidence.tolist() == [1.0]


def test_proposals_longest_suffix_chaining_and_ragged():
  """Invariants: each draft is the stored continuation of the longest suffix
  found (backing off to shorter ones), drafts chain through the table, a row
  stops at its first miss (ragged num_draft, possibly 0) with zeros past it,
  and min_confidence stops a row at a low-probability continuation."""
  ds = build_datastore(CORPUS, num_slots=64)
  tokens = jnp.array([[1, 2, 3, 0, 0, 0], [7, 2, 3, 0, 0, 0],
                      [8, 8, 2, 0, 0, 0], [6, 6, 6, 6, 0, 0],
                      [0, 9, 0, 0, 0, 0]])
  num = jnp.array([3, 3, 3, 4, 2])
  drafter = RetrievalDrafter()
  prop = jax.jit(drafter.propose, static_argnums=(4,))(
      ds, None, Context(tokens, num), None, 4, None)
  assert prop.probs is None
  # Row 0: "1 2 3" -> 9 (2 of 3), then nothing follows 9.
  # Row 1: "7 2 3" -> 4 (not "2 3" -> 4/9 tie, not "3"); then "7 2 3 4" is
  #   unknown, backs off to "2 3 4" -> 5; nothing follows 5.
  # Row 2: "8 8 2" unknown, "2" -> 3, "2 3" -> 4 (tie with 9: lower id),
  #   "2 3 4" -> 5, stop.
  # Row 3: 6 never seen: no drafts. Row 4: 9 ends every stream.
  np.testing.assert_array_equal(prop.tokens, [[9, 0, 0, 0], [4, 5, 0, 0],
                                              [3, 4, 5, 0], [0, 0, 0, 0],
                                              [0, 0, 0, 0]])
  np.testing.assert_array_equal(prop.num_drafted, [1, 2, 3, 0, 0])
  # K bounds the chain.
  short = drafter.propose(ds, None, Context(tokens, num), None, 2, None)
  np.testing.assert_array_equal(short.num_drafted, [1, 2, 2, 0, 0])
  # "2 3" -> 4 has confidence 1/2 and "1 2 3" -> 9 has 2/3.
  picky = RetrievalDrafter(min_confidence=0.6).propose(
      ds, None, Context(tokens, num), None, 4, None)
  np.testing.assert_array_equal(picky.num_drafted, [1, 2, 1, 0, 0])
  np.testing.assert_array_equal(picky.tokens[2], [3, 0, 0, 0])
  # A table built without the short orders cannot back off to them.
  long_only = RetrievalDrafter(n_min=3).propose(
      build_datastore(CORPUS, n_min=3, num_slots=64), None,
      Context(tokens, num), None, 4, None)
  np.testing.assert_array_equal(long_only.num_drafted, [1, 2, 0, 0, 0])


def test_tree_follows_every_suffix_order():
  """Invariants: the trie holds one chain per suffix order that hit, longest
  first, orders that agree merged into one path; its first path is the
  chain ``propose`` drafts (the spine); a row with no hit drafts nothing;
  the node budget cuts breadth first."""
  ds = build_datastore(CORPUS, num_slots=64)
  tokens = jnp.array([[1, 2, 3, 0, 0], [7, 2, 3, 0, 0], [6, 6, 0, 0, 0]])
  num = jnp.array([3, 3, 2])
  drafter = RetrievalDrafter()
  propose_tree = jax.jit(drafter.propose_tree, static_argnums=(4, 5))
  tree = propose_tree(ds, None, Context(tokens, num), None, 3, 6, None).tree
  # Row 0: "1 2 3" -> 9 (then nothing); "2 3" -> 4 (tie with 9: lower id),
  #   then "1 2 3 4" -> 5; "3" -> 4 as well (merged). Row 1: every order
  #   says 4, then 5. Row 2: 6 never seen.
  assert tree.valid.tolist() == [[True] * 4 + [False] * 3,
                                 [True] * 3 + [False] * 4,
                                 [True] + [False] * 6]
  np.testing.assert_array_equal(tree.tokens[:, :4], [[3, 9, 4, 5],
                                                     [3, 4, 5, 0],
                                                     [6, 0, 0, 0]])
  np.testing.assert_array_equal(tree.parents[:2, :4], [[0, 0, 0, 2],
                                                       [0, 0, 1, 0]])
  chain = drafter.propose(ds, None, Context(tokens, num), None, 3, None)
  np.testing.assert_array_equal(chain.tokens[:2, :2], [[9, 0], [4, 5]])
  # Two nodes: breadth first keeps both first tokens of row 0.
  two = propose_tree(ds, None, Context(tokens, num), None, 3, 2, None).tree
  np.testing.assert_array_equal(two.tokens[0], [3, 9, 4])


def test_lookup_drafts_ngram_then_retrieval():
  """Invariants of ``ngram+retrieval``: a chain is n-gram's continuation
  where the row's own context has a match and the datastore's elsewhere; a
  tree is one trie of n-gram's paths first, then every suffix order's
  datastore path."""
  ds = build_datastore(CORPUS, num_slots=64)
  # Row 0: no earlier "3" in the row -> the datastore's 9. Row 1: "5 6"
  # repeats -> n-gram's 5 6 (the datastore knows neither). Row 2: both.
  tokens = jnp.array([[1, 2, 3, 0, 0, 0], [5, 6, 5, 6, 0, 0],
                      [1, 2, 3, 1, 2, 3]])
  num = jnp.array([3, 4, 6])
  drafter = LookupDrafter()
  chain = drafter.propose(ds, None, Context(tokens, num), None, 3, None)
  np.testing.assert_array_equal(chain.num_drafted, [1, 2, 3])
  np.testing.assert_array_equal(chain.tokens, [[9, 0, 0], [5, 6, 0],
                                               [1, 2, 3]])
  tree = drafter.propose_tree(ds, None, Context(tokens, num), None, 3, 8, None).tree
  # Row 2: n-gram's 1 2 3, then the datastore's 9 ("1 2 3") and 4 5 ("2 3").
  np.testing.assert_array_equal(tree.tokens[2, :7], [3, 1, 9, 4, 2, 5, 3])
  np.testing.assert_array_equal(tree.parents[2, :7], [0, 0, 0, 0, 1, 3, 4])
  assert tree.valid[2].tolist() == [True] * 7 + [False] * 2
  np.testing.assert_array_equal(tree.tokens[0, :4], [3, 9, 4, 5])


def _run(params, cfg, dcfg, drafter_params=None, max_new=24):
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  state = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(0),
                              np.int32(max_new), target=Decoder(cfg), dcfg=dcfg,
                              drafter_params=drafter_params)
  return [state.tokens[b, lengths[b]:state.num_tokens[b]].tolist()
          for b in range(len(PROMPTS))], state


@pytest.mark.parametrize("drafter", [RetrievalDrafter(), LookupDrafter()],
                         ids=["retrieval", "ngram+retrieval"])
@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_greedy_retrieval_equals_ar(tiny, tree_nodes, drafter):
  """Invariants at T = 0 on a ragged batch, as chains and as tries, for the
  datastore alone and behind n-gram: with a table built from the AR
  continuations themselves plus conflicting noise streams, speculative
  output equals AR output token for token, and drafts were really accepted
  and rejected along the way (the test is not vacuous)."""
  cfg, params = tiny
  ar, ar_state = _run(params, cfg, engine.DecodeConfig(capacity=64))
  rng = np.random.default_rng(0)
  truth = [p + o for p, o in zip(PROMPTS, ar)]
  # Corrupted copies, counted twice, outvote the truth on some contexts so
  # that some chains go wrong and get rejected.
  noise = []
  for stream in truth:
    bad = np.array(stream)
    flip = rng.random(len(bad)) < 0.15
    bad[flip] = rng.integers(0, cfg.vocab_size, flip.sum())
    noise += [bad, bad]
  ds = jax.device_put(build_datastore(truth + noise, num_slots=1024))
  spec, st = _run(params, cfg, engine.DecodeConfig(
      capacity=64, drafter=drafter, num_draft=4, tree_nodes=tree_nodes), ds)
  assert spec == ar
  accepted = np.asarray(st.accepted_at).sum(1)
  drafted = np.asarray(st.num_drafted)
  assert accepted.sum() > 0 and (accepted < drafted).any()
  assert int(st.num_steps) < int(ar_state.num_steps)


@pytest.mark.long
@pytest.mark.parametrize("mutation", [None, "trie_dropped"])
def test_head_tree_with_the_lookup_trie_equals_ar(tiny, mutation,
                                                  monkeypatch):
  """Invariants at T = 0 on a ragged batch, for an untrained EAGLE-3 head's
  dynamic tree with the n-gram/retrieval trie merged in (``TreeUnion``): the
  output equals AR token for token (the head's state follows paths that ran
  through the table's nodes), and with a datastore of the AR continuations
  the table's nodes are accepted where the head's are not: fewer steps than
  the head's tree alone. Mutation caught: a union that drops the trie's
  nodes takes as many steps as the head alone."""
  from specjax.drafters.eagle import EagleDrafter, EagleParams
  from specjax.drafters.union import TreeUnion, UnionParams
  from specjax.heads.base import HeadConfig
  from specjax.heads.vocab import build_draft_vocab
  from specjax.training.train import init_head
  cfg, params = tiny
  ar, _ = _run(params, cfg, engine.DecodeConfig(capacity=64))
  ds = jax.device_put(build_datastore([p + o for p, o in zip(PROMPTS, ar)],
                                      num_slots=1024))
  V = cfg.vocab_size
  hcfg = HeadConfig.for_target(cfg, V, taps=(0, 1, 2))
  vocab = build_draft_vocab([np.arange(V)], V, V)
  head = EagleParams(head=init_head(jax.random.key(0), hcfg, Decoder(cfg), params, vocab),
                     draft_ids=jnp.asarray(vocab.ids), embed=params.embed)
  eagle = EagleDrafter(hcfg, tree_width=2)
  alone, st_alone = _run(params, cfg, engine.DecodeConfig(
      capacity=64, drafter=eagle, num_draft=3, tree_nodes=4), head)
  if mutation:
    from specjax.drafters import union
    real = union.trees.union
    monkeypatch.setattr(union.trees, "union", lambda first, second, depth: (
        real(first, second.replace(valid=second.valid.at[:, 1:].set(False)),
             depth)))
    jax.clear_caches()
  both, st = _run(params, cfg, engine.DecodeConfig(
      capacity=64, drafter=TreeUnion(eagle, LookupDrafter(), 4), num_draft=3,
      tree_nodes=8), UnionParams(head=head, table=ds))
  jax.clear_caches()
  assert alone == ar and both == ar
  assert (int(st.num_steps) < int(st_alone.num_steps)) == (mutation is None)


def _word_tokenizer():
  """A tiny word-level tokenizer, cheap to build, standing in for a real one."""
  words = ["<unk>", "<end>", "the", "a", "of", "to", "and", "is", "in", "you"]
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  return Tokenizer(tok, bos_id=None, eos_ids=[1], pad_id=None,
                   chat_template=None)


def test_sharegpt_datastore_cache_round_trips(tmp_path, monkeypatch):
  """Invariants: each assistant turn is its own stream ending in the EOS id;
  the first call builds and writes one .npz under cache_dir; a second call
  with the same arguments loads it (no rebuild) with equal arrays; changing
  an argument is a different cache entry."""
  tok = _word_tokenizer()
  kwargs = dict(num_conversations=30, num_slots=2**10, cache_dir=tmp_path,
                progress=False)
  seen = []

  def recording_build(streams, **kw):
    seen.extend(streams)
    return build_datastore(streams, **kw)

  monkeypatch.setattr(retrieval, "build_datastore", recording_build)
  built = sharegpt_datastore(tok, **kwargs)
  turns = sum(role == "assistant" for conv in
              data.sharegpt_conversations(30) for role, _ in conv)
  assert len(seen) == turns and all(s[-1] == 1 for s in seen)
  assert len(list(tmp_path.glob("*.npz"))) == 1 and built.fill > 0

  def no_build(*args, **kw):
    raise AssertionError("rebuilt although cached")

  monkeypatch.setattr(retrieval, "build_datastore", no_build)
  loaded = sharegpt_datastore(tok, **kwargs)
  assert isinstance(loaded, Datastore)
  for field in ("check", "next_token", "confidence"):
    a, b = getattr(built, field), getattr(loaded, field)
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  monkeypatch.undo()
  sharegpt_datastore(tok, **{**kwargs, "num_slots": 2**11})
  assert len(list(tmp_path.glob("*.npz"))) == 2
