"""specjax as Tunix's rollout engine (``specjax.integrations.tunix``),
against Tunix's own code (google-tunix 0.1.7, installed by ``make
test-long``): its Llama 3 is specjax's decoder, the adapter's log-probs
are Tunix's ``compute_per_token_logps``, its rollouts are specjax's, and
Tunix's GRPO learner trains with them (n-gram and an EAGLE-3 head)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax
from flax import nnx
from grain import python as grain
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.models.llama3 import model as llama3
from tunix.rl import common as tunix_common
from tunix.rl import rl_cluster as rl
from tunix.rl.grpo import grpo_learner as grpo
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common

from specjax.core import bucketing, engine
from specjax.core.runner import row_keys
from specjax.core.sampling import SamplingParams
from specjax.drafters import AR, Method, NGramDrafter
from specjax.integrations.tunix import (SpecjaxRollout, llama3_params,
                                        llama3_target)

pytestmark = pytest.mark.long  # conftest: collected by long runs only

PROMPTS = ["input string", "hello world", "My name", "hello there"]


@pytest.fixture(autouse=True)
def _tunix_promotes_ranks():
  """Tunix's modules broadcast ranks implicitly (its RMSNorm: ``[D] * [B,
  T, D]``), which the suite's ``jax_numpy_rank_promotion='raise'``
  refuses (set process-wide: Tunix's learner runs in threads of its
  own)."""
  before = jax.config.jax_numpy_rank_promotion
  jax.config.update("jax_numpy_rank_promotion", "allow")
  yield
  jax.config.update("jax_numpy_rank_promotion", before)


def _actor(seed=0):
  vocab = test_common.MockVocab()
  cfg = llama3.ModelConfig(
      num_layers=2, vocab_size=vocab.GetPieceSize(), embed_dim=32,
      hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2,
      rope_theta=10_000, norm_eps=1e-6, weight_tying=True)
  return vocab, cfg, llama3.Llama3(cfg, rngs=nnx.Rngs(seed))


def _rollout_config(**kw):
  return base_rollout.RolloutConfig(**{**dict(
      max_tokens_to_generate=8, max_prompt_length=16, temperature=0.9), **kw})


def test_tunix_llama3_is_the_specjax_decoder():
  """Invariant: ``llama3_params`` of a Tunix Llama 3 give Tunix's logits
  (1e-5), tied and untied."""
  for tied in (True, False):
    vocab, cfg, actor = _actor()
    if not tied:
      cfg = llama3.ModelConfig(**{**vars(cfg), "weight_tying": False})
      actor = llama3.Llama3(cfg, rngs=nnx.Rngs(1))
    tokens = jnp.asarray([[1, 5, 7, 9, 3, 4, 11]], jnp.int32)
    want, _ = actor(tokens, jnp.arange(7)[None], None,
                    jnp.tril(jnp.ones((1, 7, 7), bool)))
    target, params = llama3_target(cfg), llama3_params(actor)
    got = target.forward(params, tokens,
                         target.init_cache(params, 1, 8)).logits
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("method", ["ar", "ngram"])
def test_rollouts_and_logps_are_specjaxs_and_tunixs(method):
  """Invariant: the adapter's completions are ``engine.generate``'s with
  the same keys (EOS dropped, as Tunix's sampler does), its rollout
  log-probs are the verify pass's, and ``get_per_token_logps`` equals
  Tunix's own ``compute_per_token_logps`` on the actor at the rollout
  temperature (1e-5) -- which, without top-k/top-p, is the rollout's."""
  vocab, cfg, actor = _actor()
  tok = TokenizerAdapter(vocab)
  m = (Method(drafter=NGramDrafter(), num_draft=3) if method == "ngram"
       else AR)
  rollout = SpecjaxRollout(rollout_actor=actor, tokenizer=tok, method=m,
                           native=False)
  rc = _rollout_config()
  out = rollout.generate(PROMPTS, rc)
  ids = [[vocab.bos_id()] + tok.encode(p) for p in PROMPTS]
  prompt, lengths = bucketing.pad_prompts(ids)
  st = engine.generate_jit(
      llama3_params(actor), prompt, lengths,
      row_keys(0, [0] * 4, range(4)), np.int32(8), target=llama3_target(cfg),
      dcfg=engine.DecodeConfig(
          capacity=bucketing.capacity_for(prompt.shape[1], 8, extra=4),
          sampling=SamplingParams(0.9), eos_ids=(vocab.eos_id(),),
          drafter=m.drafter, num_draft=m.num_draft))
  completion = np.zeros((4, 8), np.int32)
  for b, n in enumerate(lengths):
    mine = np.asarray(st.tokens[b, n:st.num_tokens[b]])
    if int(st.stop_reason[b]) == engine.STOP_EOS:
      mine = mine[:-1]
    np.testing.assert_array_equal(out.tokens[b], mine)
    completion[b, :len(mine)] = mine
  logps = np.asarray(rollout.get_per_token_logps(
      out.left_padded_prompt_tokens, completion))
  graph, state = nnx.split(actor)
  want = tunix_common.compute_per_token_logps(
      graph, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
      completion_tokens=jnp.asarray(completion), pad_id=vocab.pad_id(),
      eos_id=vocab.eos_id(), temperature=0.9)
  valid = completion != vocab.pad_id()
  np.testing.assert_allclose(logps[valid], np.asarray(want)[valid],
                             atol=1e-5)
  for b in range(4):
    np.testing.assert_allclose(out.logprobs[b], logps[b, :len(out.tokens[b])],
                               atol=1e-5)


def _eagle3(cfg):
  """An untrained EAGLE-3 head on the target, its embedding read from the
  params each sync gives."""
  from specjax.drafters.eagle import EagleDrafter, EagleParams
  from specjax.heads.base import HeadConfig
  from specjax.heads.vocab import build_draft_vocab
  from specjax.training.train import init_head
  target = llama3_target(cfg)
  scfg = target.config
  hcfg = HeadConfig.for_target(scfg, 12, variant="eagle3", taps=(0, 1, 2))
  stream = np.random.default_rng(1).zipf(1.5, 400) % scfg.vocab_size
  vocab = build_draft_vocab([stream], scfg.vocab_size, 12)
  _, _, actor = _actor()
  head = init_head(jax.random.key(2), hcfg, target, llama3_params(actor),
                   vocab)
  ids = jnp.asarray(vocab.ids)
  return (Method(drafter=EagleDrafter(hcfg), num_draft=3),
          lambda p: EagleParams(head=head, draft_ids=ids,
                                embed=target.embedding(p)))


@pytest.mark.parametrize("method,iterations", [("ngram", 2), ("eagle3", 1)])
def test_grpo_trains_with_specjax_rollouts(method, iterations):
  """Invariant: Tunix's GRPO learner runs 4 steps with the adapter as its
  rollout engine (n-gram with two iterations a batch, so the old policy's
  log-probs come from the adapter; an EAGLE-3 head): every step generates,
  syncs the new weights into the adapter (its params are then the
  actor's) and the actor changes."""
  vocab, cfg, actor = _actor()
  _, _, ref = _actor()
  if method == "ngram":
    m, dparams = Method(drafter=NGramDrafter(), num_draft=3), None
  else:
    m, dparams = _eagle3(cfg)
  calls = {"generate": 0, "update_params": 0, "get_per_token_logps": 0}

  class Counted(SpecjaxRollout):
    def generate(self, *a, **k):
      calls["generate"] += 1
      return super().generate(*a, **k)

    def update_params(self, *a, **k):
      calls["update_params"] += 1
      return super().update_params(*a, **k)

    def get_per_token_logps(self, *a, **k):
      calls["get_per_token_logps"] += 1
      return super().get_per_token_logps(*a, **k)

  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  before = jax.tree.map(jnp.copy, nnx.state(actor, nnx.Param))
  cluster = rl.RLCluster(
      actor=actor, reference=ref, tokenizer=vocab,
      cluster_config=rl.ClusterConfig(
          role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh,
                        rl.Role.ROLLOUT: mesh},
          rollout_engine=functools.partial(Counted, method=m,
                                           drafter_params=dparams),
          offload_to_cpu=False,
          training_config=rl.RLTrainingConfig(
              actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=100,
              max_steps=4),
          rollout_config=_rollout_config()))
  learner = grpo.GRPOLearner(
      rl_cluster=cluster,
      algo_config=grpo.GRPOConfig(num_generations=2,
                                  num_iterations=iterations, beta=0.04),
      reward_fns=lambda prompts, completions, **kw: [
          float(len(c.split())) for c in completions])
  assert learner.should_sync_weights
  learner.train(grain.MapDataset.source(PROMPTS * 4).batch(2).map(
      lambda x: {"prompts": x}))
  trained = cluster.actor_trainer.model
  # 4 steps: a batch per step, or per two with two iterations; a sync
  # after each (and the first weights at construction).
  assert calls["generate"] == 4 // iterations, calls
  assert calls["update_params"] == calls["generate"] + 1, calls
  assert (calls["get_per_token_logps"] > 0) == (iterations > 1), calls
  change = sum(float(jnp.abs(a - b).sum()) for a, b in zip(
      jax.tree.leaves(before), jax.tree.leaves(nnx.state(trained, nnx.Param))))
  assert change > 0
  # The adapter holds the actor's weights (packed for the CPU kernels).
  from specjax.models.decoder import pack_params
  want = llama3_params(trained)
  if hasattr(cluster.rollout.params.layers[0].wqkv, "panels"):
    want = pack_params(want)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               cluster.rollout.params, want)
  cluster.close()
