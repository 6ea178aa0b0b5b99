"""PEARL (``core.pearl``): greedy output equals AR's token for token on a
ragged batch, both of its modes run, and what it cannot run is refused. The
chi-square against transformers' law and its mutation are
``test_exactness``'s (long stage)."""

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from specjax import testing
from specjax.core import bucketing, engine, pearl
from specjax.drafters import DraftModelDrafter, LayerSkipDrafter, NGramDrafter
from specjax.drafters.eagle import EagleDrafter
from specjax.heads.base import HeadConfig
from specjax.models.decoder import Decoder
from tests.forced_devices import run_worker

PROMPTS = [[5, 17, 3, 9, 1, 30], [9, 1, 30, 22, 4, 8, 2, 11, 7], [33, 4]]
NEW = 24


@pytest.fixture(scope="module")
def tiny():
  return testing.tiny("llama_gqa_tied", seed=0)


def _decode(run, params, cfg, **kw):
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  st = run(params, prompt_BT, lengths, jax.random.key(0), np.int32(NEW),
           target=Decoder(cfg),
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
  want, _ = _decode(engine.generate_jit, params, cfg)
  got, st = _decode(pearl.generate_jit, params, cfg, drafter=drafter,
                    num_draft=K)
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
      _decode(pearl.generate_jit, params, cfg, **kw)


@pytest.mark.long
def test_greedy_output_is_ars_on_smollm2(smollm2):
  """Invariant: on SmolLM2 (a ragged batch of 3 chat prompts, 32 new
  tokens) PEARL with layer-skip (24 of 30 layers) as its drafter emits AR's
  tokens, with drafts accepted and both modes run."""
  from specjax.core import runner
  prompts = [smollm2.tokenizer.encode_chat(p) for p in (
      "Name three primary colors.", "What is 12 times 12? Answer briefly.",
      "Write a haiku about the sea.")]
  ar = runner.generate_ids(smollm2, prompts, max_new_tokens=32)
  prompt_BT, lengths = bucketing.pad_prompts(prompts)
  dcfg = engine.DecodeConfig(
      capacity=bucketing.capacity_for(prompt_BT.shape[1], 32, extra=8),
      drafter=LayerSkipDrafter.from_target(smollm2.target, 24), num_draft=3,
      eos_ids=smollm2.config.eos_ids)
  st = pearl.generate_jit(smollm2.params, prompt_BT, lengths,
                          jax.random.key(0), np.int32(32),
                          target=smollm2.target, dcfg=dcfg,
                          drafter_params=smollm2.params)
  for b, row in enumerate(ar.rows):
    assert st.tokens[b, lengths[b]:st.num_tokens[b]].tolist() == row.output_ids
  pend = st.drafter_state
  assert int(pend.post_steps.sum()) > 0 and int(pend.pre_steps.sum()) > 0
  assert int(np.asarray(st.accepted_at).sum()) > 0


@pytest.mark.long
def test_greedy_output_on_device_groups_is_ars():
  """Invariant: on a (role=2, data=2) mesh of forced host devices (the
  drafter on two devices, the target on the other two, each pair splitting
  a ragged batch of 4) PEARL emits AR's tokens at T = 0, as it does on one
  device, with drafts accepted and both modes run."""
  out = run_worker("tests.pearl_worker", 4, "greedy")
  assert out["equal_one_device"] and out["equal_mesh"], out
  assert out["pre_steps"] > 0 and out["post_steps"] > 0, out
  assert out["accepted"] > 0, out


def test_a_shared_key_on_device_groups_is_refused(tiny):
  """Invariant: sampling on device groups with rows split over data and
  one key for the batch is refused (each device would draw its rows'
  drafts alike), naming the fix."""
  cfg, params = tiny
  mesh = AbstractMesh((2, 2, 1), (pearl.ROLE, "data", "model"))
  with pytest.raises(ValueError, match="give one key per row"):
    _decode(pearl.generate_jit, params, cfg, mesh=mesh,
            drafter=DraftModelDrafter(Decoder(cfg)), num_draft=2,
            sampling=engine.SamplingParams(0.8))
