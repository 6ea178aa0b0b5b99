"""Models of google-deepmind's ``gemma`` JAX library as specjax targets.

``from_gemma(config, params)`` reads a ``gemma`` ``TransformerConfig`` and
its parameter pytree (``transformer.init`` or a loaded checkpoint) into a
``Model`` on specjax's own decoder, which runs Gemma's math as the library
does: ``x (1 + w)`` RMSNorms before and (``use_post_*_norm``) after attention
and the MLP, tanh-GELU gating (``gating_einsum[0]`` the gate), q/k norms,
queries scaled by ``query_pre_attn_scalar()``, attention and final logit
soft-caps, ``LOCAL_SLIDING`` layers seeing keys within the window with their
own RoPE base, the embedding scaled by sqrt(D) and tied to the output. The
weights are re-laid out once (``x @ W``, fused q/k/v and gate/up) so every
method and the native CPU kernels apply. Nothing here imports ``gemma``:
the config is read by its field names, and a field this does not know, or
a value it cannot honour, is refused with one line.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from specjax.models.config import FULL, SLIDING, ModelConfig
from specjax.models.decoder import Decoder, DecoderParams, LayerParams, fuse_qkv
from specjax.models.layers import RopeScaling, fuse_gate_up
from specjax.models.registry import Model
from specjax.models.weights import WeightError

# TransformerConfig fields read here, and those with no effect on the math.
_READ = {"num_layers", "num_embed", "embed_dim", "hidden_dim", "num_heads",
         "head_dim", "num_kv_heads", "final_logit_softcap",
         "use_post_attn_norm", "use_post_ffw_norm", "attention_types",
         "query_pre_attn_norm", "attn_logits_soft_cap", "sliding_window_size",
         "transpose_gating_einsum", "use_qk_norm", "local_base_frequency",
         "global_base_frequency", "local_scale_factor", "global_scale_factor"}
_INERT = {"max_cache_length"}


def _fields(config) -> dict:
  names = getattr(config, "__dataclass_fields__", None)
  if names is None:
    raise WeightError(f"not a gemma TransformerConfig: {type(config).__name__}")
  unknown = sorted(set(names) - _READ - _INERT)
  if unknown:
    raise WeightError(f"gemma config field(s) {', '.join(unknown)} not "
                      f"supported")
  return {n: getattr(config, n) for n in names}


def config_from_gemma(config, name: str = "gemma") -> ModelConfig:
  """The ``ModelConfig`` of a gemma ``TransformerConfig``."""
  f = _fields(config)
  kinds = [getattr(t, "name", str(t)) for t in f["attention_types"]]
  if set(kinds) - {"GLOBAL", "LOCAL_SLIDING"}:
    raise WeightError(f"gemma attention type(s) "
                      f"{sorted(set(kinds) - {'GLOBAL', 'LOCAL_SLIDING'})} "
                      f"not supported")
  types = tuple(SLIDING if k == "LOCAL_SLIDING" else FULL for k in kinds)
  if len(types) != f["num_layers"]:
    raise WeightError(f"gemma config has {len(types)} attention types for "
                      f"{f['num_layers']} layers")
  window = f["sliding_window_size"]
  if SLIDING in types and not window:
    raise WeightError("gemma sliding layers without a sliding_window_size")
  if f.get("local_scale_factor", 1.0) != 1.0:
    raise WeightError(f"gemma local_scale_factor="
                      f"{f['local_scale_factor']} not supported")
  scale = f.get("global_scale_factor", 1.0)
  local, full = f["local_base_frequency"], f["global_base_frequency"]
  return ModelConfig(
      vocab_size=f["num_embed"], dim=f["embed_dim"],
      num_layers=f["num_layers"], num_heads=f["num_heads"],
      num_kv_heads=f["num_kv_heads"], head_dim=f["head_dim"],
      ffn_dim=f["hidden_dim"], rope_theta=float(full), norm_eps=1e-6,
      tie_embeddings=True, max_position=int(f.get("max_cache_length") or
                                            8192),
      rope_scaling=None if scale == 1.0 else RopeScaling(float(scale),
                                                         kind="linear"),
      name=name, activation="gelu_tanh", norm_offset=1.0,
      qk_norm=bool(f["use_qk_norm"]),
      sandwich_norms=bool(f["use_post_attn_norm"] or f["use_post_ffw_norm"]),
      query_scale=float(config.query_pre_attn_scalar()),
      attn_logit_cap=_cap(f["attn_logits_soft_cap"]),
      final_logit_cap=_cap(f["final_logit_softcap"]),
      embed_scale=math.sqrt(f["embed_dim"]),
      sliding_window=window if SLIDING in types else None,
      layer_types=types if SLIDING in types else (),
      local_rope_theta=float(local) if local != full else None)


def _cap(value) -> Optional[float]:
  return None if value is None else float(value)


def _layer(p: dict, cfg: ModelConfig, transposed: bool, dtype) -> LayerParams:
  D, N, G, H = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  a = p["attn"]
  heads_D = lambda w: np.transpose(np.asarray(w, np.float32),
                                   (1, 0, 2)).reshape(D, -1)  # [n, D, H]
  if "qkv_einsum" in a:
    q, k, v = np.asarray(a["qkv_einsum"]["w"], np.float32)
  else:
    q = a["q_einsum"]["w"]
    k, v = np.asarray(a["kv_einsum"]["w"], np.float32)
  gating = np.asarray(p["mlp"]["gating_einsum"], np.float32)
  gate, up = (gating[0].T, gating[1].T) if transposed else gating
  scale = lambda name: p[name]["scale"] if name in p else None
  cast = lambda x: None if x is None else jnp.asarray(x, dtype)
  return LayerParams(
      attn_norm=cast(scale("pre_attention_norm")),
      wqkv=cast(fuse_qkv(heads_D(q), heads_D(k), heads_D(v), G)), bqkv=None,
      wo=cast(np.asarray(a["attn_vec_einsum"]["w"]).reshape(N * H, D)),
      mlp_norm=cast(scale("pre_ffw_norm")),
      w_gate_up=cast(fuse_gate_up(gate, up)),
      w_down=cast(p["mlp"]["linear"]),
      q_norm=cast(a["_query_norm"]["scale"] if cfg.qk_norm else None),
      k_norm=cast(a["_key_norm"]["scale"] if cfg.qk_norm else None),
      post_attn_norm=cast(scale("post_attention_norm")),
      post_mlp_norm=cast(scale("post_ffw_norm")))


def from_gemma(config, params: Any, *, dtype=jnp.float32, tokenizer=None,
               name: str = "gemma") -> Model:
  """A gemma-library model (``TransformerConfig``, its ``params``: the
  ``{"params": ...}`` dict or the tree inside) as a ``Model``."""
  cfg = config_from_gemma(config, name)
  p = params.get("params", params)
  transposed = bool(config.transpose_gating_einsum)
  try:
    layers = tuple(_layer(p[f"layer_{i}"], cfg, transposed, dtype)
                   for i in range(cfg.num_layers))
    embed = p["embedder"]["input_embedding"]
    final = p["final_norm"]["scale"]
  except KeyError as e:
    raise WeightError(f"gemma params lack {e}") from None
  if tuple(embed.shape) != (cfg.vocab_size, cfg.dim):
    raise WeightError(f"gemma embedding has shape {tuple(embed.shape)}, "
                      f"the config says {(cfg.vocab_size, cfg.dim)}")
  out = DecoderParams(embed=jnp.asarray(embed, dtype), layers=layers,
                      final_norm=jnp.asarray(final, dtype), lm_head=None)
  return Model(Decoder(cfg), out, tokenizer)
