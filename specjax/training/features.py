"""The frozen target's features, cached on disk for multi-epoch training.

On a CPU the frozen target forward is about half of a TTT-3 step (measured:
docs/DESIGN.md, "Cached target features") and gives the same answer every
epoch. ``build`` runs it
once per example and keeps, per token slot, what a ``TTTBatch`` needs:

  taps.bin      bf16[N, T, len(taps) * D]  the fused layer inputs
  hidden.bin    bf16[N, T, D]              the target's final-normed hidden
  in_vocab.bin  bool[N, T]                 the target's argmax is in Vd

The Vd logits are not stored (16k floats a token) but recomputed from
``hidden`` with the target's LM-head rows of Vd, a ``D x Vd`` product per
token (a tenth of the target forward). Size is bounded and known up front:
``(len(taps) + 1) * D * 2 + 1`` bytes per slot, 4.6 KB for SmolLM2, i.e.
2.4 GB for 1000 examples of 512 tokens. bf16 rounds features and hidden to
8 significant bits, as a bf16 training run on an accelerator would see them;
``dtype=float32`` keeps them exact (tests).

Resumable: each batch is written and fsynced before ``meta.json`` records
how many examples are done (and the target seconds spent, the cache's share
of a run's compute); a cache whose fingerprint (model, taps, Vd ids, example
ids, dtype) differs is rebuilt from scratch, never silently reused.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.training import data as edata
from specjax.heads.base import HeadConfig
from specjax.training.ttt import TTTBatch, target_outputs
from specjax.heads.vocab import DraftVocab
from specjax.models.layers import softcap

_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


@dataclasses.dataclass(frozen=True)
class FeatureCache:
  """Read-only memory maps of a finished cache (shapes in the module doc)."""
  taps: np.ndarray
  hidden: np.ndarray
  in_vocab: np.ndarray

  def __len__(self) -> int:
    return self.taps.shape[0]


def bytes_per_token(hcfg: HeadConfig, dtype: str = "bfloat16") -> int:
  itemsize = np.dtype(_DTYPES[dtype]).itemsize
  return (len(hcfg.taps) + 1) * hcfg.target_dim * itemsize + 1


def _fingerprint(model_name: str, hcfg: HeadConfig, vocab: DraftVocab,
                 ex: edata.Examples, dtype: str) -> str:
  h = hashlib.sha256()
  h.update(json.dumps([model_name, list(hcfg.taps), hcfg.target_dim,
                       dtype]).encode())
  for a in (vocab.ids, ex.ids):
    h.update(np.ascontiguousarray(a, np.int32).tobytes())
  return h.hexdigest()[:16]


def _layout(T: int, hcfg: HeadConfig, dtype: str) -> dict:
  """``{file: (dtype, shape of one example)}``."""
  D, F = hcfg.target_dim, len(hcfg.taps) * hcfg.target_dim
  dt = np.dtype(_DTYPES[dtype])
  return {"taps.bin": (dt, (T, F)), "hidden.bin": (dt, (T, D)),
          "in_vocab.bin": (np.dtype(np.bool_), (T,))}


def _maps(path: pathlib.Path, n: int, T: int, hcfg: HeadConfig,
          dtype: str) -> FeatureCache:
  return FeatureCache(*(np.memmap(path / name, dtype=dt, mode="r",
                                  shape=(n, *shape))
                        for name, (dt, shape) in _layout(T, hcfg, dtype)
                        .items()))


def _write_meta(path: pathlib.Path, meta: dict):
  """Atomically: a kill mid-write leaves the old counter, never torn JSON."""
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(meta, indent=1))
  os.replace(tmp, path)


_outputs = jax.jit(target_outputs, static_argnums=(1, 2))


def build(model: Any, model_name: str, hcfg: HeadConfig, vocab: DraftVocab,
          ex: edata.Examples, path, *, batch_size: int = 2,
          dtype: str = "bfloat16", stop_after: int | None = None,
          progress: bool = True) -> FeatureCache:
  """Runs the target over ``ex`` (resuming a partial cache) and returns the
  maps. ``stop_after`` ends after that many batches, as a kill would."""
  from tqdm.auto import tqdm
  path = pathlib.Path(path)
  n, T = ex.ids.shape
  meta_path = path / "meta.json"
  fp = _fingerprint(model_name, hcfg, vocab, ex, dtype)
  meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
  layout = _layout(T, hcfg, dtype)
  if meta.get("fingerprint") != fp:
    path.mkdir(parents=True, exist_ok=True)
    for f in path.glob("*.bin"):
      f.unlink()
    meta = dict(fingerprint=fp, examples=n, tokens_per_example=T,
                dtype=dtype, bytes=n * T * bytes_per_token(hcfg, dtype),
                done=0, seconds=0.0)
    for name, (dt, shape) in layout.items():  # sparse until written
      with open(path / name, "wb") as f:
        f.truncate(n * dt.itemsize * math.prod(shape))
    _write_meta(meta_path, meta)
  tcfg, tp = model.target, model.params
  starts = range(meta["done"], n, batch_size)
  bar = tqdm(starts, desc="target features", unit="batch",
             disable=not progress or not len(starts))
  fds = [os.open(path / name, os.O_WRONLY) for name in layout]
  try:
    for i, lo in enumerate(bar):
      if stop_after is not None and i == stop_after:
        break
      t0 = time.perf_counter()
      hi = min(lo + batch_size, n)
      ids = np.zeros((batch_size, T), np.int32)  # a ragged last batch is
      ids[:hi - lo] = ex.ids[lo:hi]              # padded: one compile
      outs = jax.device_get(_outputs(tp, tcfg, hcfg, vocab, ids))
      # Plain writes + fsync, not a writable memmap: msync of a GB-sized map
      # cost seconds per batch here (more than the target forward).
      for fd, (dt, shape), a in zip(fds, layout.values(), outs):
        data = np.ascontiguousarray(a[:hi - lo], dt).tobytes()
        if os.pwrite(fd, data, lo * dt.itemsize * math.prod(shape)) != len(
            data):
          raise OSError(f"short write to the feature cache in {path}")
        os.fsync(fd)
      meta["done"] = hi  # after the fsync: a kill never records unwritten rows
      meta["seconds"] = round(meta["seconds"] + time.perf_counter() - t0, 2)
      _write_meta(meta_path, meta)
  finally:
    for fd in fds:
      os.close(fd)
  return _maps(path, n, T, hcfg, dtype)


def is_complete(path) -> bool:
  meta_path = pathlib.Path(path) / "meta.json"
  if not meta_path.is_file():
    return False
  meta = json.loads(meta_path.read_text())
  return meta["done"] == meta["examples"]


@functools.partial(jax.jit, static_argnames="logit_cap")
def _batch(out_VdD, taps, hidden, in_vocab, tokens, loss_mask,
           logit_cap=None) -> TTTBatch:
  f32 = lambda a: jnp.asarray(a).astype(jnp.float32)
  logits = softcap(jnp.einsum("btd,vd->btv", f32(hidden), out_VdD,
                              preferred_element_type=jnp.float32), logit_cap)
  return TTTBatch(tokens=jnp.asarray(tokens), taps=f32(taps),
                  target_logits=logits,
                  target_in_vocab=jnp.asarray(in_vocab),
                  loss_mask=jnp.asarray(loss_mask, bool))


def cached_batch(cache: FeatureCache, out_VdD, idx, ex: edata.Examples,
                 logit_cap: Optional[float] = None) -> TTTBatch:
  """The ``TTTBatch`` of examples ``idx`` (``ex`` is the cached set);
  ``logit_cap``: the target's final soft-cap (Gemma 2), applied to the
  recomputed logits as the target applies it."""
  idx = np.asarray(idx)
  return _batch(out_VdD, cache.taps[idx], cache.hidden[idx],
                cache.in_vocab[idx], ex.ids[idx], ex.mask[idx],
                logit_cap=logit_cap)
