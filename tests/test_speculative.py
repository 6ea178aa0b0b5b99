"""Speculative decoding through the engine: drafters, greedy identity, rollback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.core import bucketing, engine
from specjax.core import tree as trees
from specjax.core.sampling import SamplingParams, warp
from specjax.drafters import Context, NGramDrafter
from specjax.models.decoder import Decoder
from tests.run_bound import generate_o1

# Repetitive prompts so prompt lookup has something to find.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 1, 9, 1, 9],
           [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3], [20]]


# N-gram drafting as a chain and as a trie of its 3 best matches (depth 4,
# up to 8 nodes): every engine invariant below holds for both step kinds.
NGRAM = {"chain": dict(drafter=NGramDrafter(), num_draft=4),
         "tree": dict(drafter=NGramDrafter(num_paths=3), num_draft=4,
                      tree_nodes=8)}
both = pytest.mark.parametrize("how", sorted(NGRAM))


@pytest.fixture(scope="module")
def tiny():
  return testing.tiny("llama_gqa_tied", seed=0)


def test_ngram_proposals():
  """Invariant: the longest earlier suffix match (most recent on ties) gives
  the drafts; fewer continuation tokens -> fewer drafts; no match -> none."""
  tokens = jnp.array([[5, 6, 7, 8, 5, 6, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0],
                      [4, 9, 4, 0, 0, 0, 0, 0], [2, 7, 1, 2, 8, 1, 2, 0]])
  num = jnp.array([6, 3, 3, 7])
  prop = NGramDrafter(n_max=3).propose(None, None, Context(tokens, num), None,
                                       3, None)
  np.testing.assert_array_equal(prop.num_drafted, [3, 0, 2, 3])
  np.testing.assert_array_equal(prop.tokens, [[7, 8, 5], [0, 0, 0],
                                              [9, 4, 0], [8, 1, 2]])


def _run(params, cfg, dcfg, max_new=24, seed=0):
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  state = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(seed),
                              np.int32(max_new), target=Decoder(cfg), dcfg=dcfg)
  outs = [state.tokens[b, lengths[b]:state.num_tokens[b]].tolist()
          for b in range(len(PROMPTS))]
  return outs, state


@both
def test_greedy_ngram_equals_ar_and_cache_rolls_back(tiny, how):
  """Invariants at T = 0 on a ragged batch: (1) n-gram speculative output
  equals AR output token for token; (2) drafts were really accepted and
  rejected along the way (the test is not vacuous); (3) after the run, each
  row's cache below its length equals that of the AR run that never drafted
  (rejected entries were rolled back and overwritten); (4) both verify
  widths ran: K + 1 tokens, and the newest token alone on steps where no row
  had an n-gram match. For trees, (3) also shows the accepted path's
  entries were moved to contiguous slots."""
  cfg, params = tiny
  capacity = 64
  ar, ar_state = _run(params, cfg, engine.DecodeConfig(capacity=capacity))
  spec, st = _run(params, cfg, engine.DecodeConfig(capacity=capacity,
                                                   **NGRAM[how]))
  assert spec == ar
  accepted = np.asarray(st.accepted_at).sum(1)
  assert accepted.sum() > 0 and (accepted < np.asarray(st.num_drafted)).any()
  assert int(st.num_steps) < int(ar_state.num_steps)
  lengths = np.asarray(st.cache.lengths)
  np.testing.assert_array_equal(lengths, np.asarray(ar_state.cache.lengths))
  for layer in range(cfg.num_layers):
    for b, n in enumerate(lengths):
      np.testing.assert_allclose(st.cache.v[layer][b, :, :n],
                                 ar_state.cache.v[layer][b, :, :n], atol=1e-5)
      np.testing.assert_allclose(st.cache.k[layer][b, :, :, :n],
                                 ar_state.cache.k[layer][b, :, :, :n], atol=1e-5)


@both
def test_capacity_stops_speculation_where_ar_stops(tiny, how):
  """Invariant: with a hand-picked capacity (not ``capacity_for``) and a
  budget past it, greedy n-gram decoding fills every row's buffer exactly as
  AR does: same tokens, every slot used, stop reason capacity. (Stopping a
  row once ``num_tokens + K`` reached the capacity gave a strict prefix.)"""
  cfg, params = tiny
  capacity = bucketing.pad_prompts(PROMPTS)[0].shape[1] + 9
  ar, _ = _run(params, cfg, engine.DecodeConfig(capacity=capacity),
               max_new=100)
  spec, st = _run(params, cfg, engine.DecodeConfig(
      capacity=capacity, **NGRAM[how]), max_new=100)
  assert spec == ar
  for prompt, row, reason in zip(PROMPTS, spec, st.stop_reason):
    assert len(prompt) + len(row) == capacity
    assert int(reason) == engine.STOP_CAPACITY
  assert np.asarray(st.accepted_at).sum() > 0  # drafts were really used


@both
def test_steps_without_drafts_verify_one_token(tiny, how):
  """Invariant: a single row verifies K + 1 tokens on steps where it drafted
  and the newest token alone where the n-gram lookup found nothing, and the
  output still equals AR's (both branches of the verify ``lax.cond`` ran)."""
  cfg, params = tiny
  prompt_BT, lengths = bucketing.pad_prompts([PROMPTS[0]])
  outs = []
  for dcfg in (engine.DecodeConfig(capacity=64),
               engine.DecodeConfig(capacity=64, **NGRAM[how])):
    st = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(0),
                             np.int32(32), target=Decoder(cfg), dcfg=dcfg)
    outs.append(st.tokens[0, lengths[0]:st.num_tokens[0]].tolist())
  assert outs[0] == outs[1]
  assert 0 < int(st.num_wide) < int(st.num_steps), (st.num_wide, st.num_steps)


