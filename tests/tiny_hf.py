"""Random tiny transformers models saved as HF checkpoints (test references).

Dimensions are small and all different so a swapped axis cannot go unnoticed.
"""

from __future__ import annotations

import pathlib

import torch
import transformers

TINY_CONFIGS = {
    # GQA (6 query heads over 2 kv heads), tied embeddings.
    "llama_gqa_tied": lambda: transformers.LlamaConfig(
        vocab_size=37, hidden_size=24, intermediate_size=40,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=64),
    # q/k/v bias, untied LM head (Qwen2 style).
    "qwen2_bias_untied": lambda: transformers.Qwen2Config(
        vocab_size=41, hidden_size=32, intermediate_size=56,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=64),
    # Llama-3 rope scaling, MHA, untied.
    "llama3_rope_scaling": lambda: transformers.LlamaConfig(
        vocab_size=43, hidden_size=40, intermediate_size=28,
        num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=5,
        rope_theta=500000.0, tie_word_embeddings=False,
        max_position_embeddings=64,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0,
                          original_max_position_embeddings=8)),
}


def make_tiny(name: str, directory: pathlib.Path, seed: int = 0):
  """Builds, randomizes and saves a tiny model; returns the torch model."""
  torch.manual_seed(seed)
  config = TINY_CONFIGS[name]()
  model_cls = (transformers.Qwen2ForCausalLM if name.startswith("qwen2")
               else transformers.LlamaForCausalLM)
  model = model_cls(config).eval()
  with torch.no_grad():  # default init leaves norms at 1 and biases at 0
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  model.save_pretrained(directory, safe_serialization=True)
  return model
