"""Training replies written by the target itself (EAGLE-3's data recipe).

A head drafts the target's continuations, but ShareGPT holds ChatGPT's.
``regenerate`` keeps each example's context up to its first assistant reply
(the user turn and the assistant header, as token ids, so nothing is
re-rendered or re-tokenized) and replaces the rest with a reply the target
samples with specjax's own batched generation. Later turns are dropped: they
answered a reply that is no longer there. The new reply is masked as
assistant output up to and including its EOS.

Rows are generated shortest prompt first in fixed batches, each batch seeded
by its index, so the result is a function of (examples, model, sampling,
seed). Progress is saved after every batch: an interrupted run resumes where
it stopped and produces the same arrays.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Optional

import numpy as np

from specjax.core.sampling import SamplingParams
from specjax.training.data import Examples


def prompt_lengths(ex: Examples) -> np.ndarray:
  """``int32[N]``: tokens before each row's first assistant token."""
  if not ex.mask.any(axis=1).all():
    raise ValueError("every example needs an assistant token to regenerate")
  return ex.mask.argmax(axis=1).astype(np.int32)


def _sampling_key(sp: SamplingParams) -> list:
  """The settings in the cache key: temperature, top-k and top-p as the
  key always held them, then the other options when any is set."""
  key = [sp.temperature, sp.top_k, sp.top_p]
  plain = SamplingParams(sp.temperature, sp.top_k, sp.top_p)
  return key if sp == plain else key + [sp.record()]


def regenerate(model, ex: Examples, *, max_new_tokens: int,
               sampling: SamplingParams, seed: int = 0, batch_size: int = 16,
               cache_dir: Optional[str] = None,
               progress: bool = True) -> Examples:
  """``ex`` with each first reply replaced by the target's (see module doc).

  ``max_new_tokens`` caps a reply; rows are also cut at ``ex``'s length.
  Results are cached under ``cache_dir`` (default ``~/.cache/specjax``).
  """
  from tqdm.auto import tqdm
  from specjax.core import runner

  N, T = ex.ids.shape
  start = prompt_lengths(ex)
  key = json.dumps(dict(v=1, ids=hashlib.sha256(ex.ids.tobytes()).hexdigest(),
                        start=hashlib.sha256(start.tobytes()).hexdigest(),
                        model=_fingerprint(model), new=max_new_tokens, seed=seed,
                        B=batch_size, sampling=_sampling_key(sampling)))
  cache = pathlib.Path(cache_dir or pathlib.Path.home() / ".cache" / "specjax")
  path = cache / f"eagle-regen-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
  partial = path.with_suffix(".partial.npz")
  if path.is_file():
    with np.load(path) as z:
      return Examples(z["ids"], z["mask"], z["lengths"])
  out = Examples(np.zeros_like(ex.ids), np.zeros_like(ex.mask),
                 np.zeros_like(ex.lengths))
  done = np.zeros(N, bool)
  if partial.is_file():
    with np.load(partial) as z:
      out = Examples(z["ids"], z["mask"], z["lengths"])
      done = z["done"]
  order = np.argsort(start, kind="stable")
  batches = [order[i:i + batch_size] for i in range(0, N, batch_size)]
  cache.mkdir(parents=True, exist_ok=True)
  bar = tqdm(total=N, initial=int(done.sum()), desc="regenerating replies",
             unit="conv", disable=not progress)
  for b, rows in enumerate(batches):
    if done[rows].all():
      continue
    prompts = [ex.ids[r, :start[r]].tolist() for r in rows]
    budget = min(max_new_tokens, T - int(start[rows].min()))
    res = runner.generate_ids(model, prompts, max_new_tokens=budget,
                              sampling=sampling, seed=seed + b)
    for r, p, row in zip(rows, prompts, res.rows):
      ids = (p + row.output_ids)[:T]
      out.ids[r] = 0
      out.ids[r, :len(ids)] = ids
      out.mask[r] = False
      out.mask[r, len(p):len(ids)] = True
      out.lengths[r] = len(ids)
    done[rows] = True
    _save(partial, out, done=done)
    bar.update(len(rows))
  bar.close()
  _save(path, out)
  partial.unlink(missing_ok=True)
  return out


def _fingerprint(model) -> str:
  """Which target wrote the replies: its config and a slice of its weights."""
  w = np.asarray(model.target.embedding(model.params)[:4], np.float32)
  return hashlib.sha256(repr(model.config).encode() + w.tobytes()).hexdigest()


def _save(path: pathlib.Path, ex: Examples, **extra) -> None:
  """Writes atomically: a crash mid-write leaves the previous file."""
  tmp = path.with_suffix(".tmp.npz")
  np.savez(tmp, ids=ex.ids, mask=ex.mask, lengths=ex.lengths, **extra)
  tmp.replace(path)
