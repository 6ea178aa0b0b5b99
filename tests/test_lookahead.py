"""Lookahead decoding: the window's mask, greedy identity, the pool's yield.

Sampled exactness (chi-square through the engine, and the mutation it must
catch) is in tests/test_exactness.py; every architecture against
transformers in tests/test_architectures.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.core import engine, runner
from specjax.core import tree as trees
from specjax.drafters import LookaheadDrafter, Method, methods
from specjax.drafters.base import Context
from specjax.drafters.lookahead import window_layout
from specjax.models import decoder

S = 64


def _own_context(level: int, col: int, window_KW: np.ndarray) -> list:
  """What window token (level, col) may see after the root, in position
  order, written from the rule: level 0's columns up to ``col``, then the
  column's levels 1..level."""
  return ([window_KW[0, j] for j in range(col + 1)]
          + [window_KW[m, col] for m in range(1, level + 1)])


@pytest.mark.parametrize("levels", [None, 2])
def test_window_and_tree_logits_equal_each_tokens_own_forward(levels):
  """Invariant: in the verify forward with the window riding beside a
  tree, every tree node's logits are those of the forward over the prefix
  and its root path alone, and every window token's those of the forward
  over the prefix, the root and exactly what it may see (brute force, one
  sequence per token): the two branches never see each other. The window
  has as many levels as the tree is deep, or fewer."""
  cfg, params = testing.tiny()
  rng = np.random.default_rng(4)
  prefix = rng.integers(0, cfg.vocab_size, 9)
  nodes = rng.integers(0, cfg.vocab_size, 5)  # node 0 is the root
  parents = [0, 0, 0, 1, 3]
  K, W = 3, 4
  L = levels or K
  drafter = LookaheadDrafter(window=W, levels=levels, width=2)
  ctx = Context(tokens=jnp.asarray(prefix[None].astype(np.int32)),
                num_tokens=jnp.asarray([9], jnp.int32))
  state = drafter.init(None, ctx, S, K)
  state = state.replace(window=jnp.asarray(
      rng.integers(0, cfg.vocab_size, (1, L, W)), jnp.int32))
  riders = drafter.propose_tree(None, state, ctx, None, K, 4, None).riders
  tree = trees.Tree(tokens=jnp.asarray(nodes[None], jnp.int32),
                    parents=jnp.asarray([parents], jnp.int32),
                    valid=jnp.ones((1, 5), bool))
  anc = trees.ancestors(tree.parents, tree.valid)

  @jax.jit
  def together(params):
    cache = decoder.forward(params, cfg, jnp.asarray(prefix[None]),
                            decoder.init_cache(cfg, 1, S)).cache
    block, positions, mask = engine._with_riders(
        tree.tokens, trees.positions(cache.lengths, anc), anc, riders)
    return decoder.forward(params, cfg, block, cache, positions_BT=positions,
                           mask_BTT=mask, write_cache=False).logits[0]

  window = np.asarray(state.window[0])
  seqs = []
  for m in range(5):  # the root path, by depth
    path, a = [], m
    while a:
      path, a = [nodes[a]] + path, parents[a]
    seqs.append([nodes[0]] + path)
  seqs += [[nodes[0]] + _own_context(l, i, window)
           for l in range(L) for i in range(W)]
  full = [np.concatenate([prefix, s]) for s in seqs]
  width = max(map(len, full))
  alone = jax.jit(lambda params: decoder.forward(
      params, cfg, jnp.asarray(np.stack([np.pad(f, (0, width - len(f)))
                                         for f in full])),
      decoder.init_cache(cfg, len(full), S),
      logit_positions_BP=jnp.asarray([[len(f) - 1] for f in full])
  ).logits[:, 0])
  np.testing.assert_allclose(together(params), alone(params), atol=2e-5)


