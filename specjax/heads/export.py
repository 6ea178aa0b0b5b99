"""A trained head as one portable file: ``.npz`` with the config inside.

Holds the head's parameters (bf16 by default: half the size, and the head is
run in f32 after loading), the draft vocabulary's target ids and the
``HeadConfig`` as JSON. ``load_head`` checks the head fits the target
(hidden size, vocab, layer count) and names the mismatch otherwise.

Format 2 stores an EAGLE head's layer as the decoder's (``layer/wqkv``,
``layer/w_gate_up``, ...: ``heads.base.DecoderLayer``); format 1 (the heads
specjax ships, and files written before) as separate ``wq, wk, wv``,
``w_gate, w_up`` kernels, which ``load_head`` fuses (a permutation: the
same weights exactly).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from specjax.heads import param_shapes
from specjax.heads.base import HeadConfig
from specjax.models.config import ModelConfig
from specjax.models.decoder import fuse_qkv
from specjax.models.layers import fuse_gate_up

FORMAT = 2


def save_head(path, cfg: HeadConfig, params, draft_ids, dtype=jnp.bfloat16):
  flat = traverse_util.flatten_dict(jax.device_get(params), sep="/")
  arrays = {f"param/{k}": np.asarray(jnp.asarray(v, dtype)).view(np.uint16)
            if dtype == jnp.bfloat16 else np.asarray(v, dtype)
            for k, v in flat.items()}
  meta = dict(config=dataclasses.asdict(cfg), dtype=jnp.dtype(dtype).name,
              format=FORMAT)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp.npz")
  np.savez(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
           draft_ids=np.asarray(draft_ids, np.int32), **arrays)
  tmp.replace(path)


def check_layout(fmt: str, variant: str, feed_normed: bool = False) -> None:
  """ValueError unless a ``variant`` head (an MTP one feeding its normed
  output if ``feed_normed``) can be written in layout ``fmt``."""
  if variant == "mtp":
    from specjax.heads.mtp_interop import check_export
    return check_export(fmt, feed_normed)
  from specjax.heads.interop import check_export
  check_export(fmt, variant)


def export_layout(out_dir, cfg: HeadConfig, params, draft_ids, fmt: str, *,
                  target_name: str = "") -> pathlib.Path:
  """The head in layout ``fmt`` in directory ``out_dir``: an EAGLE-3 head
  by ``interop.export_head`` (``interop.FORMATS``), an MTP module by
  ``mtp_interop.export_mtp`` (``mtp_interop.LAYOUTS``)."""
  check_layout(fmt, cfg.variant, cfg.feed_normed)
  if cfg.variant == "mtp":
    from specjax.heads.mtp_interop import export_mtp
    return export_mtp(out_dir, cfg, params, fmt, target_name=target_name)
  from specjax.heads.interop import export_head
  return export_head(out_dir, cfg, params, draft_ids, fmt,
                     target_name=target_name)


class HeadNote(UserWarning):
  """What loading a head from another layout assumed (``interop``)."""


def load_head(path, target: ModelConfig | None = None):
  """``(HeadConfig, params (f32), draft_ids)``; checks fit to ``target``.
  A directory is an EAGLE-3 head in the SpecForge or speculators layout
  (``interop.import_head``) or an MTP module in one of
  ``mtp_interop.LAYOUTS`` (``mtp_interop.import_mtp``: a target's own
  checkpoint may be given); it needs ``target``, and its assumptions come
  as ``HeadNote`` warnings."""
  if os.path.isdir(path):  # False for a name too long to be one
    return _load_dir(path, target)
  try:
    z = np.load(path)
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    raise ValueError(f"cannot read head file {str(path)!r}: {e}") from None
  with z:
    if "meta" not in z:
      raise ValueError(f"{str(path)!r} is not a head file (no meta entry)")
    try:
      meta = json.loads(bytes(z["meta"]).decode())
      c = meta["config"]
      cfg = HeadConfig(**{**c, "taps": tuple(c["taps"])})
      bf16 = meta["dtype"] == "bfloat16"
      flat = {k[len("param/"):]: jnp.asarray(
          z[k].view(jnp.bfloat16) if bf16 else z[k], jnp.float32)
              for k in z.files if k.startswith("param/")}
      draft_ids = jnp.asarray(z["draft_ids"])
      version = meta.get("format", 1)
      params = traverse_util.unflatten_dict(flat, sep="/")
      if version == 1 and cfg.variant != "medusa":
        params = fused_layer(params, cfg)
    except (KeyError, TypeError, ValueError, zipfile.BadZipFile) as e:
      raise ValueError(f"head file {str(path)!r} is damaged: {e!r}") from None
  if version not in (1, FORMAT):
    raise ValueError(f"head file {str(path)!r} has format {version}; this "
                     f"specjax reads formats 1 and {FORMAT}")
  _check_shapes(path, cfg, params, draft_ids)
  if target is not None:
    cfg.check_fits(target)
  return cfg, params, draft_ids


def _load_dir(path, target: ModelConfig | None):
  import warnings
  from specjax.heads import interop, mtp_interop
  if target is None:
    raise ValueError(f"head directory {str(path)!r}: loading it needs the "
                     f"target's config")
  mtp = mtp_interop.layout_of(interop.read_config(pathlib.Path(path)))
  cfg, params, draft_ids, notes = (mtp_interop.import_mtp if mtp else
                                   interop.import_head)(path, target)
  for note in notes:
    warnings.warn(f"head {str(path)!r}: {note}", HeadNote, stacklevel=3)
  return (cfg, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params),
          jnp.asarray(draft_ids))


def fused_layer(params, cfg: HeadConfig):
  """A format-1 EAGLE head's parameters (``wq, wk, wv, wo, mlp_norm,
  w_gate, w_up, w_down`` beside the rest) with its layer as
  ``DecoderLayer``'s ``layer`` entry."""
  p = dict(params)
  k = lambda name: p.pop(name)["kernel"]
  wq, wk, wv = k("wq"), k("wk"), k("wv")
  wo, gate, up, down = k("wo"), k("w_gate"), k("w_up"), k("w_down")
  p["layer"] = dict(wqkv=fuse_qkv(wq, wk, wv, cfg.num_kv_heads), wo=wo,
                    mlp_norm=p.pop("mlp_norm")["scale"],
                    w_gate_up=fuse_gate_up(gate, up), w_down=down)
  return p


def _check_shapes(path, cfg: HeadConfig, params, draft_ids) -> None:
  """ValueError naming the first parameter the file lacks, has extra or has
  in another shape than ``cfg``'s head, or draft ids that are no draft
  vocabulary of the target (what would otherwise fail in a kernel)."""
  want = param_shapes(cfg)
  got = {k: tuple(v.shape) for k, v in
         traverse_util.flatten_dict(params, sep="/").items()}
  for name in sorted(set(want) | set(got)):
    if want.get(name) != got.get(name):
      raise ValueError(f"head file {str(path)!r}: parameter {name} is "
                       f"{got.get(name, 'missing')}, its config says "
                       f"{want.get(name, 'no such parameter')}")
  ids = np.asarray(draft_ids)
  if (ids.shape != (cfg.draft_vocab,) or ids.size == 0 or ids.min() < 0
      or ids.max() >= cfg.target_vocab or len(np.unique(ids)) != ids.size):
    raise ValueError(f"head file {str(path)!r}: draft_ids must be "
                     f"{cfg.draft_vocab} distinct ids below the target's "
                     f"vocab {cfg.target_vocab}")