@both
def test_eos_and_budget_inside_an_emitted_block(tiny, how):
  """Invariant: tokens after an EOS inside an accepted block are dropped, and
  a block that would overshoot the budget is cut at it, exactly as in AR."""
  cfg, params = tiny
  free, _ = _run(params, cfg, engine.DecodeConfig(capacity=64), max_new=20)
  eos = free[0][5]
  for max_new in (7, 20):
    ar, _ = _run(params, cfg, engine.DecodeConfig(capacity=64, eos_ids=(eos,)),
                 max_new=max_new)
    spec, st = _run(params, cfg, engine.DecodeConfig(
        capacity=64, eos_ids=(eos,), **NGRAM[how]), max_new=max_new)
    assert spec == ar
    assert all(len(o) <= max_new for o in spec)


def test_eos_inside_an_accepted_block_is_cut(tiny):
  """Invariant (T = 0, the target as its own draft model, so every draft
  is accepted): with EOS set to the token AR emits third -- the second of
  the first verify's three accepted drafts -- each row stops there, in that
  first verify step, with AR's output up to and including the EOS; the
  accepted tokens after it in the block are dropped."""
  from specjax.drafters import DraftModelDrafter
  cfg, params = tiny
  free, _ = _run(params, cfg, engine.DecodeConfig(capacity=64), max_new=12)
  row = next(b for b, o in enumerate(free) if o[2] not in o[:2])
  eos = free[row][2]
  dcfg = lambda **kw: engine.DecodeConfig(
      capacity=64, eos_ids=(eos,), drafter=DraftModelDrafter(Decoder(cfg)),
      num_draft=3, **kw)
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  st = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(0),
                           np.int32(12), target=Decoder(cfg), dcfg=dcfg(),
                           drafter_params=params)
  out = st.tokens[row, lengths[row]:st.num_tokens[row]].tolist()
  assert out == free[row][:3]
  assert int(st.stop_reason[row]) == engine.STOP_EOS
  assert int(st.num_forwards[row]) == 1  # the prefill's sample + 1 verify
  assert np.asarray(st.accepted_at)[row].tolist() == [1, 1, 1]


@both
def test_sampled_speculative_runs_are_reproducible(tiny, how):
  """Invariant: at T > 0 the same key gives the same speculative output, and
  every row respects its budget and stays within the vocabulary."""
  cfg, params = tiny
  dcfg = engine.DecodeConfig(capacity=64, sampling=SamplingParams(0.9, 0, 0.95),
                             **NGRAM[how])
  a, _ = _run(params, cfg, dcfg, seed=3)
  b, _ = _run(params, cfg, dcfg, seed=3)
  assert a == b
  assert all(0 < len(o) <= 24 and max(o) < cfg.vocab_size for o in a)


@pytest.fixture(scope="module")
def tiny_draft():
  """A different random model over the same 37-token vocabulary."""
  return testing.tiny("llama_gqa_tied", seed=11)