def test_window_layout_places_each_token_after_what_it_sees():
  """Invariant: each window token sits one position after the last token
  it sees (its context is consecutive positions from the root's next)."""
  offsets, sees = window_layout(3, 4)
  for e in range(12):
    seen = np.sort(offsets[sees[e]])
    np.testing.assert_array_equal(seen, np.arange(1, offsets[e] + 1))


def _tiny_rows(drafter, K, nodes, prompts, new=24):
  model = testing.tiny_model()
  method = Method(drafter, None, K, nodes)
  ar = runner.generate_ids(model, prompts, max_new_tokens=new,
                           min_new_tokens=new)
  return ar, runner.generate_ids(model, prompts, max_new_tokens=new,
                                 min_new_tokens=new, method=method)


def test_greedy_identity_and_the_pool_alone_is_accepted():
  """Invariant: at T = 0 lookahead emits AR's tokens on a ragged batch, with
  its context search and with the pool alone; the pool's n-grams (the
  target's own Jacobi guesses, no context search) get drafts accepted."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 37, 12).tolist() * 2,
             rng.integers(3, 37, 7).tolist()]
  for drafter in (LookaheadDrafter(window=4, width=3),
                  LookaheadDrafter(window=4, width=3, context=None)):
    ar, spec = _tiny_rows(drafter, 3, 8, prompts)
    assert [r.output_ids for r in spec.rows] == [r.output_ids
                                                 for r in ar.rows]
    assert sum(sum(r.accepted_at) for r in spec.rows) > 0
    assert spec.num_steps < ar.num_steps


def test_fewer_levels_than_the_trie_is_deep():
  """Invariant: a window of L = 2 levels under a trie K = 4 deep emits AR's
  tokens on a ragged batch, with L x W riders a step; the pool's n-grams
  are L + 1 tokens while the context's match still drafts K deep."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 37, 12).tolist() * 2,
             rng.integers(3, 37, 7).tolist()]
  drafter = LookaheadDrafter(window=4, levels=2, width=3)
  assert drafter.num_riders(4) == 8
  ar, spec = _tiny_rows(drafter, 4, 10, prompts)
  assert [r.output_ids for r in spec.rows] == [r.output_ids for r in ar.rows]
  assert sum(sum(r.accepted_at) for r in spec.rows) > 0
  ctx = Context(tokens=jnp.asarray([[1, 2, 3, 4, 5, 6, 1, 2, 3]], jnp.int32),
                num_tokens=jnp.asarray([9], jnp.int32))
  state = drafter.init(None, ctx, S, 4)
  assert state.pool.shape == (1, 512, 3)
  tree = drafter.propose_tree(None, state, ctx, None, 4, 10, None).tree
  depths = trees.depths(trees.ancestors(tree.parents, tree.valid))
  assert int(jnp.max(jnp.where(tree.valid, depths, 0))) == 4


def test_the_pool_keeps_each_ngram_once_in_a_ring():
  """Invariant: ``ridden`` pools each column's diagonal (its levels, then
  the target's new token), skips n-grams already held or repeated in the
  same step, overwrites the oldest when full, and moves the window a level
  on, shifted by the extra tokens the step committed."""
  d = LookaheadDrafter(window=3, width=2, pool_size=4)
  ctx = Context(tokens=jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32),
                num_tokens=jnp.asarray([4], jnp.int32))
  st = d.init(None, ctx, 8, 2)
  st = st.replace(window=jnp.asarray([[[10, 11, 10], [20, 21, 20]]],
                                     jnp.int32))
  # Levels (2 x 3) then outputs; only the last level's are read.
  greedy = jnp.asarray([[0, 0, 0, 30, 31, 30]], jnp.int32)
  st = d.ridden(None, st, ctx.replace(num_tokens=jnp.asarray([5])), greedy)
  pool = np.asarray(st.pool[0])
  np.testing.assert_array_equal(pool[:2], [[10, 20, 30], [11, 21, 31]])
  assert (pool[2:, 0] == -1).all() and int(st.next_slot[0]) == 2
  np.testing.assert_array_equal(st.window[0], [[20, 21, 20], [30, 31, 30]])
  # Three tokens committed: the columns shift left by two.
  st = d.ridden(None, st, ctx.replace(num_tokens=jnp.asarray([8])),
                jnp.asarray([[0, 0, 0, 40, 41, 42]], jnp.int32))
  pool = np.asarray(st.pool[0])
  np.testing.assert_array_equal(
      pool, [[20, 30, 42], [11, 21, 31], [20, 30, 40], [21, 31, 41]])
  np.testing.assert_array_equal(st.window[0], [[30, 30, 30], [42, 42, 42]])
  # The newest n-grams keyed by a token come first.
  paths, lengths = d._pooled(st, jnp.asarray([20]))
  np.testing.assert_array_equal(paths[0], [[30, 42], [30, 40]])
  np.testing.assert_array_equal(lengths[0], [2, 2])


