"""Host-side convenience: token lists in, per-row results out.

Pads prompts to a bucket, picks a bucketed capacity, calls the jitted engine
and unpacks rows. The CLI, the demo and the benchmarks all go through here;
research code that wants everything inside its own ``jax.jit`` calls
``specjax.generate`` directly.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core import bucketing, engine, pearl, sharding
from specjax.core.sampling import (AllowedTokens, RowSampling, SamplingParams,
                                   require_int, seed_key)
from specjax.drafters.base import AR, Method
from specjax.models.registry import Model


@dataclasses.dataclass
class RowResult:
  """One prompt's generation (new tokens only, EOS included if it stopped there).

  ``prompt_index`` and ``sample_index`` name the row (its key's, with the
  seed's). ``target_forwards`` counts verify steps after the prefill; ``accepted_at[i]``
  how often draft position i was accepted (empty for AR); ``accepted_nodes[m]``
  how often tree node m + 1 was (empty for chains). ``logprobs[j]`` is
  ``output_ids[j]``'s log-probability under the distribution it was
  sampled from, ``raw_logprobs[j]`` under the target's own (T = 1)
  (``DecodeState.logprobs``). ``pre_verify_steps`` and
  ``post_verify_steps`` count a PEARL row's steps with no drafts pending
  and with some (``pearl.Pending``; 0 for other methods).
  """
  prompt_ids: list[int]
  output_ids: list[int]
  stop_reason: str
  prompt_index: int = 0
  sample_index: int = 0
  logprobs: list[float] = dataclasses.field(default_factory=list)
  raw_logprobs: list[float] = dataclasses.field(default_factory=list)
  target_forwards: int = 0
  num_drafted: int = 0
  accepted_at: list[int] = dataclasses.field(default_factory=list)
  accepted_nodes: list[int] = dataclasses.field(default_factory=list)
  pre_verify_steps: int = 0
  post_verify_steps: int = 0

  @property
  def tau(self) -> float:
    """Tokens emitted per target forward (the prefill's first token excluded)."""
    return (len(self.output_ids) - 1) / max(self.target_forwards, 1)

  @property
  def accepted_length_histogram(self) -> list[int]:
    """Verify steps that accepted exactly j drafts, j = 0..K."""
    return accepted_length_histogram(self.accepted_at, self.target_forwards)

  @property
  def spec_metrics(self) -> dict:
    """This row's speculation in vLLM's per-request schema: its verify
    steps (``num_spec_steps``; an AR row's one-token forwards), drafted and
    accepted tokens and their ratio, 1 + accepted drafts per step
    (``mean_acceptance_length``), and how many steps accepted j drafts
    (``acceptance_histogram``, j = 0..K)."""
    steps, drafted = self.target_forwards, self.num_drafted
    accepted = int(sum(self.accepted_at))
    return dict(num_spec_steps=steps, num_draft_tokens=drafted,
                num_accepted_draft_tokens=accepted,
                draft_acceptance_rate=accepted / drafted if drafted else 0.0,
                mean_acceptance_length=1 + accepted / steps if steps else 1.0,
                acceptance_histogram=self.accepted_length_histogram)


def accepted_length_histogram(accepted_at: Sequence[int],
                              forwards: int) -> list[int]:
  """Acceptance is prefix-closed, so ``accepted_at[i]`` counts the steps that
  accepted more than i drafts; differences give the exact histogram."""
  ge = np.concatenate([[forwards], accepted_at, [0]]).astype(np.int64)
  return (ge[:-1] - ge[1:]).tolist()


@dataclasses.dataclass
class BatchResult:
  """A batch's rows plus timing: ``wall_s`` is the decode call alone,
  ``compile_s`` the one-off compile of a new shape (~0 when it was cached);
  ``num_wide_steps`` of the ``num_steps`` verified all K + 1 positions."""
  rows: list[RowResult]
  wall_s: float
  compile_s: float
  num_steps: int
  num_wide_steps: int = 0

  @property
  def new_tokens(self) -> int:
    return sum(len(r.output_ids) for r in self.rows)


# One ``SamplingParams`` for every prompt, or one per prompt.
Sampling = Union[SamplingParams, Sequence[SamplingParams]]


def decode_config(model: Model, prompt_bucket: int, max_new_tokens: int,
                  sampling: SamplingParams, method: Method = AR
                  ) -> engine.DecodeConfig:
  k, nodes = method.num_draft, method.tree_nodes
  return engine.DecodeConfig(
      capacity=bucketing.capacity_for(prompt_bucket, max_new_tokens,
                                      extra=engine.block_width(k, nodes)),
      sampling=sampling, eos_ids=model.config.eos_ids,
      drafter=method.drafter, num_draft=k, tree_nodes=nodes, mesh=model.mesh,
      pearl=method.pearl)


class DoesNotFit(ValueError):
  """A requested batch would not fit the memory left."""


@dataclasses.dataclass
class ContextError(ValueError):
  """Prompt ``index`` (``length`` tokens) and ``max_new_tokens`` run past
  the model's ``context``, or a verify block of ``block`` tokens is wider
  than it."""
  index: int
  length: int
  max_new_tokens: int
  block: int
  context: int

  def __str__(self):
    if self.block > self.context:
      return (f"a verify block of {self.block} tokens is wider than the "
              f"model's context of {self.context}")
    return (f"prompt {self.index} ({self.length} tokens) + max_new_tokens "
            f"{self.max_new_tokens} exceed the model's context of "
            f"{self.context}")


def check_context(model: Model, lengths: Sequence[int],
                  max_new_tokens: int | Sequence[int], block: int = 1) -> None:
  """Raises ``ContextError`` when a prompt and its new tokens do not fit
  ``model.config.max_position``, or a verify block is wider than it. A
  block may reach past the last position: what it drafts there is past the
  budget and never kept (tests/test_reliability.py)."""
  ctx = model.config.max_position
  budgets = np.broadcast_to(max_new_tokens, (len(lengths),))
  for i, (n, budget) in enumerate(zip(lengths, budgets)):
    if n + budget > ctx or block > ctx:
      raise ContextError(i, int(n), int(budget), block, ctx)


def _check_ids(prompts, vocab_size: int) -> list[list[int]]:
  """The prompts as lists of ints (a 2-D array's rows too); a token id
  that is not an integer (1.5, True, "3") or not in [0, V) is refused."""
  out = []
  for p in prompts:
    row = p.tolist() if isinstance(p, np.ndarray) else list(p)
    for t in row:
      require_int("a token id", t)
      if not 0 <= t < vocab_size:  # a lookup past the table: NaN, no error
        raise ValueError(
            f"token id {t} is outside the vocabulary [0, {vocab_size})")
    out.append(row)
  return out


def decode_bytes(model: Model, batch: int, capacity: int, prompt_bucket: int,
                 block: int = 1,
                 chunk: int = engine.DecodeConfig.prefill_chunk) -> int:
  """What decoding ``batch`` rows in ``capacity`` slots allocates besides
  the weights: the KV cache and token buffer, the prefill's attention
  scores (one chunk of the prompt against every slot), and a step's
  logits and probabilities (``block`` tokens a row)."""
  c = model.config
  item = np.dtype(model.params.embed.dtype).itemsize if hasattr(
      model.params, "embed") else 4
  cache = 2 * c.num_layers * batch * c.num_kv_heads * capacity * c.head_dim
  scores = batch * c.num_heads * min(prompt_bucket, chunk) * capacity * 4
  logits = 4 * batch * block * c.vocab_size * 4
  return cache * item + batch * capacity * 4 + scores + logits


def available_bytes(model: Model) -> int:
  """Memory the run may take: the accelerator's free memory, else the
  host's available memory (``MemAvailable``); 0 when unknown. Asks this
  process's first device: another process's devices cannot answer."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def check_memory(model: Model, batch: int, capacity: int,
                 prompt_bucket: int, block: int = 1) -> None:
  """Refuses, before anything is allocated, a batch whose decode state
  would not fit the memory left (``decode_bytes`` against
  ``available_bytes``)."""
  need, have = (decode_bytes(model, batch, capacity, prompt_bucket, block),
                available_bytes(model))
  if have and need > have:
    raise DoesNotFit(
        f"{batch} rows x {capacity} slots need ~{need / 2**30:.1f} GiB for "
        f"the KV cache and scratch; {have / 2**30:.1f} GiB is free: use "
        f"fewer rows or shorter prompts")


def generate_ids(model: Model, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int | Sequence[int],
                 sampling: Sampling = SamplingParams(), seed: int = 0,
                 method: Method = AR, min_new_tokens: int | Sequence[int] = 0,
                 stop: Sequence[Sequence[int]] = (), num_samples: int = 1,
                 first_prompt: int = 0,
                 allowed_tokens: Optional[AllowedTokens] = None
                 ) -> BatchResult:
  """Generates for a batch of token-id prompts in one compiled call, with
  ``method`` (``methods.build``; default AR).

  ``num_samples`` completions per prompt (rows prompt-major: ``rows[i * N
  + s]`` is prompt i's sample s). Each row draws from its own key,
  ``fold_in(fold_in(seed_key(seed), first_prompt + i), s)``, so its output
  depends on the seed, its prompt index and its sample index, not on the
  other rows. ``sampling`` is one ``SamplingParams`` for all prompts or
  one per prompt; their values are data, so settings of one program
  (``SamplingParams.program_of``: a temperature or top-p sweep, a batch
  mixing them) share one compile. ``max_new_tokens`` and
  ``min_new_tokens`` are one for all prompts or one per prompt
  (``DecodeState``'s); ``stop`` holds token sequences that end a row where
  one is generated (``DecodeConfig.stop_sequences``); ``allowed_tokens`` a
  hook saying which tokens a row may generate next
  (``DecodeConfig.allowed_tokens``).

  Each (batch, prompt bucket, capacity, config) shape is compiled once per
  process, ahead of the timed call, so ``wall_s`` never includes compilation.
  A model loaded onto a mesh (``Model.mesh``) decodes over all of it: the
  rows split over its ``data`` axis, drafter parameters replicated.
  """
  rows, args, kw, dcfg = _prepare(
      model, prompts, max_new_tokens, sampling, seed, method, min_new_tokens,
      stop, num_samples, first_prompt, allowed_tokens)
  start = time.perf_counter()
  run = _compiled(args, kw, model, dcfg)
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  state = run(*args, **kw)
  rows, steps, wide = _rows(state, rows, args[2])
  return BatchResult(rows=rows, wall_s=time.perf_counter() - start,
                     compile_s=compile_s, num_steps=steps,
                     num_wide_steps=wide)


def stream_ids(model: Model, prompts: Sequence[Sequence[int]],
               on_tokens: Callable[[list[list[int]]], None], *,
               max_new_tokens: int | Sequence[int],
               sampling: Sampling = SamplingParams(), seed: int = 0,
               method: Method = AR, min_new_tokens: int | Sequence[int] = 0,
               stop: Sequence[Sequence[int]] = (), num_samples: int = 1,
               first_prompt: int = 0,
               allowed_tokens: Optional[AllowedTokens] = None
               ) -> BatchResult:
  """``generate_ids`` one step at a time (``engine.stream``: the same jitted
  step): after the prefill and after every step, ``on_tokens`` gets each
  row's newly committed token ids. The same tokens as ``generate_ids``;
  ``wall_s`` includes compiling the prefill and step (``compile_s`` 0)."""
  rows, args, kw, dcfg = _prepare(
      model, prompts, max_new_tokens, sampling, seed, method, min_new_tokens,
      stop, num_samples, first_prompt, allowed_tokens)
  lengths = sharding.to_host(args[2])
  shown = lengths.copy()
  start = time.perf_counter()
  for state in engine.stream(*args, target=model.target, dcfg=dcfg, **kw):
    tokens, num = sharding.to_host((state.tokens, state.num_tokens))
    on_tokens([tokens[b, shown[b]:num[b]].tolist()
               for b in range(len(rows))])
    shown = num
  rows, steps, wide = _rows(state, rows, lengths)
  return BatchResult(rows=rows, wall_s=time.perf_counter() - start,
                     compile_s=0.0, num_steps=steps, num_wide_steps=wide)


def _per_row(name: str, value, rows: int, least: int) -> np.ndarray:
  """``int32[rows]``: ``value`` for every row, or one per row, each an
  integer of at least ``least``."""
  values = [value] * rows if np.ndim(value) == 0 else list(value)
  if len(values) != rows:
    raise ValueError(f"{name} gives {len(values)} values for {rows} prompts")
  for v in values:
    require_int(name, v)
    if v < least:
      raise ValueError(f"{name} must be >= {least}, got {v}")
  return np.asarray(values, np.int32)


def _row_sampling(sampling, num_prompts: int, num_samples: int,
                  vocab_size: int):
  """``(program, RowSampling)`` of one ``SamplingParams`` or one per
  prompt: the program that holds them all (``SamplingParams.program_of``)
  and each row's values."""
  per_prompt = ([sampling] * num_prompts
                if isinstance(sampling, SamplingParams) else list(sampling))
  if len(per_prompt) != num_prompts:
    raise ValueError(f"sampling gives {len(per_prompt)} settings for "
                     f"{num_prompts} prompts")
  for sp in per_prompt:
    if not isinstance(sp, SamplingParams):
      raise TypeError(f"sampling must be SamplingParams, got "
                      f"{type(sp).__name__}")
  per_prompt = [sp.for_vocab(vocab_size) for sp in per_prompt]
  program = SamplingParams.program_of(per_prompt)
  rows = [sp for sp in per_prompt for _ in range(num_samples)]
  return program, RowSampling.build(program, rows)


def row_keys(seed: int, prompt_index: Sequence[int],
             sample_index: Sequence[int]) -> jax.Array:
  """``key[B]``: row b's, ``fold_in(fold_in(seed_key(seed),
  prompt_index[b]), sample_index[b])``."""
  fold = lambda p, s: jax.random.fold_in(
      jax.random.fold_in(seed_key(seed), p), s)
  return jax.vmap(fold)(jnp.asarray(prompt_index, jnp.uint32),
                        jnp.asarray(sample_index, jnp.uint32))


def _prepare(model, prompts, max_new_tokens, sampling, seed, method: Method,
             min_new_tokens=0, stop=(), num_samples=1, first_prompt=0,
             allowed_tokens=None):
  """Checked, padded, placed arguments of ``engine.generate``: ``(rows,
  args, keyword args, dcfg)``, ``rows`` the ``(prompt ids, prompt index,
  sample index)`` of each row."""
  if not isinstance(method, Method):
    raise TypeError(f"method must be a specjax Method (methods.build), got "
                    f"{type(method).__name__}")
  for name, value, least in (("num_samples", num_samples, 1),
                             ("first_prompt", first_prompt, 0)):
    require_int(name, value)
    if value < least:
      raise ValueError(f"{name} must be >= {least}, got {value}")
  prompts = _check_ids(prompts, model.config.vocab_size)
  budgets = np.repeat(_per_row("max_new_tokens", max_new_tokens,
                               len(prompts), 1), num_samples)
  least = np.repeat(_per_row("min_new_tokens", min_new_tokens, len(prompts),
                             0), num_samples)
  rows = [(p, first_prompt + i, s) for i, p in enumerate(prompts)
          for s in range(num_samples)]
  prompts = [p for p, _, _ in rows]
  stops = tuple(tuple(seq) for seq in _check_ids(stop,
                                                 model.config.vocab_size))
  program, row_sampling = _row_sampling(
      sampling, len(rows) // num_samples, num_samples,
      model.config.vocab_size)
  pad_id = getattr(model.tokenizer, "pad_id", None) or 0
  prompt_BT, lengths_B = bucketing.pad_prompts(prompts, pad_id)
  dcfg = dataclasses.replace(
      decode_config(model, prompt_BT.shape[1], int(budgets.max()), program,
                    method), stop_sequences=stops,
      allowed_tokens=allowed_tokens)
  check_context(model, lengths_B, budgets, dcfg.block)
  check_memory(model, len(prompts), dcfg.capacity, prompt_BT.shape[1],
               dcfg.block)
  by_row = (prompt_BT, lengths_B, budgets)
  kw = dict(drafter_params=method.params, min_new_tokens=least,
            sampling=row_sampling)
  key = row_keys(seed, [i for _, i, _ in rows], [s for _, _, s in rows])
  if model.mesh is not None:  # rows over the mesh's data axis
    by_row = sharding.shard_batch(by_row, model.mesh)
    key = sharding.replicate(key, model.mesh)
    kw = dict(drafter_params=sharding.place_drafter_params(method.params,
                                                           model.mesh),
              min_new_tokens=sharding.shard_batch(least, model.mesh),
              sampling=sharding.shard_batch(row_sampling, model.mesh))
  return rows, (model.params, *by_row[:2], key, by_row[2]), kw, dcfg


def _rows(state: engine.DecodeState, rows, lengths_B):
  """``(rows, num_steps, num_wide_steps)`` of a finished state, ``rows``
  each row's ``(prompt ids, prompt index, sample index)``."""
  tokens, lp, raw, num, reasons, steps, wide, fwd, drafted, acc, nodes = (
      sharding.to_host((state.tokens, state.logprobs, state.raw_logprobs,
                        state.num_tokens, state.stop_reason,
                        state.num_steps, state.num_wide, state.num_forwards,
                        state.num_drafted, state.accepted_at,
                        state.accepted_nodes)))
  lengths_B = np.asarray(sharding.to_host(lengths_B))
  new = lambda a, b: a[b, lengths_B[b]:num[b]].tolist()
  pend = state.drafter_state
  pre, post = (sharding.to_host((pend.pre_steps, pend.post_steps))
               if isinstance(pend, pearl.Pending) else (num * 0, num * 0))
  rows = [RowResult(prompt_ids=list(map(int, p)), output_ids=new(tokens, b),
                    stop_reason=engine.STOP_NAMES[int(reasons[b])],
                    prompt_index=i, sample_index=s,
                    logprobs=new(lp, b), raw_logprobs=new(raw, b),
                    target_forwards=int(fwd[b]), num_drafted=int(drafted[b]),
                    accepted_at=acc[b].tolist(),
                    accepted_nodes=nodes[b].tolist(),
                    pre_verify_steps=int(pre[b]),
                    post_verify_steps=int(post[b]))
          for b, (p, i, s) in enumerate(rows)]
  return rows, int(steps), int(wide)


_EXECUTABLES: dict = {}


def _compiled(args, kw, model: Model, dcfg: engine.DecodeConfig):
  """The compiled ``generate`` for these argument shapes (compiled once).
  Before compiling, a process near its memory-mapping limit lets every
  compiled program go (``clear_compiled``)."""
  tree = (args, kw)
  key = (model.target, dcfg, jax.tree_util.tree_structure(tree),
         tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(tree)))
  if key not in _EXECUTABLES:
    if _mappings_held() > _mapping_limit() * 3 // 4:
      clear_compiled()
    _EXECUTABLES[key] = engine.generate_jit.lower(
        *args, **kw, target=model.target, dcfg=dcfg).compile()
  return _EXECUTABLES[key]


def clear_compiled() -> None:
  """Lets every compiled program go: this module's and JAX's caches
  (``jax.clear_caches()``), which hold each program it compiled. A compiled
  CPU program holds 500-2,000 memory mappings of its code (SmolLM2) and a
  Linux process may hold 65,530 by default (``vm.max_map_count``): past it
  XLA crashes. ``generate_ids`` calls this itself past three quarters of
  the limit (a benchmark of 9 methods over 4 prompt lengths holds ~36
  programs); a long sweep may call it between configurations."""
  _EXECUTABLES.clear()
  jax.clear_caches()


def _mappings_held() -> int:
  """Memory mappings this process holds (0 where ``/proc`` has none)."""
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def _mapping_limit() -> int:
  """The most mappings a process may hold (Linux's ``vm.max_map_count``;
  its default where it cannot be read)."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65530
