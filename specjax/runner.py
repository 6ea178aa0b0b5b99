"""Host-side convenience: token lists in, per-row results out.

Pads prompts to a bucket, picks a bucketed capacity, calls the jitted engine
and unpacks rows. The CLI, the demo and the benchmarks all go through here;
research code that wants everything inside its own ``jax.jit`` calls
``specjax.generate`` directly.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

from specjax import bucketing, engine
from specjax.models.registry import Model
from specjax.sampling import SamplingParams  # re-exported for callers


@dataclasses.dataclass
class RowResult:
  """One prompt's generation (new tokens only, EOS included if it stopped there)."""
  prompt_ids: list[int]
  output_ids: list[int]
  stop_reason: str


@dataclasses.dataclass
class BatchResult:
  rows: list[RowResult]
  wall_s: float
  num_steps: int

  @property
  def new_tokens(self) -> int:
    return sum(len(r.output_ids) for r in self.rows)


def decode_config(model: Model, prompt_bucket: int, max_new_tokens: int,
                  sampling: SamplingParams) -> engine.DecodeConfig:
  capacity = bucketing.capacity_for(prompt_bucket, max_new_tokens)
  return engine.DecodeConfig(capacity=capacity, sampling=sampling,
                             eos_ids=model.config.eos_ids)


def generate_ids(model: Model, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 seed: int = 0) -> BatchResult:
  """Generates for a batch of token-id prompts in one jitted call.

  ``wall_s`` covers the device work only (inputs transferred, outputs
  fetched), compile time excluded once a bucket has been seen.
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  pad_id = model.tokenizer.pad_id or 0
  prompt_BT, lengths_B = bucketing.pad_prompts(prompts, pad_id)
  dcfg = decode_config(model, prompt_BT.shape[1], max_new_tokens, sampling)
  args = (model.params, prompt_BT, lengths_B, jax.random.key(seed),
          np.int32(max_new_tokens))
  start = time.perf_counter()
  state = engine.generate_jit(*args, model_cfg=model.config, dcfg=dcfg)
  tokens, num, reasons, steps = jax.device_get(
      (state.tokens, state.num_tokens, state.stop_reason, state.num_steps))
  wall = time.perf_counter() - start
  rows = [RowResult(prompt_ids=list(map(int, p)),
                    output_ids=tokens[b, lengths_B[b]:num[b]].tolist(),
                    stop_reason=engine.STOP_NAMES[int(reasons[b])])
          for b, p in enumerate(prompts)]
  return BatchResult(rows=rows, wall_s=wall, num_steps=int(steps))
