"""The decode engine on a tiny random model: exactness, stops, no retracing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from specjax import testing
from specjax.core import bucketing, engine
from specjax.core.sampling import (Allowed, History, RowSampling, Sampler,
                                   SamplingParams, warp)
from specjax.core import tree as trees
from specjax.drafters import DraftModelDrafter, NGramDrafter, TreeProposal
from specjax.models import decoder
from specjax.models.decoder import Decoder
from specjax.models.registry import Model

PROMPTS = [[5, 17, 3], [9, 1, 30, 22, 8, 14, 2, 6], [33], [4, 4, 4, 4, 12]]


@pytest.fixture(scope="module")
def tiny():
  return testing.tiny("llama_gqa_tied", seed=3)


def _greedy_reference(params, cfg, prompt, n):
  """Greedy decoding by re-running the whole sequence each step (no cache
  reuse): one fixed-shape forward over the sequence padded to 32 tokens."""
  full = jax.jit(lambda p, t: decoder.forward(p, cfg, t,
                                            decoder.init_cache(cfg, 1, 32)))
  seq = list(prompt)
  for _ in range(n):
    padded = jnp.array([seq + [0] * (32 - len(seq))])
    seq.append(int(jnp.argmax(full(params, padded).logits[0, len(seq) - 1])))
  return seq[len(prompt):]


def _run(params, cfg, prompts, max_new, dcfg, seed=0):
  prompt_BT, lengths = bucketing.pad_prompts(prompts)
  state = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(seed),
                              np.int32(max_new), target=Decoder(cfg), dcfg=dcfg)
  return [state.tokens[b, lengths[b]:state.num_tokens[b]].tolist()
          for b in range(len(prompts))], state


def test_greedy_ragged_batch_equals_uncached_reference(tiny):
  """Invariant: greedy generation of a ragged batch equals, for every row,
  greedy decoding that recomputes the whole sequence each step."""
  cfg, params = tiny
  outs, state = _run(params, cfg, PROMPTS, 10, engine.DecodeConfig(capacity=64))
  for prompt, out in zip(PROMPTS, outs):
    assert out == _greedy_reference(params, cfg, prompt, 10)
  assert (np.asarray(state.stop_reason) == engine.STOP_BUDGET).all()
  np.testing.assert_array_equal(state.cache.lengths,
                                np.asarray(state.num_tokens) - 1)


def test_stop_clauses(tiny):
  """Invariant: a row stops at the first EOS (kept in its output) while the
  others run to their budget; a row that fills the cache stops as capacity."""
  cfg, params = tiny
  free, _ = _run(params, cfg, PROMPTS, 10, engine.DecodeConfig(capacity=64))
  eos = free[1][3]  # row 1's 4th token; other rows may or may not contain it
  outs, state = _run(params, cfg, PROMPTS, 10,
                     engine.DecodeConfig(capacity=64, eos_ids=(eos,)))
  for free_row, row, reason in zip(free, outs, state.stop_reason):
    cut = free_row.index(eos) + 1 if eos in free_row else len(free_row)
    assert row == free_row[:cut]
    assert int(reason) == (engine.STOP_EOS if eos in free_row
                           else engine.STOP_BUDGET)
  # capacity 40 (prompts padded to 32): each row fills all 40 slots.
  outs, state = _run(params, cfg, PROMPTS, 100, engine.DecodeConfig(capacity=40))
  for prompt, row, reason in zip(PROMPTS, outs, state.stop_reason):
    assert len(prompt) + len(row) == 40
    assert int(reason) == engine.STOP_CAPACITY


def _sampled_ngram():
  return engine.DecodeConfig(capacity=64, sampling=SamplingParams(
      0.8, top_k=20, top_p=0.9), drafter=NGramDrafter(), num_draft=3)


@pytest.mark.parametrize("how", ["ar_greedy", "ngram_sampled"])
def test_stream_equals_generate(tiny, how):
  """Invariant: the Python-driven stream (jitted step, donated state) ends in
  the same tokens as the single while_loop call -- at T = 0 one new token
  per step, and at T = 0.8 with top-k/top-p and n-gram drafts (the stream
  splits the key as generate does) -- and never takes a token back."""
  cfg, params = tiny
  dcfg = (engine.DecodeConfig(capacity=64) if how == "ar_greedy"
          else _sampled_ngram())
  outs, _ = _run(params, cfg, PROMPTS, 7, dcfg)
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  counts, seen = [], [[] for _ in PROMPTS]
  for state in engine.stream(params, prompt_BT, lengths, jax.random.key(0),
                             np.int32(7), target=Decoder(cfg), dcfg=dcfg):
    counts.append(int(state.num_tokens[0]))
    last = [state.tokens[b, lengths[b]:state.num_tokens[b]].tolist()
            for b in range(len(PROMPTS))]
    assert all(row[:len(old)] == old for row, old in zip(last, seen))
    seen = last
  assert last == outs
  if how == "ar_greedy":
    assert counts == list(range(len(PROMPTS[0]) + 1, len(PROMPTS[0]) + 8))
  else:
    assert len(counts) < 7 * len(PROMPTS)  # drafts were accepted


def test_the_key_decides_a_sampled_run(tiny):
  """Invariant: at T = 0.8 with n-gram drafts, one key gives one output
  and another key another one (the engine uses the key it is given, not a
  fixed one)."""
  cfg, params = tiny
  runs = [_run(params, cfg, PROMPTS, 12, _sampled_ngram(), seed=k)[0]
          for k in (1, 1, 2)]
  assert runs[0] == runs[1] and runs[0] != runs[2]


def test_no_recompilation_within_bucket(tiny, monkeypatch):
  """Invariant: prompts of different lengths in one bucket, a different
  max_new_tokens budget and new weights of the same shapes (three policy
  updates of an RL loop: each changes the output) reuse one compiled
  generate; a new bucket traces once."""
  cfg, params = tiny
  cfg = dataclasses.replace(cfg, name="no-retrace")  # a fresh jit cache key
  traces = []
  real_prefill = engine.prefill
  monkeypatch.setattr(engine, "prefill",
                      lambda *a, **k: traces.append(1) or real_prefill(*a, **k))
  dcfg = engine.DecodeConfig(capacity=96)
  _run(params, cfg, [[1, 2, 3]], 5, dcfg)
  _run(params, cfg, [list(range(1, 20))], 9, dcfg)
  outputs = [_run(params, cfg, [list(range(1, 20))], 9, dcfg)[0]]
  for seed in (4, 5, 6):  # three updates, as an RL loop's
    _, updated = testing.tiny("llama_gqa_tied", seed=seed)
    outputs.append(_run(updated, cfg, [list(range(1, 20))], 9, dcfg)[0])
  assert all(a != b for a, b in zip(outputs, outputs[1:]))
  assert len(traces) == 1
  _run(params, cfg, [[i % 30 + 1 for i in range(39)]], 5, dcfg)  # bucket 64
  assert len(traces) == 2


@pytest.mark.parametrize("drafter", [
    None, pytest.param(NGramDrafter(), marks=pytest.mark.long)],
    ids=["ar", "ngram"])
def test_generate_inside_user_jit(tiny, drafter):
  """Invariant: a user function that calls engine.generate (AR or
  speculative) and scores its output compiles once, does not retrace on a
  second call with new values, and matches the direct call."""
  cfg, params = tiny
  dcfg = engine.DecodeConfig(capacity=64, sampling=SamplingParams(1.0),
                             drafter=drafter, num_draft=3)
  traces = []

  @jax.jit
  def rollout_and_score(params, prompt_BT, lengths, key):
    traces.append(1)
    state = engine.generate(params, prompt_BT, lengths, key, 6, target=Decoder(cfg),
                            dcfg=dcfg)
    new = jnp.arange(64)[None, :] >= lengths[:, None]
    valid = new & (jnp.arange(64)[None, :] < state.num_tokens[:, None])
    return state.tokens, jnp.sum(jnp.where(valid, state.tokens, 0), axis=1)

  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  tokens, score = rollout_and_score(params, prompt_BT, lengths,
                                    jax.random.key(1))
  rollout_and_score(params, prompt_BT, lengths, jax.random.key(2))
  assert len(traces) == 1
  direct = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(1),
                               np.int32(6), target=Decoder(cfg), dcfg=dcfg)
  np.testing.assert_array_equal(tokens, direct.tokens)
  assert score.shape == (len(PROMPTS),)


def test_sampled_first_token_distribution(tiny):
  """Invariant: at temperature 0.8 / top-k 6 / top-p 0.9 the engine's first
  sampled token follows warp(prefill logits): chi-square over 20,000 rows below
  the 99.9% critical value, and warped-out tokens never appear."""
  cfg, params = tiny
  sp = SamplingParams(0.8, 6, 0.9)
  n = 20_000
  prompt = [[5, 17, 3]] * n
  state = engine.prefill_jit(
      params, jnp.array(prompt), jnp.full((n,), 3), jax.random.key(7), 1,
      target=Decoder(cfg), dcfg=engine.DecodeConfig(capacity=4, sampling=sp))
  outs = np.asarray(state.tokens[:, 3:4])
  drawn = np.bincount([o[0] for o in outs], minlength=cfg.vocab_size)
  logits = decoder.forward(params, cfg, jnp.array(prompt[:1]),
                         decoder.init_cache(cfg, 1, 8)).logits[0, -1]
  probs = np.asarray(warp(logits, sp), np.float64)
  support = probs > 0
  assert drawn[~support].sum() == 0
  assert 1 < support.sum() < cfg.vocab_size
  expected = probs[support] * n
  stat = ((drawn[support] - expected) ** 2 / expected).sum()
  assert stat < scipy.stats.chi2.ppf(0.999, support.sum() - 1)


def test_prefill_needs_a_free_slot(tiny):
  """Invariant: a prompt bucket as large as the capacity is refused, since
  the first sampled token would have nowhere to go."""
  cfg, params = tiny
  with pytest.raises(ValueError, match="below cache capacity"):
    _run(params, cfg, [[1, 2, 3]], 4, engine.DecodeConfig(capacity=32))


@pytest.mark.parametrize("kw, words", [
    (dict(capacity=0), "capacity must be >= 1"),
    (dict(num_draft=-1), "num_draft and tree_nodes >= 0"),
    (dict(drafter=NGramDrafter(), num_draft=0), "needs num_draft >= 1"),
    (dict(drafter=NGramDrafter(), num_draft=4, tree_nodes=-2),
     "num_draft and tree_nodes >= 0"),
    (dict(drafter=NGramDrafter(), num_draft=4, tree_nodes=513),
     "more than 512"),
    (dict(capacity=8, drafter=NGramDrafter(), num_draft=8),
     "scores 9 tokens per row, more than the capacity 8"),
])
def test_decode_configs_the_engine_cannot_run_are_refused(kw, words):
  """Invariant: a ``DecodeConfig`` the engine cannot run (no slots,
  negative sizes, a drafter asked for no drafts, a tree over
  ``tree.MAX_NODES``, a step wider than the cache) raises ValueError naming
  it when built, not a JAX error when traced."""
  import re
  with pytest.raises(ValueError, match=re.escape(words)):
    engine.DecodeConfig(**{"capacity": 64, **kw})


def test_prompt_lengths_outside_the_padded_prompt_stop_at_once(tiny):
  """Invariant: in the jitted API, a row whose length is 0, negative or
  longer than the padded prompt emits nothing and stops as "bad_prompt"
  (never garbage, never "nonfinite"), with and without drafts; the other
  rows decode as they do alone."""
  cfg, params = tiny
  prompt_BT, _ = bucketing.pad_prompts([PROMPTS[1]] * 4)
  lengths = jnp.asarray([len(PROMPTS[1]), 0, -1, prompt_BT.shape[1] + 1])
  alone, _ = _run(params, cfg, [PROMPTS[1]], 6,
                  engine.DecodeConfig(capacity=64))
  for dcfg in (engine.DecodeConfig(capacity=64),
               engine.DecodeConfig(capacity=64, drafter=NGramDrafter(),
                                   num_draft=3)):
    st = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(0),
                             np.int32(6), target=Decoder(cfg), dcfg=dcfg)
    new = np.asarray(st.num_tokens - st.prompt_lengths)
    assert new.tolist()[1:] == [0, 0, 0]
    assert [engine.STOP_NAMES[int(r)] for r in st.stop_reason][1:] == [
        "bad_prompt"] * 3
    row = st.tokens[0, lengths[0]:st.num_tokens[0]].tolist()
    assert row == alone[0]


def test_a_drafter_outside_the_protocol_is_refused_naming_what_it_lacks():
  """Invariant: every shipped drafter is a ``Drafter`` (the typed protocol,
  checked at run time); an object that is not -- here one with only a
  ``propose`` -- is refused when the ``DecodeConfig`` is built, naming the
  members it lacks."""
  from specjax.drafters import (Drafter, EagleDrafter, LookupDrafter,
                                MedusaDrafter, RetrievalDrafter)
  from tests.test_eagle_ttt import CFG as EAGLE
  from tests.test_medusa import CFG as MEDUSA
  target = Decoder(testing.CONFIGS["llama_gqa_tied"])
  for drafter in (NGramDrafter(), RetrievalDrafter(), LookupDrafter(),
                  DraftModelDrafter(target), EagleDrafter(EAGLE),
                  MedusaDrafter(MEDUSA)):
    assert isinstance(drafter, Drafter), type(drafter).__name__

  class OnlyPropose:
    def propose(self, *args):
      del args

  with pytest.raises(TypeError, match="OnlyPropose lacks feature_taps, "
                     "needs_params, init, commit"):
    engine.DecodeConfig(capacity=64, drafter=OnlyPropose(), num_draft=2)


@pytest.mark.parametrize("name", ["layer_skip", "retrieval"])
def test_a_drafter_without_its_params_is_named(tiny, name):
  """Invariant: a drafter that needs parameters (here layer-skip's target
  weights, retrieval's datastore) given none is refused by name before
  anything is traced, not with an error from inside JAX."""
  from specjax.drafters import LayerSkipDrafter, RetrievalDrafter
  cfg, params = tiny
  drafter = (LayerSkipDrafter.from_target(Decoder(cfg), 1)
             if name == "layer_skip" else RetrievalDrafter())
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  with pytest.raises(TypeError, match=f"{type(drafter).__name__} needs "
                     "drafter_params"):
    engine.generate_jit(params, prompt_BT, lengths, jax.random.key(0),
                        np.int32(4), target=Decoder(cfg),
                        dcfg=engine.DecodeConfig(capacity=64, drafter=drafter,
                                                 num_draft=3))


def test_a_prompt_prefilled_in_chunks_decodes_as_in_one_forward(tiny):
  """Invariant: prompts longer than ``prefill_chunk`` (here 8; ragged, up
  to 22 tokens, one shorter than a chunk, in a bucket of 32 whose last
  chunk is skipped) scored chunk by chunk leave the
  cache a one-forward prefill leaves (every layer's K/V below each row's
  length, 1e-5) and decode the same greedy tokens, AR and with an EAGLE-3
  head (whose features for every prompt position come from the chunks)."""
  from tests.test_architectures import every_drafter
  cfg, params = tiny
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (22, 5, 17)]
  prompt_BT, lengths = bucketing.pad_prompts(prompts)
  assert prompt_BT.shape[1] == 32
  (kw, head), = every_drafter(Decoder(cfg), params, names=["eagle3"]).values()
  for drafter in ({}, kw):
    runs = []
    for chunk in (512, 8):
      dcfg = engine.DecodeConfig(capacity=64, prefill_chunk=chunk, **drafter)
      pre = engine.prefill_jit(params, prompt_BT, lengths, jax.random.key(0),
                               np.int32(10), target=Decoder(cfg), dcfg=dcfg,
                               drafter_params=head if drafter else None)
      st = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(0),
                               np.int32(10), target=Decoder(cfg), dcfg=dcfg,
                               drafter_params=head if drafter else None)
      runs.append((pre, [st.tokens[b, lengths[b]:st.num_tokens[b]].tolist()
                         for b in range(3)]))
    (one, out_one), (chunked, out_chunked) = runs
    assert out_one == out_chunked
    np.testing.assert_array_equal(one.cache.lengths, chunked.cache.lengths)
    for layer in range(cfg.num_layers):
      for row, n in enumerate(np.asarray(lengths)):  # k [G, H, S], v [G, S, H]
        np.testing.assert_allclose(one.cache.k[layer][row, :, :, :n],
                                   chunked.cache.k[layer][row, :, :, :n],
                                   atol=1e-5)
        np.testing.assert_allclose(one.cache.v[layer][row, :, :n],
                                   chunked.cache.v[layer][row, :, :n],
                                   atol=1e-5)


def test_a_batch_that_does_not_fit_is_refused_before_allocating(
    tiny, monkeypatch):
  """Invariant: ``runner.generate_ids`` refuses a batch whose KV cache and
  scratch exceed the free memory, naming rows, slots and both sizes,
  before anything is allocated; the estimate grows with rows and slots."""
  from specjax.core import runner
  from specjax.models.registry import Model
  cfg, params = tiny
  model = Model(target=Decoder(cfg), params=params, tokenizer=None)
  need = runner.decode_bytes(model, 4, 128, 32)
  assert runner.decode_bytes(model, 8, 128, 32) > need
  assert runner.decode_bytes(model, 4, 256, 32) > need
  monkeypatch.setattr(runner, "available_bytes", lambda model: need // 2)
  with pytest.raises(runner.DoesNotFit, match=r"4 rows x \d+ slots need"):
    runner.generate_ids(model, PROMPTS, max_new_tokens=4)


class _SiblingTree(DraftModelDrafter):
  """The model's own chain of 3 drafts as a tree whose first branch is a
  wrong token: root -> (wrong, d0), d0 -> d1 -> d2. At T = 0 the accepted
  path runs through nodes 2, 3, 4 (never its depths 1, 2, 3)."""

  def propose_tree(self, params, state, ctx, key, num_draft, num_nodes,
                   sampling):
    prop = self.propose(params, state, ctx, key, 3, sampling)
    d = prop.tokens
    wrong = (d[:, :1] + 1) % self.target.config.vocab_size
    tokens = jnp.concatenate([ctx.newest()[:, None], wrong, d], axis=1)
    B = tokens.shape[0]
    tree = trees.Tree(
        tokens=tokens,
        parents=jnp.broadcast_to(jnp.array([0, 0, 0, 2, 3]), (B, 5)),
        valid=jnp.ones((B, 5), bool))
    return TreeProposal(tree=tree, state=prop.state)


# Every drafter of tests/test_architectures.every_drafter, long: one compile
# each at both temperatures.
_EVERY = ["ngram_trie", "lookup_trie", "eagle3", "eagle3_tree",
          "eagle3_static_2x2", "eagle3_tree+lookup", "eagle1", "medusa",
          "medusa_static_2x2x1", "layerskip", "mtp", "mtp_tree", "peagle",
          "pearl_peagle"]


# Every option: penalties that bite (the prompts repeat tokens, the output
# repeats itself), a bias, min-p.
OPTIONS = dict(min_p=0.05, repetition_penalty=1.3, presence_penalty=0.4,
               frequency_penalty=0.3, logit_bias=((7, 1.0), (30, -0.5)))


def no_repeat_no_eleven(tokens_BS, num_tokens_B, prompt_lengths_B):
  """An allowed-token hook: never the context's last token again, never
  token 11."""
  last_B = jnp.take_along_axis(tokens_BS, (num_tokens_B - 1)[:, None], 1)
  v_1V = jnp.arange(37)[None, :]
  return (v_1V != last_B) & (v_1V != 11)


def _allowed_at_each_position(hook, tokens_BS, prompt_lengths_B):
  """``Allowed`` ``[B, S - 1, S]``: at position s, the context tokens
  0..s."""
  B, S = tokens_BS.shape
  return Allowed(hook, jnp.broadcast_to(tokens_BS[:, None], (B, S - 1, S)),
                 jnp.broadcast_to(jnp.arange(1, S)[None, :], (B, S - 1)),
                 jnp.asarray(prompt_lengths_B))


def _history_at_each_position(tokens_BS, prompt_lengths_B, num_tokens_B, V):
  """``History`` ``[B, S, V]``: at position s, the tokens 0..s (the
  context of the token at s + 1), the generated ones counted."""
  pos = np.arange(tokens_BS.shape[1])[None, :]
  onehot = np.eye(V)[np.asarray(tokens_BS)] * (
      pos < np.asarray(num_tokens_B)[:, None])[..., None]
  generated = (pos >= np.asarray(prompt_lengths_B)[:, None])[..., None]
  return History(seen=jnp.asarray(np.cumsum(onehot, 1) > 0),
                 counts=jnp.asarray(np.cumsum(onehot * generated, 1),
                                    jnp.float32))


_SAMPLINGS = {"greedy": SamplingParams(),
              "sampled": SamplingParams(0.8, top_k=20, top_p=0.9),
              "greedy_options": SamplingParams(**OPTIONS),
              "sampled_options": SamplingParams(0.8, top_k=20, top_p=0.9,
                                                **OPTIONS)}
_FAST = ["ar", "chain", "trie", "draft_model", "sibling_tree"]


@pytest.mark.parametrize("method,sampling", [
    pytest.param(m, sp, id=f"{m}-{name}", marks=(
        pytest.mark.long if name == "greedy_options" else ()))
    for m in _FAST for name, sp in _SAMPLINGS.items()] + [
    pytest.param(m, sp, id=f"{m}-{name}", marks=pytest.mark.long)
    for m in _EVERY for name, sp in list(_SAMPLINGS.items())[:2]])
def test_logprobs_are_the_targets_at_each_generated_token(tiny, method,
                                                          sampling):
  """Invariant: ``DecodeState.logprobs`` / ``raw_logprobs`` hold, at each
  generated token, its log-probability under the warped target
  distribution it follows (0 for greedy's argmax) and under the raw target
  (log-softmax), as one teacher-forced forward over the whole sequence
  gives them (1e-5, f32), for AR, a chain, a trie, a model drafter and a
  tree whose accepted path is not its first nodes (a log-prob read at the
  node's depth instead of the node fails), and in the long stage every
  drafter (retrieval trie, EAGLE-3 chain, dynamic and static trees and the
  head + lookup union, EAGLE-1, Medusa chain and static tree, layer-skip,
  a P-EAGLE block, and PEARL with it);
  0 at prompt positions and past each row's tokens. With the penalties, a
  bias, min-p and an allowed-token hook the warped distribution is the
  one at each position's own context (history and hook computed here from
  the tokens): at T = 0 each token is that distribution's argmax, so the
  methods decode as the sequential decoder does."""
  cfg, params = tiny
  if method in _EVERY:
    from tests.test_architectures import every_drafter
    (kw, dparams), = every_drafter(Decoder(cfg), params,
                                   names=[method]).values()
  else:
    kw = {"ar": {}, "chain": dict(drafter=NGramDrafter(), num_draft=3),
          "trie": dict(drafter=NGramDrafter(num_paths=3), num_draft=3,
                       tree_nodes=6),
          "draft_model": dict(drafter=DraftModelDrafter(Decoder(cfg)),
                              num_draft=3),
          "sibling_tree": dict(drafter=_SiblingTree(Decoder(cfg)),
                               num_draft=3, tree_nodes=4)}[method]
    dparams = params if kw.get("drafter") else None
  hook = no_repeat_no_eleven if sampling.penalized else None
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  st = engine.generate_jit(
      params, prompt_BT, lengths, jax.random.key(1), np.int32(12),
      target=Decoder(cfg), dcfg=engine.DecodeConfig(
          capacity=64, sampling=sampling, allowed_tokens=hook, **kw),
      drafter_params=dparams)
  logits = decoder.forward(params, cfg, st.tokens, decoder.init_cache(
      cfg, len(PROMPTS), 64)).logits.astype(jnp.float32)
  want_raw = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]),
                                 st.tokens[:, 1:, None], axis=-1)[..., 0]
  history = _history_at_each_position(st.tokens[:, :-1], lengths,
                                     st.num_tokens, cfg.vocab_size)
  allowed = (None if hook is None
             else _allowed_at_each_position(hook, st.tokens, lengths))
  want = jnp.log(jnp.take_along_axis(
      warp(logits[:, :-1], Sampler(sampling, history=history,
                                   allowed=allowed)),
      st.tokens[:, 1:, None], axis=-1)[..., 0])
  pos = np.arange(1, 64)[None, :]
  new = (pos >= np.asarray(lengths)[:, None]) & (
      pos < np.asarray(st.num_tokens)[:, None])
  assert new.sum() == 12 * len(PROMPTS)
  for got, ref in ((st.logprobs, want), (st.raw_logprobs, want_raw)):
    got = np.asarray(got)
    np.testing.assert_allclose(got[:, 1:][new], np.asarray(ref)[new],
                               atol=1e-5)
    assert (got[:, 1:][~new] == 0).all() and (got[:, 0] == 0).all()
  assert (np.asarray(st.raw_logprobs)[:, 1:][new] < 0).all()
  if sampling.greedy:
    assert (np.asarray(st.logprobs) == 0).all()
  if method == "sibling_tree" and sampling.greedy:  # the path is off-spine
    assert np.asarray(st.accepted_nodes)[:, 1:].sum() > 0


def _decode(params, cfg, method, sampling, max_new=12, **kw):
  """``(outputs, stop reasons)`` of PROMPTS with ``method`` (as in
  ``test_logprobs_are_the_targets_at_each_generated_token``)."""
  drafter = {"ar": {}, "chain": dict(drafter=NGramDrafter(), num_draft=3),
             "trie": dict(drafter=NGramDrafter(num_paths=3), num_draft=3,
                          tree_nodes=6),
             "draft_model": dict(drafter=DraftModelDrafter(Decoder(cfg)),
                                 num_draft=3)}[method]
  least = kw.pop("min_new_tokens", 0)
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  st = engine.generate_jit(
      params, prompt_BT, lengths, jax.random.key(1),
      np.asarray(max_new, np.int32), target=Decoder(cfg),
      dcfg=engine.DecodeConfig(capacity=64, sampling=sampling, **drafter,
                               **kw),
      drafter_params=params if drafter else None, min_new_tokens=least)
  return ([st.tokens[b, lengths[b]:st.num_tokens[b]].tolist()
           for b in range(len(PROMPTS))],
          [engine.STOP_NAMES[int(r)] for r in st.stop_reason])


METHODS_4 = ["ar", "chain", "trie", "draft_model"]
SAMPLINGS = [SamplingParams(), SamplingParams(0.9, top_p=0.95)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", METHODS_4)
def test_stop_sequences_cut_at_the_first_one_generated(tiny, method,
                                                       sampling):
  """Invariant: with stop sequences a run's output is the same run's output
  without them, cut right after the first place one ends among the
  generated tokens (kept, like an EOS; reason "stop"), wherever it falls
  in a verify block or tree; never a token past it, and nothing else
  changes -- at T = 0 and T > 0, for AR, a chain, a trie and a model
  drafter."""
  cfg, params = tiny
  free, _ = _decode(params, cfg, method, sampling)
  stops = (tuple(free[0][4:6]), tuple(free[1][2:3]))
  cut, why = _decode(params, cfg, method, sampling, stop_sequences=stops)
  for out, got, reason in zip(free, cut, why):
    ends = [j + 1 for j in range(len(out))
            if any(tuple(out[j + 1 - len(s):j + 1]) == s and j + 1 >= len(s)
                   for s in stops)]
    assert got == out[:ends[0]] if ends else got == out
    assert reason == ("stop" if ends else "length")
  assert why[:2] == ["stop", "stop"]


@pytest.mark.parametrize("method", METHODS_4)
def test_min_new_tokens_masks_eos_as_transformers_does(tiny, method):
  """Invariant: below ``min_new_tokens`` a row's EOS logits are masked (as
  transformers' ``min_new_tokens``), so greedy output equals greedy
  decoding with those logits at -inf, recomputed over the whole sequence
  each step, for every method; per-row minimums and budgets are each
  row's own."""
  cfg, params = tiny
  free, _ = _decode(params, cfg, "ar", SamplingParams())
  eos = free[0][1]  # the second token row 0 generates
  least, budgets = [4, 0, 2, 6], [12, 3, 12, 8]
  got, why = _decode(params, cfg, method, SamplingParams(), max_new=budgets,
                     eos_ids=(eos,), min_new_tokens=np.int32(least))
  full = jax.jit(lambda t: decoder.forward(params, cfg, t,
                                         decoder.init_cache(cfg, 1, 32)).logits)
  for prompt, out, reason, m, n in zip(PROMPTS, got, why, least, budgets):
    seq = list(prompt)
    while len(seq) - len(prompt) < n:
      logits = full(jnp.array([seq + [0] * (32 - len(seq))]))[
          0, len(seq) - 1]
      if len(seq) - len(prompt) < m:
        logits = logits.at[eos].set(-jnp.inf)
      seq.append(int(jnp.argmax(logits)))
      if seq[-1] == eos:
        break
    assert out == seq[len(prompt):]
    assert reason == ("eos" if out[-1] == eos else "length")
    assert eos not in out[:m]
  # Without the minimum row 0 ends at its second token; with it, later.
  unmasked, _ = _decode(params, cfg, method, SamplingParams(),
                        max_new=budgets, eos_ids=(eos,))
  assert len(unmasked[0]) == 2 and len(got[0]) > 4


@pytest.mark.parametrize("method", METHODS_4)
def test_a_rows_output_is_its_own_in_any_batch(tiny, method):
  """Invariant: with a key per row (``runner.row_keys``: seed, prompt,
  sample), a row's tokens and log-probs at T > 0 are the same alone and
  inside batches of other sizes, compositions and orders, two samples of
  one prompt included -- for AR, a chain, a trie and a sampled model
  drafter."""
  from specjax.core import runner
  cfg, params = tiny
  drafter = {"ar": {}, "chain": dict(drafter=NGramDrafter(), num_draft=3),
             "trie": dict(drafter=NGramDrafter(num_paths=3), num_draft=3,
                          tree_nodes=6),
             "draft_model": dict(drafter=DraftModelDrafter(Decoder(cfg)),
                                 num_draft=3)}[method]
  dcfg = engine.DecodeConfig(capacity=64, sampling=SamplingParams(
      0.9, top_p=0.95), **drafter)
  prompt_of = [0, 1, 2, 3, 0, 1]  # rows 4, 5: prompts 0, 1's second sample
  keys = runner.row_keys(7, prompt_of, [0, 0, 0, 0, 1, 1])

  def run(order):
    prompt_BT, lengths = bucketing.pad_prompts(
        [PROMPTS[prompt_of[r]] for r in order])
    st = engine.generate_jit(params, prompt_BT, lengths,
                             keys[jnp.asarray(order)], np.int32(10),
                             target=Decoder(cfg), dcfg=dcfg,
                             drafter_params=params if drafter else None)
    return {r: (st.tokens[b, lengths[b]:st.num_tokens[b]].tolist(),
                np.asarray(st.logprobs[b, lengths[b]:st.num_tokens[b]]))
            for b, r in enumerate(order)}

  together = run(range(6))
  assert together[0][0] != together[4][0]  # two samples of one prompt
  for order in ([3], [5, 0], [2, 4, 1], [5, 4, 3, 2, 1, 0]):
    for r, (tokens, logprobs) in run(order).items():
      assert tokens == together[r][0], (order, r)
      np.testing.assert_allclose(logprobs, together[r][1], atol=1e-5)


@pytest.mark.parametrize("method", ["ar", "chain"])
def test_rows_with_their_own_sampling_share_one_compile(tiny, method,
                                                        monkeypatch):
  """Invariant: sampling values are data. A batch whose rows have
  different temperatures, top-k (rows without it among them), top-p,
  penalties and biases (a greedy row among them), then a sweep of those
  values, compile one generate (trace count); each row's tokens and
  log-probs are the ones it gets alone, in the program of its own settings
  (prompt index kept) -- AR and a chain."""
  from specjax.core import runner
  from specjax.drafters import AR, Method
  cfg, params = tiny
  model = Model(target=Decoder(dataclasses.replace(cfg, name="per-row")),
                params=params, tokenizer=None)
  m = (Method(drafter=NGramDrafter(), num_draft=3) if method == "chain"
       else AR)
  mixed = [SamplingParams(0.9, top_p=0.95), SamplingParams(),
           SamplingParams(1.3, top_p=0.8, presence_penalty=0.5),
           SamplingParams(0.6, top_k=5, repetition_penalty=1.2,
                          logit_bias={7: 2.0})]
  traces = []
  real_prefill = engine.prefill
  monkeypatch.setattr(engine, "prefill",
                      lambda *a, **k: traces.append(1) or real_prefill(*a, **k))
  run = lambda sampling, prompts=PROMPTS, first=0: runner.generate_ids(
      model, prompts, max_new_tokens=8, sampling=sampling, seed=3, method=m,
      first_prompt=first).rows
  together = run(mixed)
  swept = run([dataclasses.replace(sp, temperature=sp.temperature * 0.5,
                                   top_p=sp.top_p * 0.9)
               for sp in mixed])
  assert len(traces) == 1
  assert [r.output_ids for r in swept] != [r.output_ids for r in together]
  for i, sp in enumerate(mixed):
    alone, = run(sp, [PROMPTS[i]], first=i)
    assert alone.output_ids == together[i].output_ids, i
    np.testing.assert_allclose(alone.logprobs, together[i].logprobs,
                               atol=1e-5)
  assert not any(together[1].logprobs)  # the greedy row


def test_rows_whose_sampling_does_not_fit_the_program_are_refused():
  """Invariant: ``RowSampling.build`` refuses a row the program cannot
  honour, naming the row and the setting (never a silent clip)."""
  program = SamplingParams(0.7, top_k=8)
  for row, words in [(SamplingParams(0.7, top_k=9), "top_k must be at most"),
                     (SamplingParams(0.7, top_k=4, top_p=0.9), "top_p"),
                     (SamplingParams(0.7, top_k=4, min_p=0.1), "min_p"),
                     (SamplingParams(0.7, top_k=4, presence_penalty=1.0),
                      "penalties"),
                     (SamplingParams(0.7, top_k=4, logit_bias={3: 1.0}),
                      "biased tokens")]:
    with pytest.raises(ValueError, match=f"row 1.*{words}"):
      RowSampling.build(program, [SamplingParams(0.5, top_k=2), row])
  with pytest.raises(ValueError, match="greedy"):
    RowSampling.build(SamplingParams(), [SamplingParams(0.5)])
  # A greedy row fits any sampled program: its cuts are off; so does a
  # sampled row without top-k.
  rows = RowSampling.build(program, [SamplingParams(),
                                     SamplingParams(0.5, top_k=4),
                                     SamplingParams(0.5)])
  assert rows.top_k.tolist() == [0, 4, 0] and rows.temperature[0] == 0


def test_the_program_of_several_settings():
  """Invariant: ``program_of`` holds every setting it is given and no
  more: the sampled rows' widest top-k (a greedy row's cuts never count),
  each option on where a row uses it; a top-k of the vocabulary or more
  is written as off, so it compiles no top-k over the vocabulary."""
  V = 40
  rows = [sp.for_vocab(V) for sp in (
      SamplingParams(top_k=30, top_p=0.5), SamplingParams(0.7, top_k=50),
      SamplingParams(0.9, top_k=6, logit_bias={1: 1.0, 2: 1.0}),
      SamplingParams(0.8, frequency_penalty=0.3))]
  assert rows[1].top_k == 0
  program = SamplingParams.program_of(rows)
  assert program == SamplingParams(1.0, top_k=6, repetition_penalty=2.0,
                                   logit_bias=((0, 0.0),) * 2)
  RowSampling.build(program, rows)  # every row fits
  assert SamplingParams.program_of(rows[:2]) == SamplingParams(1.0)
  assert SamplingParams.program_of([rows[0]]) == SamplingParams()


@pytest.mark.parametrize("method", METHODS_4)
def test_a_position_the_hook_closes_ends_the_row(tiny, method):
  """Invariant: where the allowed-token hook allows no token (here: after
  the third generated one) the row ends there (reason "nonfinite", no
  token sampled from an empty distribution), its tokens before that the
  unconstrained run's -- the same wherever the position falls in a block
  or tree."""
  cfg, params = tiny

  def three_then_none(tokens_BS, num_tokens_B, prompt_lengths_B):
    open_B1 = (num_tokens_B - prompt_lengths_B < 3)[:, None]
    return jnp.broadcast_to(open_B1, (len(num_tokens_B), cfg.vocab_size))

  free, _ = _decode(params, cfg, method, SamplingParams())
  got, reasons = _decode(params, cfg, method, SamplingParams(),
                         allowed_tokens=three_then_none)
  assert got == [row[:3] for row in free]
  assert reasons == ["nonfinite"] * len(PROMPTS)


def test_an_eos_min_new_tokens_masks_is_not_allowed(tiny):
  """Invariant: a hook that allows only the EOS closes a position where
  ``min_new_tokens`` still masks the EOS: the row ends there with no
  token (never one drawn from all-masked logits); without the minimum it
  emits the EOS."""
  cfg, params = tiny
  eos = 2

  def only_eos(tokens_BS, num_tokens_B, prompt_lengths_B):
    return jnp.broadcast_to(jnp.arange(cfg.vocab_size) == eos,
                            (len(num_tokens_B), cfg.vocab_size))

  for sampling in SAMPLINGS:
    got, reasons = _decode(params, cfg, "chain", sampling, eos_ids=(eos,),
                           allowed_tokens=only_eos, min_new_tokens=3)
    assert got == [[]] * len(PROMPTS) and reasons == ["nonfinite"] * 4
    got, reasons = _decode(params, cfg, "chain", sampling, eos_ids=(eos,),
                           allowed_tokens=only_eos)
    assert got == [[eos]] * len(PROMPTS) and reasons == ["eos"] * 4


@pytest.mark.long  # ~1 min: a fresh process prefills 8,081 tokens
def test_a_long_prompt_prefills_in_bounded_memory():
  """Invariant: an 8,081-token SmolLM2 prompt (f32, the native path) and 8
  greedy tokens raise a fresh process's peak RSS by under 1.5 GiB over the
  loaded model (``benchmarks/prefill_memory.py``): its KV cache is 0.36 GiB
  and chunks of 512 keep the rest per chunk, where one forward over the
  prompt took 16.8 GiB more (docs/DESIGN.md, "Shapes and recompilation")."""
  import json
  import subprocess
  import sys
  run = subprocess.run([sys.executable, "-m", "benchmarks.prefill_memory",
                        "--lengths", "8081"], capture_output=True, text=True,
                       timeout=900)
  out = json.loads(run.stdout.splitlines()[-1])
  assert out["stop"] in ("length", "eos") and out["new_tokens"] >= 1, out
  assert out["peak_rss_gib"] - out["after_load_gib"] < 1.5, out


def _cache_copies_in_loop(params, cfg, dcfg) -> int:
  """Copies of a whole cache-layer buffer (``[1, G, H, S]`` or
  ``[1, G, S, H]``) in the compiled decode loop's body."""
  import re
  txt = engine.generate_jit.lower(
      params, np.zeros((1, 8), np.int32), np.array([5], np.int32),
      jax.random.key(0), np.int32(4), target=Decoder(cfg),
      dcfg=dcfg).compile().as_text()
  G, H, S = cfg.num_kv_heads, cfg.head_dim, dcfg.capacity
  shape = re.compile(rf"f32\[1,{G},({H},{S}|{S},{H})\]\S* copy\(")
  bodies = set(re.findall(r"body=%?([\w.\-]+)", txt))
  copies, name = 0, None
  for line in txt.splitlines():
    head = re.match(r"^%?([\w.\-]+) .*\{$", line)
    if head:
      name = head.group(1)
    elif name in bodies and shape.search(line):
      copies += 1
  return copies


@pytest.mark.parametrize("path", ["native", "xla"])
def test_decode_loop_never_copies_the_cache(tiny, path):
  """Invariant on both attention paths (packed weights and the CPU kernel;
  plain weights and XLA's attention, as on GPUs), batch 1: a decode step
  updates the carried KV cache in place. AR's forward writes each layer's
  entry before it attends; a write after the forward, ordered after
  nothing, made XLA copy every layer's buffers (all S slots) twice a step.
  On XLA's path the attention reads the written keys through a select;
  read straight into the score's dot, the key scatter was fused twice and
  each layer's key buffer copied four times a step. The n-gram chain
  writes after its ``lax.cond``, which orders the write after every
  read."""
  from specjax.kernels import native
  cfg, params = tiny
  if path == "native":
    if not native.available():
      pytest.skip("the native library is not built")
    params = decoder.pack_params(params)
  ar = engine.DecodeConfig(capacity=96)
  chain = engine.DecodeConfig(capacity=96, drafter=NGramDrafter(),
                              num_draft=3)
  assert _cache_copies_in_loop(params, cfg, ar) == 0
  assert _cache_copies_in_loop(params, cfg, chain) == 0
