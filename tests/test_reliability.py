"""What a library others build on must survive: non-finite logits,
batch composition, random shapes and degenerate distributions through the
verifiers, damaged head files."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from specjax import testing
from specjax.core import bucketing, engine, verify
from specjax.core.sampling import SamplingParams, warp
from specjax.drafters import Method, NGramDrafter
from specjax.models.decoder import Decoder

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 1, 9, 1, 9],
           [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3], [20, 21]]
METHODS = {"ar": {}, "ngram": dict(drafter=NGramDrafter(), num_draft=4),
           "ngram_trie": dict(drafter=NGramDrafter(num_paths=3), num_draft=4,
                              tree_nodes=8)}


@pytest.fixture(scope="module")
def tiny():
  """Untied embeddings: poisoning one input row leaves every logit finite
  until that token is fed."""
  return testing.tiny("qwen2_bias_untied", seed=2)


def _run(params, cfg, prompts, max_new=14, seed=0, sampling=SamplingParams(),
         drafter_params=None, **kw):
  prompt_BT, lengths = bucketing.pad_prompts(prompts)
  st_ = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(seed),
                            np.int32(max_new), target=Decoder(cfg),
                            dcfg=engine.DecodeConfig(capacity=64,
                                                     sampling=sampling, **kw),
                            drafter_params=drafter_params)
  return ([st_.tokens[b, lengths[b]:st_.num_tokens[b]].tolist()
           for b in range(len(prompts))],
          [engine.STOP_NAMES[int(r)] for r in st_.stop_reason])


def _poison(clean):
  """A token that row 2 generates at index j >= 2 and that nothing else
  (the other rows' prompts and outputs, row 2's prompt and earlier output)
  contains: ``(token, j)``."""
  others = set(t for b in (0, 1, 3) for t in PROMPTS[b] + clean[b])
  for j in range(2, len(clean[2])):
    t = clean[2][j]
    if t not in others and t not in PROMPTS[2] + clean[2][:j]:
      return t, j
  raise AssertionError("no token to poison; change the seed")


def _poisoned_run(tiny, method):
  """The batch with one embedding row NaN (and a row whose prompt holds
  it): ``(outputs, stop reasons, the clean outputs, where row 2 generates
  the poisoned token)``."""
  from specjax.drafters import DraftModelDrafter
  cfg, params = tiny
  clean, _ = _run(params, cfg, PROMPTS)
  t, j = _poison(clean)
  bad = params.replace(embed=params.embed.at[t].set(jnp.nan))
  kw = (dict(drafter=DraftModelDrafter(Decoder(cfg)), num_draft=3,
             drafter_params=params) if method == "draft_model"
        else METHODS[method])
  out, why = _run(bad, cfg, PROMPTS + [[t, 5]], **kw)
  return out, why, clean, j


@pytest.mark.parametrize("method", sorted(METHODS) + ["draft_model"])
def test_nonfinite_logits_stop_the_row_where_ar_would(tiny, method):
  """Invariant (T = 0): with one embedding row of the target set to NaN,
  (1) a row that generates that token emits exactly the clean AR output up
  to and including it, then stops as "nonfinite"; (2) a row whose prompt
  holds it emits nothing and stops as "nonfinite"; (3) the other rows are
  untouched. AR, n-gram chains and tries, and a draft model (the clean
  target: it drafts the poisoned token inside a block, and the step must
  cut its drafts before the first non-finite position; and the attention
  must keep a NaN value at a later block position out of the earlier
  positions' outputs, or (3) fails: 0 x NaN).
  test_the_nonfinite_check_catches_a_missing_cut shows (1) failing
  without the cut."""
  out, why, clean, j = _poisoned_run(tiny, method)
  assert out[2] == clean[2][:j + 1] and why[2] == "nonfinite"
  assert out[4] == [] and why[4] == "nonfinite"
  for b in (0, 1, 3):
    assert out[b] == clean[b] and why[b] == "length"


@pytest.mark.long
def test_the_nonfinite_check_catches_a_missing_cut(tiny, monkeypatch):
  """Invariant (mutation check): a chain step that verifies its drafts
  past the first non-finite position (the cut removed) lets the
  draft-model row emit a token read from zeroed NaN logits after the
  poisoned one, and the check above fails."""
  real = engine._chain_cut

  def uncut(logits_BTV, num_draft_B):
    logits, _, _ = real(logits_BTV, num_draft_B)
    return logits, num_draft_B, jnp.full_like(num_draft_B, logits.shape[1])

  monkeypatch.setattr(engine, "_chain_cut", uncut)
  jax.clear_caches()
  try:
    out, why, clean, j = _poisoned_run(tiny, "draft_model")
  finally:
    jax.clear_caches()
  assert out[2] != clean[2][:j + 1]


@pytest.mark.long
def test_a_rows_output_does_not_depend_on_its_batch(tiny):
  """Invariant: row 0's output (greedy, and sampled with a fixed seed at
  the same batch index) is the same whatever the other rows are —
  different prompts, lengths, stops and drafts — for AR and n-gram."""
  cfg, params = tiny
  alone = [PROMPTS[0]]
  companions = ([PROMPTS[0], PROMPTS[2], PROMPTS[3]],
                [PROMPTS[0], [7] * 20, [1]])
  for sampling in (SamplingParams(), SamplingParams(0.8, top_p=0.9)):
    for method in ("ar", "ngram"):
      ref, _ = _run(params, cfg, alone, sampling=sampling, **METHODS[method])
      for batch in companions:
        got, _ = _run(params, cfg, batch, sampling=sampling,
                      **METHODS[method])
        assert got[0] == ref[0], (sampling, method)


def _dist(kind: str, rng, V: int) -> np.ndarray:
  if kind == "one_hot":
    return np.eye(V)[rng.integers(V)]
  if kind == "uniform":
    return np.full(V, 1.0 / V)
  return rng.dirichlet(np.full(V, 0.3))


# Jitted: a few shapes, each compiled once (eager ops would compile per op).
_warp = jax.jit(warp, static_argnums=1)
_verify_chain = jax.jit(verify.verify_chain, static_argnames="greedy")


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(B=st.sampled_from([1, 3]), K=st.sampled_from([0, 1, 4]),
       V=st.sampled_from([2, 9]),
       seed=st.integers(0, 2**31 - 1),
       kinds=st.tuples(*[st.sampled_from(["one_hot", "uniform", "random"])]
                       * 2),
       top_k=st.integers(0, 3), top_p=st.sampled_from([1.0, 0.5, 1e-6]),
       temperature=st.sampled_from([0.0, 0.7, 1.0]))
def test_chain_verification_invariants(B, K, V, seed, kinds, top_k, top_p,
                                       temperature):
  """Invariants of ``verify_chain`` over random shapes (B 1 or 3, K 0, 1
  or 4, V 2 or 9; num_draft 0..K per row), degenerate target and draft distributions (one-hot,
  uniform) and warps that remove all but one token (top-k 1, top-p 1e-6):
  (1) 0 <= accepted <= num_draft and emitted = accepted + 1; (2) the
  emitted tokens are the accepted drafts followed by one more; (3) every
  emitted token has positive probability under the warped target at its
  position; (4) at T = 0 the emitted tokens are the greedy path; (5) a
  draft with zero target probability is never accepted."""
  rng = np.random.default_rng(seed)
  sp = SamplingParams(temperature, top_k, top_p)
  logits = np.log(np.stack([[_dist(kinds[0], rng, V) for _ in range(K + 1)]
                            for _ in range(B)]) + 1e-30)
  q = np.asarray(_warp(jnp.asarray(logits, jnp.float32), sp))
  p = np.stack([[_dist(kinds[1], rng, V) for _ in range(K)]
                for _ in range(B)]).reshape(B, K, V)
  drafts = np.stack([[rng.choice(V, p=p[b, i]) for i in range(K)]
                     for b in range(B)]).reshape(B, K).astype(np.int32)
  num_draft = rng.integers(0, K + 1, B).astype(np.int32)
  res = _verify_chain(jnp.asarray(drafts),
                            None if sp.greedy else jnp.asarray(p, jnp.float32),
                            jnp.asarray(q), jnp.asarray(num_draft),
                            jax.random.key(seed), greedy=sp.greedy)
  acc, n, toks = (np.asarray(res.num_accepted), np.asarray(res.num_emitted),
                  np.asarray(res.tokens))
  assert ((0 <= acc) & (acc <= num_draft)).all() and (n == acc + 1).all()
  for b in range(B):
    assert (toks[b, :acc[b]] == drafts[b, :acc[b]]).all()
    for i in range(n[b]):
      assert q[b, i, toks[b, i]] > 0, (b, i)
      if sp.greedy:
        assert toks[b, i] == np.argmax(q[b, i])


def test_damaged_head_files_are_named(tmp_path):
  """A truncated or foreign head file fails with one error naming it."""
  from specjax.heads.export import load_head
  from specjax.models.config import ModelConfig
  cfg = ModelConfig(vocab_size=37, dim=24, num_layers=3, num_heads=6,
                    num_kv_heads=2, head_dim=4, ffn_dim=40)
  truncated = tmp_path / "truncated.npz"
  truncated.write_bytes(b"PK\x03\x04" + b"\x00" * 40)
  foreign = tmp_path / "foreign.npz"
  np.savez(foreign, weights=np.zeros(3))
  bad_meta = tmp_path / "bad_meta.npz"
  np.savez(bad_meta, meta=np.frombuffer(b'{"config": {"x": 1}}', np.uint8))
  for path in (truncated, foreign, bad_meta):
    with pytest.raises(ValueError, match=path.name):
      load_head(path, cfg)


def test_head_files_that_do_not_match_their_config_are_named(tmp_path):
  """Invariant: a head file whose parameters are missing, extra or shaped
  otherwise than its own config says, or whose draft ids are no draft
  vocabulary of the target (out of range, repeated), is refused naming the
  file and the parameter -- it used to reach the native kernel's shape
  check."""
  from flax import traverse_util
  from specjax.heads import HeadConfig, head_module
  from specjax.heads.export import load_head, save_head
  cfg = HeadConfig(target_dim=24, target_vocab=37, target_layers=3,
                   taps=(0, 1, 2), num_heads=6, num_kv_heads=2, head_dim=4,
                   ffn_dim=40, draft_vocab=29)
  params = head_module(cfg).init(
      jax.random.key(0), jnp.zeros((1, 1, 72)), jnp.zeros((1, 1), jnp.int32),
      jnp.zeros((37, 24)), jnp.zeros((1, 1), jnp.int32))["params"]
  flat = traverse_util.flatten_dict(params, sep="/")
  ids = np.arange(29)
  good = tmp_path / "good.npz"
  save_head(good, cfg, params, ids)
  assert load_head(good)[0] == cfg
  bad = {"missing": ({k: v for k, v in flat.items() if k != "layer/wo"}, ids,
                     "layer/wo is missing"),
         "shape": ({**flat, "fc/kernel": flat["fc/kernel"][:, :5]}, ids,
                   "fc/kernel is (72, 5), its config says (72, 24)"),
         "extra": ({**flat, "spare/kernel": flat["fc/kernel"]}, ids,
                   "spare/kernel is (72, 24), its config says no such"),
         "ids out of range": (flat, ids + 10, "draft_ids must be 29 distinct"),
         "ids repeated": (flat, np.zeros(29, int), "draft_ids must be")}
  for name, (tensors, draft_ids, words) in bad.items():
    path = tmp_path / f"{name.replace(' ', '_')}.npz"
    save_head(path, cfg, traverse_util.unflatten_dict(tensors, sep="/"),
              draft_ids)
    with pytest.raises(ValueError, match=re.escape(words)):
      load_head(path)


def test_prompt_at_the_context_limit(tiny):
  """A prompt of ``max_position - max_new_tokens`` tokens (the longest the
  CLI accepts: tests/test_cli.py refuses one more) decodes its whole
  budget, AR and n-gram drafting K = 4 past the last position alike."""
  from specjax.core import runner
  from specjax.models.registry import Model
  cfg, params = tiny
  model = Model(target=Decoder(cfg), params=params, tokenizer=None)
  # Every token once (an n-gram match after whatever comes next), then a
  # repeat up to the limit.
  prompt = [(list(range(cfg.vocab_size))
             + [3, 4] * cfg.max_position)[:cfg.max_position - 4]]
  outs = [runner.generate_ids(model, prompt, max_new_tokens=4, **kw).rows[0]
          for kw in ({}, dict(method=Method(NGramDrafter(), num_draft=4)))]
  assert outs[0].output_ids == outs[1].output_ids
  assert [len(r.output_ids) for r in outs] == [4, 4]
  assert [r.stop_reason for r in outs] == ["length", "length"]
  assert outs[1].num_drafted > 0  # the n-gram run drafted near the end


_ROLLBACK_B, _ROLLBACK_T, _ROLLBACK_S = 3, 4, 32


@pytest.fixture(scope="module")
def rollback_programs(tiny):
  """Two jitted programs of fixed shapes: ``block`` (prefill ragged rows,
  score a block of T tokens, keep ``keep[b]`` of them by lengths, feed one
  more token) and ``fresh`` (the committed tokens from scratch, then the
  same token)."""
  from specjax.models import decoder
  cfg, params = tiny
  B, T, S = _ROLLBACK_B, _ROLLBACK_T, _ROLLBACK_S

  @jax.jit
  def block(prompt_BP, lengths_B, block_BT, keep_B, next_B):
    cache = decoder.forward(params, cfg, prompt_BP,
                          decoder.init_cache(cfg, B, S)).cache
    cache = cache.with_lengths(lengths_B)
    out = decoder.forward(params, cfg, block_BT, cache, write_cache=False)
    cache = cache.write(out.new_kv, cache.new_slots(T)).with_lengths(
        lengths_B + keep_B)
    return decoder.forward(params, cfg, next_B[:, None], cache).logits[:, 0]

  @jax.jit
  def fresh(seq_BX, lengths_B, next_B):
    cache = decoder.forward(params, cfg, seq_BX,
                          decoder.init_cache(cfg, B, S)).cache
    return decoder.forward(params, cfg, next_B[:, None],
                         cache.with_lengths(lengths_B)).logits[:, 0]
  return block, fresh


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_rollback_equals_a_fresh_forward(rollback_programs, seed):
  """Invariant over random ragged prompts (1-12 tokens), random blocks and
  a random number of kept block entries per row (0 to all, 0 = the whole
  block rejected): writing a scored block into the cache and rolling each
  row back by its length leaves exactly the cache of the committed tokens
  — the next token's logits equal a fresh forward's (1e-5)."""
  block, fresh = rollback_programs
  B, T = _ROLLBACK_B, _ROLLBACK_T
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 13, B)
  prompt = rng.integers(0, 41, (B, 16))
  blk = rng.integers(0, 41, (B, T))
  keep = rng.integers(0, T + 1, B)
  nxt = rng.integers(0, 41, B)
  seq = np.zeros((B, 16 + T), np.int64)
  for b in range(B):
    committed = list(prompt[b, :lengths[b]]) + list(blk[b, :keep[b]])
    seq[b, :len(committed)] = committed
  i32 = lambda a: jnp.asarray(a, jnp.int32)
  got = block(i32(prompt), i32(lengths), i32(blk), i32(keep), i32(nxt))
  want = fresh(i32(seq), i32(lengths + keep), i32(nxt))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_bad_api_arguments_are_typed_errors(tiny):
  """Invariant: ``generate_ids`` refuses, with a ``TypeError`` or
  ``ValueError`` naming the argument, what would otherwise run wrong: ids
  that are not ints (1.5 was truncated to 1), ids outside the vocabulary
  (NaN embeddings), a budget past the context (positions the model never
  saw) or not an int, draft knobs without a drafter (AR, silently), a block
  wider than the context, a seed that is not an int. A 2-D array of ids is
  a batch of rows."""
  from specjax.core import runner
  from specjax.models.registry import Model
  cfg, params = tiny
  model = Model(target=Decoder(cfg), params=params, tokenizer=None)
  ctx = cfg.max_position
  bad = [
      (dict(prompts=[[1.5, 2]]), TypeError, "a token id must be an int"),
      (dict(prompts=[[True, 2]]), TypeError, "a token id must be an int"),
      (dict(prompts=[[1, cfg.vocab_size]]), ValueError, "outside the vocab"),
      (dict(prompts=[[1, -1]]), ValueError, "outside the vocabulary"),
      (dict(max_new_tokens=ctx), runner.ContextError, "exceed the model's"),
      (dict(max_new_tokens=4.0), TypeError, "max_new_tokens must be an int"),
      (dict(method="ngram"), TypeError, "method must be a specjax Method"),
      (dict(method=Method(NGramDrafter(), num_draft=ctx)),
       runner.ContextError, "wider than the model's context"),
      (dict(seed="1"), TypeError, "seed must be an int")]
  for kw, error, words in bad:
    kw = {"prompts": [[1, 2, 3]], "max_new_tokens": 2, **kw}
    with pytest.raises(error, match=re.escape(words)):
      runner.generate_ids(model, **kw)
  with pytest.raises(ValueError, match="need a drafter; without one the "
                     "method is AR"):
    Method(num_draft=3)  # K without a drafter: refused, not decoded as AR
  rows = runner.generate_ids(model, np.array([[1, 2, 3], [1, 2, 3]]),
                             max_new_tokens=2).rows
  assert rows[0].output_ids == rows[1].output_ids and len(rows) == 2


def test_runner_takes_per_row_budgets_minimums_and_stops():
  """Invariant: ``generate_ids`` gives each prompt its own budget and
  minimum and cuts at a stop sequence (reason "stop"), the rows otherwise
  as one budget for all gives them; a list of the wrong length, a budget
  below 1 and an empty stop sequence are refused with one line naming
  them."""
  from specjax.core import runner
  model = testing.tiny_model()
  prompts = [[5, 17, 3], [9, 1, 30, 22], [33, 4]]
  free = runner.generate_ids(model, prompts, max_new_tokens=8).rows
  stop = free[1].output_ids[2:4]
  rows = runner.generate_ids(model, prompts, max_new_tokens=[3, 8, 5],
                             min_new_tokens=[0, 1, 2], stop=[stop]).rows
  assert rows[0].output_ids == free[0].output_ids[:3]
  assert rows[1].output_ids == free[1].output_ids[:4]
  assert rows[1].stop_reason == "stop"
  assert rows[2].output_ids == free[2].output_ids[:5]
  for kw, words in ((dict(max_new_tokens=[3, 8]), "max_new_tokens gives 2 "
                     "values for 3 prompts"),
                    (dict(max_new_tokens=[3, 0, 1]), "max_new_tokens must "
                     "be >= 1, got 0"),
                    (dict(max_new_tokens=4, stop=[[]]), "each stop sequence "
                     "must be a non-empty tuple")):
    with pytest.raises(ValueError, match=re.escape(words)):
      runner.generate_ids(model, prompts, **kw)


def test_compiled_programs_go_near_the_mapping_limit(monkeypatch):
  """Invariant: ``clear_compiled`` gives back the memory mappings of every
  program ``generate_ids`` compiled (a few hundred each), and
  ``generate_ids`` calls it itself, before compiling, once the process
  holds over three quarters of the mappings it may (65,530 by default on
  Linux; a test worker that kept every program crashed inside XLA there)."""
  import gc
  import os
  from specjax.core import runner
  if not os.path.exists("/proc/self/maps"):
    pytest.skip("counts mappings in /proc/self/maps (Linux)")
  model = testing.tiny_model()
  batches = ([[5, 6, 7]], [[5] * 33], [[5, 6, 7]] * 2)  # three programs
  first = runner.generate_ids(model, batches[0], max_new_tokens=4).rows
  runner.clear_compiled()
  gc.collect()
  before = runner._mappings_held()
  for prompts in batches[:2]:
    runner.generate_ids(model, prompts, max_new_tokens=4)
  held = runner._mappings_held()
  assert held - before > 2 * 100, (before, held)
  monkeypatch.setattr(runner, "_mapping_limit", lambda: held)
  runner.generate_ids(model, batches[2], max_new_tokens=4)
  gc.collect()
  assert len(runner._EXECUTABLES) == 1
  assert runner._mappings_held() < held - 100, (before, held)
  monkeypatch.undo()
  again = runner.generate_ids(model, batches[0], max_new_tokens=4).rows
  assert again[0].output_ids == first[0].output_ids  # compiled anew
  runner.clear_compiled()
  gc.collect()
  assert runner._mappings_held() < before + 50, (before, held)


def test_rows_report_speculation_in_vllms_per_request_schema():
  """Invariant: ``RowResult.spec_metrics`` has vLLM's per-request fields,
  consistent with the row's own counts: steps = the histogram's total,
  accepted drafts = its first moment = the per-position acceptances,
  1 + accepted per step, accepted over drafted; an AR row speculates
  nothing. (The target drafting for itself: every draft accepted.)"""
  from specjax.core import runner
  from specjax.drafters import DraftModelDrafter
  model = testing.tiny_model()
  prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9, 1, 9, 1, 9, 1, 3]]
  ar, spec = (runner.generate_ids(model, prompts, max_new_tokens=16,
                                  method=m).rows
              for m in (Method(), Method(DraftModelDrafter(model.target),
                                         model.params, 3)))
  for row in spec:
    m = row.spec_metrics
    hist = m["acceptance_histogram"]
    assert m["num_spec_steps"] == sum(hist) == row.target_forwards > 0
    assert (m["num_accepted_draft_tokens"]
            == sum(j * n for j, n in enumerate(hist)) == sum(row.accepted_at))
    assert m["mean_acceptance_length"] == pytest.approx(
        1 + m["num_accepted_draft_tokens"] / m["num_spec_steps"])
    assert m["draft_acceptance_rate"] == pytest.approx(
        m["num_accepted_draft_tokens"] / m["num_draft_tokens"])
  assert spec[0].spec_metrics["draft_acceptance_rate"] == 1.0
  assert ar[0].spec_metrics["num_draft_tokens"] == 0
  assert ar[0].spec_metrics["mean_acceptance_length"] == 1.0


def test_groups_of_samples_are_prompt_major_and_each_rows_own():
  """Invariant: ``num_samples`` N gives N rows per prompt, prompt-major,
  each naming its prompt and sample; a row's output depends on (seed,
  prompt index, sample index) alone: the same rows come back when one
  prompt's group runs by itself (``first_prompt``), and samples differ."""
  from specjax.core import runner
  from specjax.core.sampling import SamplingParams
  model = testing.tiny_model()
  prompts = [[5, 17, 3], [9, 1, 30, 22], [33, 4]]
  kw = dict(max_new_tokens=8, sampling=SamplingParams(0.9), seed=3,
            num_samples=2)
  rows = runner.generate_ids(model, prompts, **kw).rows
  assert [(r.prompt_index, r.sample_index) for r in rows] == [
      (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
  assert [r.prompt_ids for r in rows] == [p for p in prompts for _ in "ab"]
  alone = runner.generate_ids(model, prompts[1:2], first_prompt=1, **kw).rows
  assert [r.output_ids for r in alone] == [r.output_ids for r in rows[2:4]]
  assert rows[2].output_ids != rows[3].output_ids
