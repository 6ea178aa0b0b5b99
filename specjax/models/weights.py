"""Assembling ``LlamaParams`` from per-tensor weights in the HF (torch) layout.

Both loaders (GGUF, HF safetensors) reduce their file format to one getter,
``get(hf_name) -> np.ndarray`` in transformers' naming and ``(out, in)`` layout;
this module checks shapes, transposes to ``x @ W`` layout, fuses q/k/v and
gate/up (``llama.fuse_qkv``, ``fuse_gate_up``), one ``LayerParams`` per layer.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.llama import (LayerParams, LlamaParams, fuse_gate_up,
                                  fuse_qkv)

Getter = Callable[[str], Optional[np.ndarray]]


class WeightError(ValueError):
  """A checkpoint is missing a tensor or has one of the wrong shape."""


def _need(get: Getter, name: str, shape: tuple[int, ...]) -> np.ndarray:
  w = get(name)
  if w is None:
    raise WeightError(f"checkpoint is missing tensor {name!r}")
  if tuple(w.shape) != shape:
    raise WeightError(f"tensor {name!r} has shape {tuple(w.shape)}, "
                      f"expected {shape} from the config")
  return np.asarray(w, np.float32)


def params_from_getter(get: Getter, cfg: ModelConfig,
                       dtype=jnp.float32) -> LlamaParams:
  """Builds params from HF-named tensors (``model.layers.{i}.self_attn...``)."""
  D, F, H = cfg.dim, cfg.ffn_dim, cfg.head_dim
  NH, GH = cfg.num_heads * H, cfg.num_kv_heads * H
  layers = []
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    q = _need(get, p + "self_attn.q_proj.weight", (NH, D))
    k = _need(get, p + "self_attn.k_proj.weight", (GH, D))
    v = _need(get, p + "self_attn.v_proj.weight", (GH, D))
    bias = None
    if cfg.qkv_bias:
      bias = fuse_qkv(_need(get, p + "self_attn.q_proj.bias", (NH,)),
                      _need(get, p + "self_attn.k_proj.bias", (GH,)),
                      _need(get, p + "self_attn.v_proj.bias", (GH,)),
                      cfg.num_kv_heads)
    gate = _need(get, p + "mlp.gate_proj.weight", (F, D))
    up = _need(get, p + "mlp.up_proj.weight", (F, D))
    w = dict(
        attn_norm=_need(get, p + "input_layernorm.weight", (D,)),
        wqkv=fuse_qkv(q.T, k.T, v.T, cfg.num_kv_heads),
        bqkv=bias,
        wo=_need(get, p + "self_attn.o_proj.weight", (D, NH)).T,
        mlp_norm=_need(get, p + "post_attention_layernorm.weight", (D,)),
        w_gate_up=fuse_gate_up(gate.T, up.T),
        w_down=_need(get, p + "mlp.down_proj.weight", (D, F)).T)
    layers.append(LayerParams(**{
        name: None if x is None else jnp.asarray(x, dtype)
        for name, x in w.items()}))

  embed = _need(get, "model.embed_tokens.weight", (cfg.vocab_size, D))
  lm_head = None
  if not cfg.tie_embeddings:
    lm_head = jnp.asarray(_need(get, "lm_head.weight", (cfg.vocab_size, D)),
                          dtype)
  return LlamaParams(
      embed=jnp.asarray(embed, dtype),
      layers=tuple(layers),
      final_norm=jnp.asarray(_need(get, "model.norm.weight", (D,)), dtype),
      lm_head=lm_head)


def num_params(params: LlamaParams) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
