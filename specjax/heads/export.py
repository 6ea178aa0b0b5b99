"""A trained head as one portable file: ``.npz`` with the config inside.

Holds the head's parameters (bf16 by default: half the size, and the head is
run in f32 after loading), the draft vocabulary's target ids and the
``HeadConfig`` as JSON. ``load_head`` checks the head fits the target
(hidden size, vocab, layer count) and names the mismatch otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from specjax.heads.base import HeadConfig
from specjax.models.config import ModelConfig


def save_head(path, cfg: HeadConfig, params, draft_ids, dtype=jnp.bfloat16):
  flat = traverse_util.flatten_dict(jax.device_get(params), sep="/")
  arrays = {f"param/{k}": np.asarray(jnp.asarray(v, dtype)).view(np.uint16)
            if dtype == jnp.bfloat16 else np.asarray(v, dtype)
            for k, v in flat.items()}
  meta = dict(config=dataclasses.asdict(cfg), dtype=jnp.dtype(dtype).name,
              format=1)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp.npz")
  np.savez(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
           draft_ids=np.asarray(draft_ids, np.int32), **arrays)
  tmp.replace(path)


def load_head(path, target: ModelConfig | None = None):
  """``(HeadConfig, params (f32), draft_ids)``; checks fit to ``target``."""
  try:
    z = np.load(path)
  except (OSError, ValueError, zipfile.BadZipFile) as e:
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
    except (KeyError, TypeError, ValueError, zipfile.BadZipFile) as e:
      raise ValueError(f"head file {str(path)!r} is damaged: {e!r}") from None
  if target is not None:
    cfg.check_fits(target)
  return cfg, traverse_util.unflatten_dict(flat, sep="/"), draft_ids