def test_lookahead_drafts_trees_only():
  """Invariant: a chain of lookahead is refused in one line, by the engine's
  config and by the method grammar's default (a tree of K x width nodes)."""
  with pytest.raises(ValueError, match="drafts trees only"):
    engine.DecodeConfig(capacity=S, drafter=LookaheadDrafter(), num_draft=3)
  spec = methods.MethodSpec.parse("lookahead:k=3:width=2:window=5")
  assert (spec.tree_nodes, spec.k) == (6, 3)
  assert methods.MethodSpec.parse(spec.text()) == spec
  with pytest.raises(methods.MethodError, match="window must be >= 1"):
    methods.MethodSpec.parse("lookahead:window=0")
  with pytest.raises(methods.MethodError, match="window is for lookahead"):
    methods.MethodSpec.parse("ngram:window=3")
  with pytest.raises(methods.MethodError, match=r"levels must be in \[0, "
                     r"num_draft=2\], got 3"):
    methods.MethodSpec.parse("lookahead:k=2:levels=3")
  with pytest.raises(ValueError, match="levels 5 exceed the trie's depth"):
    engine.DecodeConfig(capacity=S, drafter=LookaheadDrafter(levels=5),
                        num_draft=3, tree_nodes=6)


REPEAT = ("Repeat the following paragraph exactly, word for word:\n\n"
          "The library keeps every row's cache in fixed shapes and moves "
          "per-row lengths to roll speculation back, so one compiled program "
          "serves a whole batch whatever each row accepts.")


@pytest.mark.long
def test_smollm2_greedy_identity_and_acceptance(smollm2):
  """Invariant: on SmolLM2 at T = 0, lookahead equals AR token for token on
  a ragged batch of chat prompts, one of which repeats its input (there
  tokens per forward > 1.5, so the check is not vacuous), and the pool
  alone (no context search) gets drafts accepted."""
  prompts = [smollm2.tokenizer.encode_chat(p) for p in
             (REPEAT, "List three uses of a paperclip.", "Hi!")]
  ar = runner.generate_ids(smollm2, prompts, max_new_tokens=48)
  for text, context in (("lookahead:k=4:window=4:width=4:nodes=12", True),
                        ("lookahead:k=4:window=4:width=4:nodes=12", False)):
    built = methods.build(smollm2, methods.MethodSpec.parse(text))
    if not context:
      built = Method(LookaheadDrafter(window=4, width=4, context=None), None,
                     built.num_draft, built.tree_nodes)
    spec = runner.generate_ids(smollm2, prompts, max_new_tokens=48,
                               method=built)
    for a, s in zip(ar.rows, spec.rows):
      assert s.output_ids == a.output_ids
    accepted = sum(sum(r.accepted_at) for r in spec.rows)
    assert accepted > 0
    if context:
      row = spec.rows[0]
      assert len(row.output_ids) / row.target_forwards > 1.5