@pytest.mark.long
def test_draft_model_greedy_identity(tiny, tiny_draft):
  """Invariants at T = 0: (1) with an unrelated draft model the output equals
  AR token for token; (2) with the target itself as the draft model every
  draft is accepted (K per full step), which checks the drafter's own cache
  bookkeeping and rollback: a stale or shifted draft cache would diverge."""
  from specjax.drafters import DraftModelDrafter
  cfg, params = tiny
  ar, ar_state = _run(params, cfg, engine.DecodeConfig(capacity=96), max_new=30)
  dcfg_cfg, dparams = tiny_draft
  k = 3
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)

  def spec(draft_cfg, draft_params):
    dcfg = engine.DecodeConfig(capacity=96, drafter=DraftModelDrafter(Decoder(draft_cfg)),
                               num_draft=k)
    st = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(0),
                             np.int32(30), target=Decoder(cfg), dcfg=dcfg,
                             drafter_params=draft_params)
    return [st.tokens[b, lengths[b]:st.num_tokens[b]].tolist()
            for b in range(len(PROMPTS))], st

  other, _ = spec(dcfg_cfg, dparams)
  assert other == ar
  self_out, st = spec(cfg, params)
  assert self_out == ar
  acc = np.asarray(st.accepted_at)
  fwd = np.asarray(st.num_forwards)
  # Every verify step but possibly the budget-cut last one accepts all K.
  assert (acc[:, k - 1] >= fwd - 1).all() and (fwd <= -(-29 // (k + 1)) + 1).all()



def test_layer_skip_and_dynamic_k_greedy_identity(tiny):
  """Invariants at T = 0: (1) layer-skip self-drafting (the target's first
  layer + its norm and head, drafter params = the target's own params) equals
  AR token for token; (2) so does dynamic K (``min_confidence``), and it
  drafts fewer tokens than fixed K while never more than K per step; (3) a
  threshold of 0 drafts exactly K per live step."""
  from specjax.drafters import LayerSkipDrafter
  cfg, params = tiny
  ar, _ = _run(params, cfg, engine.DecodeConfig(capacity=96), max_new=30)
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  k = 4

  def spec(min_conf):
    drafter = LayerSkipDrafter.from_target(Decoder(cfg), 1, min_confidence=min_conf)
    st = engine.generate_jit(
        params, prompt_BT, lengths, jax.random.key(0), np.int32(30),
        target=Decoder(cfg), dcfg=engine.DecodeConfig(capacity=96, drafter=drafter,
                                                num_draft=k),
        drafter_params=params)
    return [st.tokens[b, lengths[b]:st.num_tokens[b]].tolist()
            for b in range(len(PROMPTS))], st

  fixed, st_fixed = spec(0.0)
  dynamic, st_dyn = spec(0.5)
  assert fixed == ar and dynamic == ar
  drafted_fixed = np.asarray(st_fixed.num_drafted)
  np.testing.assert_array_equal(drafted_fixed,
                                k * np.asarray(st_fixed.num_forwards))
  drafted_dyn = np.asarray(st_dyn.num_drafted)
  assert drafted_dyn.sum() < drafted_fixed.sum()
  assert (drafted_dyn <= k * np.asarray(st_dyn.num_forwards)).all()
  with pytest.raises(ValueError, match=f"layers < {cfg.num_layers}"):
    LayerSkipDrafter.from_target(Decoder(cfg), cfg.num_layers)


def _joint_first_two(params, cfg, draft, n=50_000, min_conf=0.1, seed=0):
  """n rows of one prompt at T = 1, K = 2, dynamic-K draft model: the
  histogram of (generated token 1, generated token 2) and the exact joint
  q(t1) q(t2 | t1) from the target."""
  from specjax.drafters import DraftModelDrafter
  from specjax.models import decoder
  dcfg_, dparams = draft
  prompt = [5, 6, 7]
  prompt_BT = jnp.tile(jnp.array([prompt], jnp.int32), (n, 1))
  dcfg = engine.DecodeConfig(capacity=16, sampling=SamplingParams(1.0),
                             drafter=DraftModelDrafter(Decoder(dcfg_), min_conf),
                             num_draft=2)
  st = generate_o1(params, prompt_BT, jnp.full((n,), 3, jnp.int32),
                   jax.random.key(seed), np.int32(2), target=Decoder(cfg),
                   dcfg=dcfg, drafter_params=dparams)
  t1, t2 = np.asarray(st.tokens[:, 3]), np.asarray(st.tokens[:, 4])
  V = cfg.vocab_size
  counts = np.bincount(t1 * V + t2, minlength=V * V)
  seqs = jnp.array([prompt + [t] for t in range(V)], jnp.int32)
  logits = decoder.forward(params, cfg, seqs,
                         decoder.init_cache(cfg, V, 8)).logits
  q1 = jax.nn.softmax(logits[0, 2])
  q2 = jax.nn.softmax(logits[:, 3])
  expected = np.asarray(q1[:, None] * q2).ravel() * n
  drafted = np.asarray(st.num_drafted)
  return counts, expected, drafted


def _chi2(counts, expected):
  """Chi-square over cells expecting >= 5 draws (the rest pooled)."""
  import scipy.stats
  big = expected >= 5
  obs, exp = counts[big], expected[big]
  if (~big).any():
    obs = np.append(obs, counts[~big].sum())
    exp = np.append(exp, expected[~big].sum())
  stat = ((obs - exp) ** 2 / exp).sum()
  return stat, scipy.stats.chi2.ppf(0.999, len(obs) - 1)


@pytest.mark.long
def test_dynamic_k_keeps_sampling_exact(tiny, tiny_draft, monkeypatch):
  """Invariant (T = 1, 50,000 rows through the real engine): with dynamic K
  the first two generated tokens follow the target's joint distribution
  (chi-square below the 99.9% critical value), and rows really draft
  ragged numbers of tokens. Mutation: the tempting rule "draft only
  confident *tokens*" (the drawn token's own probability vs the threshold)
  biases the output and the same check must fail."""
  from specjax.drafters import chain
  cfg, params = tiny
  counts, expected, drafted = _joint_first_two(params, cfg, tiny_draft)
  stat, crit = _chi2(counts, expected)
  assert stat < crit, (stat, crit)
  assert 0 < (drafted < 2).mean() < 1  # the threshold really cut some rows

  def biased(logits_BV, probs_BV, tok_B, min_confidence):
    return probs_BV[jnp.arange(tok_B.shape[0]), tok_B] >= min_confidence

  monkeypatch.setattr(chain, "keep_drafting", biased)
  jax.clear_caches()
  counts, expected, _ = _joint_first_two(params, cfg, tiny_draft)
  stat, crit = _chi2(counts, expected)
  jax.clear_caches()
  assert stat > crit, (stat, crit)


TREE_MUTATIONS = {  # what a tree forward could get wrong
    "causal_mask": lambda anc, lengths: (
        jnp.tril(jnp.ones_like(anc)), trees.positions(lengths, anc)),
    "index_positions": lambda anc, lengths: (
        anc, lengths[:, None] + jnp.arange(anc.shape[1])[None, :]),
    "no_root_column": lambda anc, lengths: (
        anc.at[:, 1:, 0].set(False), trees.positions(lengths, anc)),
}


@pytest.mark.parametrize("mutation", [None] + sorted(TREE_MUTATIONS))
def test_tree_logits_equal_each_path_run_alone(tiny, mutation):
  """Invariant: one forward over a branching tree (depth positions, ancestor
  mask, on top of a ragged cached prefix) gives every node the logits of its
  root path run alone (f32, 1e-5). Mutations caught: a causal mask, index
  positions, a mask without the root column."""
  from specjax.models import decoder
  cfg, params = tiny
  forward = jax.jit(decoder.forward, static_argnums=1)
  prompts = [[5, 6, 7, 8, 9], [3, 4, 5]]
  prompt_BT, lengths = bucketing.pad_prompts(prompts)
  pre = forward(params, cfg, prompt_BT, decoder.init_cache(cfg, 2, 32))
  cache = pre.cache.with_lengths(lengths - 1)  # the last token is the root
  parents = jnp.asarray([[0, 0, 0, 1, 1, 2, 4, 6]] * 2)
  tokens = jnp.asarray([[9, 1, 2, 3, 4, 5, 6, 7], [5, 8, 9, 10, 11, 12, 13,
                                                  14]])
  valid = jnp.ones((2, 8), bool)
  anc = trees.ancestors(parents, valid)
  mask, positions = (anc, trees.positions(cache.lengths, anc)) if (
      mutation is None) else TREE_MUTATIONS[mutation](anc, cache.lengths)
  out = forward(params, cfg, tokens, cache, positions_BT=positions,
                mask_BTT=mask)
  # Every node's root path as its own row, right-padded (the causal mask
  # keeps the padding out of the last real position): one plain forward.
  seqs = [prompts[b][:-1] + [int(tokens[b, j]) for j in
                             np.flatnonzero(np.asarray(anc[b, m]))]
          for b in range(2) for m in range(8)]
  L = max(map(len, seqs))
  alone = forward(params, cfg, jnp.asarray([s + [0] * (L - len(s))
                                            for s in seqs]),
                  decoder.init_cache(cfg, len(seqs), 32)).logits
  last = jnp.asarray([len(s) - 1 for s in seqs])
  error = np.abs(np.asarray(out.logits.reshape(16, -1)
                            - alone[jnp.arange(16), last])).max()
  assert (error < 1e-5) == (mutation is None), error


def test_a_spine_tree_is_the_chain(tiny):
  """Invariant at T = 0: a trie of one n-gram path (a spine, K nodes)
  reproduces the chain step exactly: tokens, steps, per-position
  acceptance and drafts."""
  cfg, params = tiny
  chain, st_c = _run(params, cfg, engine.DecodeConfig(
      capacity=64, drafter=NGramDrafter(), num_draft=4))
  spine, st_t = _run(params, cfg, engine.DecodeConfig(
      capacity=64, drafter=NGramDrafter(num_paths=1), num_draft=4,
      tree_nodes=4))
  assert spine == chain
  for field in ("num_steps", "num_wide", "accepted_at", "num_drafted",
                "num_forwards"):
    np.testing.assert_array_equal(getattr(st_t, field), getattr(st_c, field))


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
  """The transformers-built random model the next test's prompt was chosen
  for (after 11 it continues 34, 25 or 11, so tries branch at the root)."""
  from specjax.models.hf_loader import load_hf
  from tests.tiny_hf import make_tiny
  d = tmp_path_factory.mktemp("spec_hf_tiny")
  make_tiny("llama_gqa_tied", d, seed=5)
  return load_hf(d)


@pytest.mark.long
def test_tree_steps_keep_sampling_exact(hf_tiny, monkeypatch):
  """Invariant (T = 0.6, 50,000 rows through the engine's tree step): with
  n-gram tries over a prompt where 11 was followed by 34, 25 and 11 (so the
  root has siblings, most rows accept a node), the first three generated
  tokens follow the target's joint distribution (chi-square over the cells
  expecting >= 5, the rest pooled, below the 99.9% critical value). The
  third token is drawn at an accepted node, so this checks the tree's
  positions and mask at T > 0. Mutation: RoPE positions from the node's
  index in the block instead of its depth (a bug peers shipped) must fail
  the same check."""
  from specjax.models import decoder
  cfg, params = hf_tiny
  n, V, sp = 50_000, cfg.vocab_size, SamplingParams(0.6)
  prompt = [5, 6, 11, 34, 25, 11, 25, 11, 11, 34, 11]
  L = len(prompt)

  def warped(seqs):
    seqs = jnp.asarray(seqs, jnp.int32)
    return np.asarray(warp(decoder.forward(params, cfg, seqs, decoder.init_cache(
        cfg, seqs.shape[0], 32)).logits, sp))

  q3 = warped([prompt + [a, b] for a in range(V) for b in range(V)])
  expected = (warped([prompt])[0, L - 1][:, None, None]
              * warped([prompt + [a] for a in range(V)])[:, L][:, :, None]
              * q3[:, L + 1].reshape(V, V, V)).ravel() * n

  def first_three():
    dcfg = engine.DecodeConfig(capacity=24, sampling=sp,
                               drafter=NGramDrafter(num_paths=3), num_draft=2,
                               tree_nodes=5)
    st = generate_o1(
        params, jnp.tile(jnp.array([prompt], jnp.int32), (n, 1)),
        jnp.full((n,), L, jnp.int32), jax.random.key(1), np.int32(3),
        target=Decoder(cfg), dcfg=dcfg)
    t = np.asarray(st.tokens[:, L:L + 3])
    return np.bincount((t[:, 0] * V + t[:, 1]) * V + t[:, 2],
                       minlength=V ** 3), st

  counts, st = first_three()
  stat, crit = _chi2(counts, expected)
  assert stat < crit, (stat, crit)
  assert (np.asarray(st.accepted_at)[:, 0] > 0).mean() > 0.5

  monkeypatch.setattr(trees, "positions", lambda lengths_B, anc_BMM: (
      lengths_B[:, None] + jnp.arange(anc_BMM.shape[1])[None, :]))
  jax.clear_caches()
  counts, _ = first_three()
  jax.clear_caches()
  stat, crit = _chi2(counts, expected)
  assert stat > crit, (stat, crit)
