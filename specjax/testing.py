"""Test doubles: tiny random targets with no checkpoint behind them (no
files, no torch), for tests of the engine, the drafters and the trainer,
ours and yours. Where transformers is the reference (logits, greedy
output, warpers), the tests build its own random checkpoints instead.

  cfg, params = specjax.testing.tiny("llama_gqa_tied", seed=3)
  model = specjax.testing.tiny_model()   # a registry.Model (no tokenizer)
"""

from __future__ import annotations

import jax

from specjax.models import decoder
from specjax.models.config import ModelConfig
from specjax.models.registry import Model

# Small and all different, so that a swapped axis cannot go unnoticed.
CONFIGS = {
    # GQA (6 query heads over 2 kv heads), tied embeddings, EOS id 2.
    "llama_gqa_tied": ModelConfig(
        vocab_size=37, dim=24, num_layers=3, num_heads=6, num_kv_heads=2,
        head_dim=4, ffn_dim=40, rope_theta=500.0, norm_eps=1e-5,
        tie_embeddings=True, max_position=64, bos_id=1, eos_ids=(2,),
        name="llama_gqa_tied"),
    # q/k/v biases and an untied LM head (Qwen2's layout), no EOS.
    "qwen2_bias_untied": ModelConfig(
        vocab_size=41, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, ffn_dim=56, rope_theta=10000.0, norm_eps=1e-6,
        qkv_bias=True, max_position=64, name="qwen2_bias_untied"),
}


def tiny(name: str = "llama_gqa_tied", seed: int = 0
         ) -> tuple[ModelConfig, decoder.DecoderParams]:
  """``(config, params)`` of the tiny model ``name`` (``CONFIGS``): every
  weight and bias normal(0, 0.2) and every norm 1 + normal(0, 0.2). At an
  initializer's 0.02 such a model repeats its last token forever; at 0.2
  its greedy output wanders and repeats, so drafts are both accepted and
  rejected."""
  cfg = CONFIGS[name]
  return cfg, tiny_params(cfg, seed)


def tiny_params(cfg: ModelConfig, seed: int = 0) -> decoder.DecoderParams:
  """``tiny``'s parameters for any config: weights and biases normal(0,
  0.2), norms 1 + normal(0, 0.2)."""
  ones = decoder.random_params(jax.random.key(seed), cfg, scale=0.0)
  leaves, treedef = jax.tree.flatten(ones)  # zero weights, unit norms
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      x + 0.2 * jax.random.normal(k, x.shape, x.dtype)
      for x, k in zip(leaves, keys)])


def tiny_model(name: str = "llama_gqa_tied", seed: int = 0) -> Model:
  """``tiny(name, seed)`` as a ``Model`` (the decoder target, no
  tokenizer)."""
  cfg, params = tiny(name, seed)
  return Model(target=decoder.Decoder(cfg), params=params, tokenizer=None)
