"""Assembling ``DecoderParams`` from per-tensor weights in the HF (torch) layout.

Both loaders (GGUF, HF safetensors) reduce their file format to one getter,
``get(hf_name) -> np.ndarray`` in transformers' naming and ``(out, in)`` layout;
this module checks shapes, transposes to ``x @ W`` layout, fuses q/k/v and
gate/up (``decoder.fuse_qkv``, ``layers.fuse_gate_up``; Phi-3's fused
projections are split first), one ``LayerParams`` per layer. Which tensors
a layer has follows the config (biases, q/k norms, Gemma's sandwich norms,
whose names differ from Llama's: there ``post_attention_layernorm`` is the
attention output's norm and ``pre_feedforward_layernorm`` the MLP's input's).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.decoder import DecoderParams, LayerParams, fuse_qkv
from specjax.models.layers import fuse_gate_up

Getter = Callable[[str], Optional[np.ndarray]]


class WeightError(ValueError):
  """A checkpoint is missing a tensor, has one of the wrong shape, or a
  config specjax cannot honour."""


def _need(get: Getter, name: str, shape: tuple[int, ...]) -> np.ndarray:
  w = get(name)
  if w is None:
    raise WeightError(f"checkpoint is missing tensor {name!r}")
  if tuple(w.shape) != shape:
    raise WeightError(f"tensor {name!r} has shape {tuple(w.shape)}, "
                      f"expected {shape} from the config")
  return np.asarray(w, np.float32)


def _attention(get: Getter, p: str, cfg: ModelConfig, fused: bool):
  """``(wq, wk, wv)`` in ``(out, in)`` layout and their biases (or Nones)."""
  D, H = cfg.dim, cfg.head_dim
  NH, GH = cfg.num_heads * H, cfg.num_kv_heads * H
  a = p + "self_attn."
  if fused:  # Phi-3: rows q, then k, then v
    qkv = _need(get, a + "qkv_proj.weight", (NH + 2 * GH, D))
    return np.split(qkv, [NH, NH + GH]), (None, None, None)
  w = [_need(get, a + f"{n}_proj.weight", (m, D))
       for n, m in (("q", NH), ("k", GH), ("v", GH))]
  b = [None] * 3
  if cfg.qkv_bias:
    b = [_need(get, a + f"{n}_proj.bias", (m,))
         for n, m in (("q", NH), ("k", GH), ("v", GH))]
  return w, b


def _mlp(get: Getter, p: str, cfg: ModelConfig, fused: bool):
  """``(gate, up, down)`` in ``(out, in)`` layout and their biases."""
  D, F = cfg.dim, cfg.ffn_dim
  m = p + "mlp."
  if fused:  # Phi-3: rows gate, then up
    gate, up = np.split(_need(get, m + "gate_up_proj.weight", (2 * F, D)), 2)
  else:
    gate = _need(get, m + "gate_proj.weight", (F, D))
    up = _need(get, m + "up_proj.weight", (F, D))
  down = _need(get, m + "down_proj.weight", (D, F))
  b = [None] * 3
  if cfg.mlp_bias:
    b = [_need(get, m + f"{n}_proj.bias", (k,))
         for n, k in (("gate", F), ("up", F), ("down", D))]
  return (gate, up, down), b


def _layer(get: Getter, i: int, cfg: ModelConfig, fused: bool) -> dict:
  D, H = cfg.dim, cfg.head_dim
  p = f"model.layers.{i}."
  (q, k, v), (bq, bk, bv) = _attention(get, p, cfg, fused)
  (gate, up, down), (bg, bu, bd) = _mlp(get, p, cfg, fused)
  norm = lambda name, n=D: _need(get, p + name + ".weight", (n,))
  w = dict(
      attn_norm=norm("input_layernorm"),
      wqkv=fuse_qkv(q.T, k.T, v.T, cfg.num_kv_heads),
      bqkv=None if bq is None else fuse_qkv(bq, bk, bv, cfg.num_kv_heads),
      wo=_need(get, p + "self_attn.o_proj.weight",
               (D, cfg.num_heads * H)).T,
      w_gate_up=fuse_gate_up(gate.T, up.T),
      b_gate_up=None if bg is None else fuse_gate_up(bg, bu),
      w_down=down.T, b_down=bd)
  if cfg.o_bias:
    w["bo"] = _need(get, p + "self_attn.o_proj.bias", (D,))
  if cfg.qk_norm:
    w["q_norm"], w["k_norm"] = (norm("self_attn.q_norm", H),
                                norm("self_attn.k_norm", H))
  if cfg.sandwich_norms:
    w.update(post_attn_norm=norm("post_attention_layernorm"),
             mlp_norm=norm("pre_feedforward_layernorm"),
             post_mlp_norm=norm("post_feedforward_layernorm"))
  else:
    w["mlp_norm"] = norm("post_attention_layernorm")
  return w


def params_from_getter(get: Getter, cfg: ModelConfig, dtype=jnp.float32, *,
                       fused: bool = False) -> DecoderParams:
  """Builds params from HF-named tensors (``model.layers.{i}.self_attn...``);
  ``fused``: q/k/v and gate/up stored fused (Phi-3)."""
  cast = lambda x: None if x is None else jnp.asarray(x, dtype)
  layers = tuple(
      LayerParams(**{n: cast(x) for n, x in _layer(get, i, cfg, fused).items()})
      for i in range(cfg.num_layers))
  D = cfg.dim
  embed = _need(get, "model.embed_tokens.weight", (cfg.vocab_size, D))
  lm_head = None
  if not cfg.tie_embeddings:
    lm_head = cast(_need(get, "lm_head.weight", (cfg.vocab_size, D)))
  return DecoderParams(
      embed=cast(embed), layers=layers,
      final_norm=cast(_need(get, "model.norm.weight", (D,))),
      lm_head=lm_head)


def num_params(params: DecoderParams) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
