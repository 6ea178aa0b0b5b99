"""Draft heads for decoding: what they share (``base``: ``HeadConfig``, the
packed dense layer), the EAGLE-3 and EAGLE-1 modules (``eagle``), Medusa
(``medusa``), their portable files (``export``: ``load_head``,
``save_head``) and draft vocabularies (``vocab``); the heads specjax ships
sit beside them as ``.npz``. Nothing here imports the trainer
(``specjax.training``)."""

from __future__ import annotations

import flax.linen as nn

from specjax.heads.base import HeadConfig
from specjax.heads.eagle import Eagle1Head, Eagle3Head
from specjax.heads.medusa import MedusaHead

# Parameters training leaves alone, per variant (copies of target weights).
FROZEN = {"eagle3": (), "eagle1": ("feature_norm", "lm_head"),
          "medusa": ("feature_norm",)}


def head_module(cfg: HeadConfig) -> nn.Module:
  if cfg.variant == "medusa":
    return MedusaHead(cfg)
  return (Eagle1Head if cfg.variant == "eagle1" else Eagle3Head)(cfg)


def head_call(cfg: HeadConfig, params):
  """``call(method, *args)``: the head's method (``features``, ``project``,
  ``logits``, ...) applied with ``params`` -- how drafting and training run
  a head piece by piece."""
  module = head_module(cfg)
  return lambda method, *args: module.apply({"params": params}, *args,
                                            method=method)
