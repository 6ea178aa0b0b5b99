"""Draft heads for decoding: what they share (``base``: ``HeadConfig``, the
packed dense layer), the EAGLE-3, EAGLE-1 and MTP modules (``eagle``), Medusa
(``medusa``), their portable files (``export``: ``load_head``,
``save_head``), the ecosystem's EAGLE-3 layouts (``interop``: SpecForge/
SGLang and vLLM speculators) and draft vocabularies (``vocab``); the heads specjax ships
sit beside them as ``.npz``. Nothing here imports the trainer
(``specjax.training``)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from specjax.heads.base import HeadConfig, fuses_taps
from specjax.heads.eagle import Eagle1Head, Eagle3Head, MTPHead, PEagleHead
from specjax.heads.medusa import MedusaHead

# Parameters training leaves alone, per variant (copies of target weights).
FROZEN = {"eagle3": (), "eagle1": ("feature_norm", "lm_head"),
          "medusa": ("feature_norm",), "mtp": ("feature_norm", "lm_head"),
          "peagle": ()}


def head_module(cfg: HeadConfig) -> nn.Module:
  return dict(medusa=MedusaHead, eagle1=Eagle1Head, mtp=MTPHead,
              peagle=PEagleHead).get(cfg.variant, Eagle3Head)(cfg)


def head_call(cfg: HeadConfig, params):
  """``call(method, *args)``: the head's method (``features``, ``project``,
  ``logits``, ...) applied with ``params`` -- how drafting and training run
  a head piece by piece."""
  module = head_module(cfg)
  return lambda method, *args: module.apply({"params": params}, *args,
                                            method=method)


def param_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
  """Every parameter's shape, by ``/``-joined path, as ``cfg``'s module
  initializes it (nothing is computed: ``jax.eval_shape``)."""
  D = cfg.target_dim
  width = len(cfg.taps) * D if fuses_taps(cfg.variant) else D
  args = (jax.ShapeDtypeStruct((1, 1, width), jnp.float32),
          jax.ShapeDtypeStruct((1, 1), jnp.int32),
          jax.ShapeDtypeStruct((cfg.target_vocab, D), jnp.float32),
          jax.ShapeDtypeStruct((1, 1), jnp.int32))
  tree = jax.eval_shape(lambda *a: head_module(cfg).init(
      jax.random.key(0), *a), *args)["params"]
  return {k: tuple(v.shape) for k, v in
          traverse_util.flatten_dict(tree, sep="/").items()}


def with_shared(cfg: HeadConfig, params, target, target_params):
  """An MTP head's parameters with what it shares with its target filled in
  where its checkpoint leaves them out (DeepSeek's and Qwen3.5's modules
  read the target's): ``feature_norm``, the target's final norm, and
  ``lm_head``, its LM head. Other heads are returned as they are."""
  if cfg.variant != "mtp":
    return params
  params = dict(params)
  if "feature_norm" not in params:
    scale_D, _ = target.output_norm(target_params)
    params["feature_norm"] = {"scale": jnp.asarray(scale_D, jnp.float32)}
  if "lm_head" not in params:
    params["lm_head"] = {"kernel": jnp.asarray(target.lm_head(target_params),
                                               jnp.float32).T}
  return params
