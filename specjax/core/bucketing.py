"""Host-side padding of requests to a few static shapes.

Every distinct (batch size, prompt bucket, capacity) shape compiles once;
requests inside the same bucket reuse the compiled program (``tests/test_engine.py`` counts
traces to prove it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

PROMPT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CAPACITY_MULTIPLE = 128


def bucket_length(n: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> int:
  """Smallest bucket >= n (multiples of the largest bucket beyond it)."""
  for b in buckets:
    if n <= b:
      return b
  top = buckets[-1]
  return -(-n // top) * top


def capacity_for(prompt_bucket: int, max_new_tokens: int,
                 extra: int = 0) -> int:
  """Cache slots for a prompt bucket plus the generation budget, rounded up.

  ``extra`` reserves room a speculative step may write past the budget.
  """
  need = prompt_bucket + max_new_tokens + extra
  return -(-need // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0,
                length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists to ``length`` (default: their bucket).

  Returns ``(int32[B, T], int32[B] lengths)``.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  lengths = np.array([len(p) for p in prompts], np.int32)
  T = length or bucket_length(int(lengths.max()))
  if lengths.max() > T:
    raise ValueError(f"prompt of {lengths.max()} tokens exceeds length {T}")
  out = np.full((len(prompts), T), pad_id, np.int32)
  for i, p in enumerate(prompts):
    out[i, :len(p)] = p
  return out, lengths
