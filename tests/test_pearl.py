"""PEARL (``core.pearl``, ``DecodeConfig(pearl=True)``): greedy output
equals AR's token for token on a ragged batch, through the engine, the
runner and the method grammar; both of its modes run; what it cannot run is
refused. The chi-square against transformers' law and its mutation are
``test_exactness``'s (long stage)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from specjax import testing
from specjax.core import bucketing, engine, pearl, runner
from specjax.drafters import (DraftModelDrafter, LayerSkipDrafter,
                              NGramDrafter, methods)
from specjax.drafters.base import Proposal, Stateless
from specjax.drafters.eagle import EagleDrafter
from specjax.heads.base import HeadConfig
from specjax.models.decoder import Decoder
from tests.forced_devices import run_worker
from tests.run_bound import generate_o1

PROMPTS = [[5, 17, 3, 9, 1, 30], [9, 1, 30, 22, 4, 8, 2, 11, 7], [33, 4]]
NEW = 24


@pytest.fixture(scope="module")
def tiny():
  return testing.tiny("llama_gqa_tied", seed=0)


def _decode(params, cfg, **kw):
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  st = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(0),
                           np.int32(NEW), target=Decoder(cfg),
                           dcfg=engine.DecodeConfig(capacity=64, **kw),
                           drafter_params=params if kw else None)
  return [st.tokens[b, lengths[b]:st.num_tokens[b]].tolist()
          for b in range(len(PROMPTS))], st


@pytest.mark.parametrize("name", ["self_draft", "layer_skip", "ngram"])
def test_greedy_output_is_ars_and_both_modes_run(tiny, name):
  """Invariant: at T = 0 PEARL emits AR's tokens, every row its own
  number a step; rows spend steps with drafts pending (post-verify) and
  with none (pre-verify), and with the target itself as the draft model
  (every draft accepted) a step emits K tokens."""
  cfg, params = tiny
  K = 3
  drafter = {"self_draft": DraftModelDrafter(Decoder(cfg)),
             "layer_skip": LayerSkipDrafter.from_target(Decoder(cfg), 1),
             "ngram": NGramDrafter()}[name]
  want, _ = _decode(params, cfg)
  got, st = _decode(params, cfg, drafter=drafter, num_draft=K, pearl=True)
  assert got == want
  pend = st.drafter_state
  assert int(pend.post_steps.sum()) > 0 and int(pend.pre_steps.sum()) > 0
  if name == "self_draft":  # one pre-verify step, then K tokens a step
    assert (np.asarray(pend.pre_steps) == 1).all()
    assert int(st.num_steps) <= -(-(NEW - 1) // K) + 1


def test_what_pearl_cannot_run_is_refused(tiny):
  """Invariant: a tree, a drafter that reads the target's features and no
  drafter at all are each refused with one line naming the problem."""
  cfg, params = tiny
  hcfg = HeadConfig.for_target(cfg, cfg.vocab_size)
  for kw, words in (
      (dict(drafter=NGramDrafter(num_paths=2), num_draft=2, tree_nodes=3),
       "PEARL drafts chains; tree_nodes=3"),
      (dict(drafter=EagleDrafter(hcfg), num_draft=2),
       "EagleDrafter reads the target's features"),
      ({}, "PEARL needs a drafter")):
    with pytest.raises(ValueError, match=words):
      _decode(params, cfg, pearl=True, **kw)
  for text, words in (
      ("eagle3:pearl=1",
       "pearl is for draft, layerskip, ngram, peagle; eagle3"),
      ("ngram:nodes=4:pearl=1", "pearl drafts chains"),
      ("ngram:pearl=2", "pearl must be 0 or 1, got 2")):
    with pytest.raises(methods.MethodError, match=words):
      methods.build(testing.tiny_model(), methods.MethodSpec.parse(text))


def test_the_method_grammar_runs_pearl_through_the_runner():
  """Invariant: ``layerskip:k=3:layers=1:pearl=1`` built by the method
  grammar decodes AR's greedy tokens through ``generate_ids`` and
  ``stream_ids`` (the same steps one at a time), the rows reporting steps
  in both modes (a row's together its verify forwards), and no PEARL
  counts for a plain method."""
  model = testing.tiny_model()
  kw = dict(max_new_tokens=NEW)
  ar = runner.generate_ids(model, PROMPTS, **kw)
  method = methods.build(model, methods.MethodSpec.parse(
      "layerskip:k=3:layers=1:pearl=1"))
  assert method.pearl
  for res in (runner.generate_ids(model, PROMPTS, method=method, **kw),
              runner.stream_ids(model, PROMPTS, lambda _: None,
                                method=method, **kw)):
    assert [r.output_ids for r in res.rows] == [r.output_ids for r in ar.rows]
    assert sum(r.pre_verify_steps for r in res.rows) > 0
    assert sum(r.post_verify_steps for r in res.rows) > 0
    for r in res.rows:
      assert r.pre_verify_steps + r.post_verify_steps == r.target_forwards
  assert all(r.pre_verify_steps == r.post_verify_steps == 0
             for r in ar.rows)


class _AlwaysZero(Stateless):
  """A deterministic drafter that drafts token 0 K times."""

  def propose(self, params, state, ctx, key, num_draft, sampling):
    B = ctx.tokens.shape[0]
    return Proposal(tokens=jnp.zeros((B, num_draft), jnp.int32), probs=None,
                    num_drafted=jnp.full((B,), num_draft, jnp.int32),
                    state=state)


def _constant_target(alpha: float):
  """A tiny target whose next-token distribution is the same at every
  position, token 0 with probability ``alpha``: its layers are zero (the
  residual stream stays the embedding), every token embeds alike, and its
  LM head's rows give the logits."""
  cfg, params = testing.tiny("qwen2_bias_untied")
  V, D = cfg.vocab_size, cfg.dim
  zero = jax.tree.map(jnp.zeros_like, params)
  logits = np.full(V, np.log((1 - alpha) / (V - 1)))
  logits[0] = np.log(alpha)
  return cfg, zero.replace(
      embed=jnp.ones((V, D)), final_norm=jnp.ones((D,)),
      lm_head=jnp.asarray(np.repeat(logits[:, None] / D, D, 1), jnp.float32))


@pytest.mark.long
@pytest.mark.parametrize("alpha", [0.6, 0.85])
def test_the_modes_follow_the_theorys_two_state_chain(alpha):
  """Invariant: with every draft accepted with probability α, independently
  (a target whose every position gives token 0 probability α, a drafter
  that always drafts token 0), PEARL's tokens per step and share of steps
  with nothing pending over 500 rows of 400 tokens at T = 1 (each row's
  first step, always pre-verify, and its last, cut at the budget, are a
  step in 200) match ``theory.pearl_steps`` within 0.02. The same numbers
  rule out a chain that takes a bonus token after an accepted chain
  (``expected_tokens(α, K)`` per post-verify step, 0.09 and 0.42 more), so
  the check can fail."""
  from specjax.measure import theory
  cfg, params = _constant_target(alpha)
  N, K, NEW = 500, 3, 400
  dcfg = engine.DecodeConfig(capacity=512, sampling=engine.SamplingParams(1.0),
                             drafter=_AlwaysZero(), num_draft=K, pearl=True)
  st = generate_o1(params, jnp.ones((N, 2), jnp.int32),
                   jnp.full((N,), 2, jnp.int32), jax.random.key(0),
                   np.int32(NEW), target=Decoder(cfg), dcfg=dcfg)
  p0 = float(jax.nn.softmax(Decoder(cfg).forward(
      params, jnp.ones((1, 1), jnp.int32),
      Decoder(cfg).init_cache(params, 1, 4)).logits[0, 0])[0])
  assert abs(p0 - alpha) < 1e-4
  pend = st.drafter_state
  steps = np.asarray(pend.pre_steps + pend.post_steps).sum()
  emitted = (np.asarray(st.num_tokens) - 2 - 1).sum()  # not the prefill's
  tokens, pre = emitted / steps, np.asarray(pend.pre_steps).sum() / steps
  want = theory.pearl_steps(alpha, K)
  assert abs(tokens - want.tokens) < 0.02, (tokens, want)
  assert abs(pre - want.pre_verify) < 0.02, (pre, want)
  bonus = want.pre_verify + (1 - want.pre_verify) * theory.expected_tokens(
      alpha, K)
  assert abs(tokens - bonus) > 0.05, (tokens, bonus)


@pytest.mark.long
def test_greedy_output_is_ars_on_smollm2_and_bench_predicts_two_groups(
    smollm2):
  """Invariant: on SmolLM2 (a ragged batch of 3 chat prompts, 32 new
  tokens) ``bench`` running ``layerskip:k=3:layers=24:pearl=1`` finds AR's
  tokens, drafts accepted, both modes counted (together the verify
  forwards), a forward over K tokens, and a two-group prediction above the
  one-device one (a step waits for the longer half, not both)."""
  from specjax.core.sampling import SamplingParams
  from specjax.measure import bench
  prompts = [smollm2.tokenizer.encode_chat(p) for p in (
      "Name three primary colors.", "What is 12 times 12? Answer briefly.",
      "Write a haiku about the sea.")]
  [res] = bench.run(smollm2, [methods.MethodSpec.parse(
      "layerskip:k=3:layers=24:pearl=1")], prompts, max_new_tokens=32,
      sampling=SamplingParams(), batch_size=3, progress=False)
  assert res["greedy_identical"] is True, res
  assert res["pre_verify_steps"] > 0 and res["post_verify_steps"] > 0
  assert (res["pre_verify_steps"] + res["post_verify_steps"]
          == res["target_forwards"])
  assert res["acceptance_per_position"][0] > 0 and res["verify_width"] == 3
  assert res["predicted_speedup_two_groups"] > res["predicted_speedup"]


@pytest.mark.long
def test_greedy_output_on_device_groups_is_ars():
  """Invariant: on a (role=2, data=2) mesh of forced host devices (the
  drafter on two devices, the target on the other two, each pair splitting
  a ragged batch of 4) PEARL emits AR's tokens at T = 0, as it does on one
  device, with drafts accepted and both modes run; so does a P-EAGLE head
  drafting behind the pending drafts (the target's half returning the
  head's features across the groups)."""
  out = run_worker("tests.pearl_worker", 4, "greedy")
  assert out["equal_one_device"] and out["equal_mesh"], out
  assert out["runner_equal_mesh"], out
  assert out["pre_steps"] > 0 and out["post_steps"] > 0, out
  assert out["accepted"] > 0, out
  assert out["peagle_equal_mesh"] and out["peagle_post_steps"] > 0, out


def test_a_shared_key_on_device_groups_is_refused(tiny):
  """Invariant: sampling on device groups with rows split over data and
  one key for the batch is refused (each device would draw its rows'
  drafts alike), naming the fix."""
  cfg, params = tiny
  mesh = AbstractMesh((2, 2, 1), (pearl.ROLE, "data", "model"))
  with pytest.raises(ValueError, match="give one key per row"):
    _decode(params, cfg, mesh=mesh, drafter=DraftModelDrafter(Decoder(cfg)),
            num_draft=2, sampling=engine.SamplingParams(0.8), pearl=True)
