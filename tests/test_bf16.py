"""bf16 models on the CPU (accelerator readiness): every method
runs, T = 0 equals the bf16 model's own AR output, probabilities stay f32,
and sampled speculative output still follows the bf16 target exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core import bucketing, engine
from specjax.drafters import (DraftModelDrafter, LayerSkipDrafter,
                              NGramDrafter)
from specjax.drafters.eagle import EagleDrafter, EagleParams
from specjax.drafters.medusa import MedusaDrafter, MedusaParams
from specjax.heads.base import HeadConfig
from specjax.heads.vocab import build_draft_vocab
from specjax.models import decoder
from specjax.models.decoder import Decoder
from specjax.models.hf_loader import load_hf
from specjax.models.registry import default_dtype
from specjax.training.train import init_head
from tests.tiny_hf import make_tiny

BF16 = jnp.bfloat16
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 1, 9, 1, 9],
           [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3], [20]]


@pytest.fixture(scope="module")
def tiny16(tmp_path_factory):
  d = tmp_path_factory.mktemp("bf16_tiny")
  make_tiny("llama_gqa_tied", d, seed=5)
  return load_hf(d, BF16)


def _heads(cfg, params):
  """Untrained EAGLE-3 and Medusa heads (f32) for the bf16 target."""
  vocab = build_draft_vocab([np.arange(37)], 37, 37)
  ids = jnp.asarray(vocab.ids)
  e3 = HeadConfig.for_target(cfg, 37, taps=(0, 1, 3))
  md = HeadConfig.for_target(cfg, 37, variant="medusa", medusa_heads=3)
  return ((e3, EagleParams(head=init_head(jax.random.key(1), e3, Decoder(cfg), params,
                                          vocab), draft_ids=ids,
                           embed=params.embed)),
          (md, MedusaParams(head=init_head(jax.random.key(2), md, Decoder(cfg), params,
                                           vocab), draft_ids=ids)))


def test_dtype_follows_the_backend():
  assert default_dtype() == (jnp.float32 if jax.default_backend() == "cpu"
                             else BF16)


@pytest.mark.long
def test_bf16_every_method_equals_bf16_ar(tiny16):
  """Invariants on a bf16 tiny target, ragged batch, T = 0: (1) the weights
  and the KV cache are bf16, the logits f32; (2) n-gram chains and tries,
  layer-skip, a draft model (the target itself: every draft accepted),
  EAGLE-3 chains and dynamic trees, Medusa chains all emit exactly the bf16
  model's own AR tokens; (3) a bf16 draft model's draft probabilities are
  f32 (the acceptance ratios are computed in f32)."""
  cfg, params = tiny16
  assert params.layers[0].wqkv.dtype == BF16
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)

  def run(dparams=None, **kw):
    st = engine.generate_jit(params, prompt_BT, lengths, jax.random.key(0),
                             np.int32(20), target=Decoder(cfg),
                             dcfg=engine.DecodeConfig(capacity=96, **kw),
                             drafter_params=dparams)
    return [st.tokens[b, lengths[b]:st.num_tokens[b]].tolist()
            for b in range(len(PROMPTS))], st

  ar, st = run()
  assert st.cache.k[0].dtype == BF16
  out = decoder.forward(params, cfg, prompt_BT, decoder.init_cache(
      cfg, len(PROMPTS), 32, BF16))
  assert out.logits.dtype == jnp.float32
  (e3, e3p), (md, mdp) = _heads(cfg, params)
  runs = {
      "ngram": run(drafter=NGramDrafter(), num_draft=4),
      "ngram_trie": run(drafter=NGramDrafter(num_paths=3), num_draft=4,
                        tree_nodes=8),
      "layerskip": run(params, drafter=LayerSkipDrafter.from_target(Decoder(cfg), 1),
                       num_draft=3),
      "draft_self": run(params, drafter=DraftModelDrafter(Decoder(cfg)), num_draft=3),
      "eagle3": run(e3p, drafter=EagleDrafter(e3), num_draft=3),
      "eagle3_tree": run(e3p, drafter=EagleDrafter(e3, tree_width=2),
                         num_draft=3, tree_nodes=6),
      "medusa": run(mdp, drafter=MedusaDrafter(md), num_draft=3),
  }
  for name, (tokens, _) in runs.items():
    assert tokens == ar, name
  st = runs["draft_self"][1]
  acc, fwd = np.asarray(st.accepted_at), np.asarray(st.num_forwards)
  assert (acc[:, 2] >= fwd - 1).all()  # the target as its draft: all kept
  prop = DraftModelDrafter(Decoder(cfg)).propose(
      params, st.drafter_state, st.context, jax.random.key(3), 3,
      engine.SamplingParams(1.0))
  assert prop.probs.dtype == jnp.float32


@pytest.mark.long
def test_bf16_sampling_stays_exact(tiny16, tmp_path, monkeypatch):
  """Invariant (T = 1, 50,000 rows through the engine, K = 2, dynamic-K
  draft model, both models bf16): the first two generated tokens follow
  the bf16 target's joint distribution (its f32 logits; chi-square below
  the 99.9% critical value). Mutation: drafting only tokens whose own
  probability clears the threshold biases the output and must fail."""
  from specjax.drafters import chain
  from tests.test_speculative import _chi2, _joint_first_two
  make_tiny("llama_gqa_tied", tmp_path, seed=11)
  draft = load_hf(tmp_path, BF16)
  cfg, params = tiny16
  counts, expected, drafted = _joint_first_two(params, cfg, draft)
  stat, crit = _chi2(counts, expected)
  assert stat < crit, (stat, crit)
  assert 0 < (drafted < 2).mean() < 1

  def biased(logits_BV, probs_BV, tok_B, min_confidence):
    return probs_BV[jnp.arange(tok_B.shape[0]), tok_B] >= min_confidence

  monkeypatch.setattr(chain, "keep_drafting", biased)
  jax.clear_caches()
  counts, expected, _ = _joint_first_two(params, cfg, draft)
  jax.clear_caches()
  stat, crit = _chi2(counts, expected)
  assert stat > crit, (stat, crit)
