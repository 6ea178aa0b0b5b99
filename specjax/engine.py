"""The decode engine: ``prefill``, ``step`` and ``generate`` over a ``DecodeState``.

Everything here is a pure function: ``generate`` is one ``lax.while_loop`` of
``step`` and can be traced inside a caller's own ``jax.jit`` (no host
callbacks, no Python branching on traced values, no hidden state). The
``*_jit`` variants are the public jitted boundary; ``step_jit`` donates the
state so the cache is updated in place, and ``stream`` drives it from Python
for notebooks.

Token bookkeeping: ``tokens[b, :num_tokens[b]]`` is row b's prompt plus what
it generated; the last of these has been sampled but not yet fed to the model,
so the target cache always holds ``num_tokens - 1`` entries while a row runs.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
from flax import struct

from specjax.cache import KVCache
from specjax.models import llama
from specjax.models.config import ModelConfig
from specjax.sampling import SamplingParams, sample_logits

# Per-row stop reasons (``DecodeState.stop_reason``).
RUNNING, STOP_EOS, STOP_BUDGET, STOP_CAPACITY = 0, 1, 2, 3
STOP_NAMES = {RUNNING: "running", STOP_EOS: "eos", STOP_BUDGET: "length",
              STOP_CAPACITY: "capacity"}


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Static decode settings (hashable; a jit static argument).

  Attributes:
    capacity: S, slots of the KV cache and of the token buffer. Pick it from
      ``bucketing.capacity_for`` so nearby request sizes share one compile.
    sampling: warping and temperature (0 = greedy).
    eos_ids: tokens that end a row (the EOS itself is kept in the output).
  """
  capacity: int
  sampling: SamplingParams = SamplingParams()
  eos_ids: tuple[int, ...] = ()


@struct.dataclass
class DecodeState:
  """Everything a decode loop carries.

  Attributes:
    tokens: ``int32[B, S]`` prompt + generated tokens, left-aligned.
    num_tokens: ``int32[B]`` valid entries of ``tokens``.
    prompt_lengths: ``int32[B]``.
    max_new_tokens: ``int32[]`` per-row budget of generated tokens.
    stop_reason: ``int32[B]``: RUNNING, STOP_EOS, STOP_BUDGET or STOP_CAPACITY.
    cache: target KV cache, ``lengths == num_tokens - 1`` while running.
    key: PRNG key for the next step.
    num_steps: ``int32[]`` target forwards after the prefill.
  """
  tokens: jax.Array
  num_tokens: jax.Array
  prompt_lengths: jax.Array
  max_new_tokens: jax.Array
  stop_reason: jax.Array
  cache: KVCache
  key: jax.Array
  num_steps: jax.Array

  @property
  def done(self) -> jax.Array:
    return self.stop_reason != RUNNING

  @property
  def num_new_tokens(self) -> jax.Array:
    return self.num_tokens - self.prompt_lengths


def _update_stops(state: DecodeState, last_tok_B: jax.Array,
                  dcfg: DecodeConfig) -> DecodeState:
  """Marks rows that just stopped; the first reason to fire wins."""
  is_eos = jnp.isin(last_tok_B, jnp.asarray(dcfg.eos_ids or (-1,), jnp.int32))
  clauses = (
      (STOP_EOS, is_eos),
      (STOP_BUDGET, state.num_new_tokens >= state.max_new_tokens),
      # The newest token must still fit in the cache when it is fed.
      (STOP_CAPACITY, state.num_tokens >= dcfg.capacity),
  )
  reason = state.stop_reason
  for code, fired in reversed(clauses):
    reason = jnp.where((state.stop_reason == RUNNING) & fired, code, reason)
  return state.replace(stop_reason=reason)


def prefill(params: llama.LlamaParams, prompt_BT: jax.Array,
            prompt_lengths_B: jax.Array, key: jax.Array,
            max_new_tokens: jax.Array | int, *, model_cfg: ModelConfig,
            dcfg: DecodeConfig) -> DecodeState:
  """Runs the prompts (right-padded to a bucket) and samples each first token.

  Args:
    prompt_BT: ``int32[B, Tp]`` prompts padded on the right (any pad id).
    prompt_lengths_B: true lengths, each in ``[1, Tp]``.
    max_new_tokens: budget of generated tokens per row, at least 1: the
      prefill always samples one (an array: changing it does not recompile).
  """
  B, Tp = prompt_BT.shape
  S = dcfg.capacity
  if Tp >= S:  # the first sampled token needs a slot after the prompt
    raise ValueError(f"prompt bucket {Tp} must be below cache capacity {S}")
  lengths = jnp.asarray(prompt_lengths_B, jnp.int32)
  cache = llama.init_cache(model_cfg, B, S, params.embed.dtype)
  out = llama.forward(params, model_cfg, prompt_BT, cache,
                      logit_positions_BP=(lengths - 1)[:, None])
  key, sub = jax.random.split(key)
  first_B = sample_logits(out.logits[:, 0], dcfg.sampling, sub)
  tokens = jnp.zeros((B, S), jnp.int32).at[:, :Tp].set(prompt_BT)
  tokens = tokens.at[jnp.arange(B), lengths].set(first_B, mode="drop")
  state = DecodeState(
      tokens=tokens, num_tokens=lengths + 1, prompt_lengths=lengths,
      max_new_tokens=jnp.asarray(max_new_tokens, jnp.int32),
      stop_reason=jnp.zeros((B,), jnp.int32),
      cache=out.cache.with_lengths(lengths), key=key,
      num_steps=jnp.zeros((), jnp.int32))
  return _update_stops(state, first_B, dcfg)


def step(params: llama.LlamaParams, state: DecodeState, *,
         model_cfg: ModelConfig, dcfg: DecodeConfig) -> DecodeState:
  """One target forward: feeds each row's newest token, samples the next.

  Rows already stopped still ride along in the batch (fixed shapes) but their
  tokens, lengths and cache lengths do not move.
  """
  B = state.tokens.shape[0]
  rows = jnp.arange(B)
  last_B = state.tokens[rows, state.num_tokens - 1]
  out = llama.forward(params, model_cfg, last_B[:, None], state.cache)
  key, sub = jax.random.split(state.key)
  next_B = sample_logits(out.logits[:, 0], dcfg.sampling, sub)
  live = ~state.done
  tokens = state.tokens.at[rows, jnp.where(live, state.num_tokens, dcfg.capacity)
                           ].set(next_B, mode="drop")
  num_tokens = state.num_tokens + live
  state = state.replace(
      tokens=tokens, num_tokens=num_tokens,
      cache=out.cache.with_lengths(jnp.where(live, num_tokens - 1,
                                             state.cache.lengths)),
      key=key, num_steps=state.num_steps + 1)
  return _update_stops(state, jnp.where(live, next_B, -1), dcfg)


def generate(params: llama.LlamaParams, prompt_BT: jax.Array,
             prompt_lengths_B: jax.Array, key: jax.Array,
             max_new_tokens: jax.Array | int, *, model_cfg: ModelConfig,
             dcfg: DecodeConfig) -> DecodeState:
  """Prefill then ``step`` until every row has stopped, in one while_loop."""
  state = prefill(params, prompt_BT, prompt_lengths_B, key, max_new_tokens,
                  model_cfg=model_cfg, dcfg=dcfg)
  return jax.lax.while_loop(
      lambda s: jnp.any(~s.done),
      lambda s: step(params, s, model_cfg=model_cfg, dcfg=dcfg),
      state)


_STATIC = ("model_cfg", "dcfg")
prefill_jit = jax.jit(prefill, static_argnames=_STATIC)
step_jit = jax.jit(step, static_argnames=_STATIC, donate_argnames=("state",))
generate_jit = jax.jit(generate, static_argnames=_STATIC)


def stream(params: llama.LlamaParams, prompt_BT, prompt_lengths_B, key,
           max_new_tokens, *, model_cfg: ModelConfig, dcfg: DecodeConfig
           ) -> Iterator[DecodeState]:
  """Yields the state after the prefill and after every step (same jitted step).

  For notebooks and streaming UIs: each yielded state's ``tokens`` hold
  everything so far. The state is donated to the next step, so read what you
  need from a yielded state before advancing the iterator.
  """
  state = prefill_jit(params, prompt_BT, prompt_lengths_B, key, max_new_tokens,
                      model_cfg=model_cfg, dcfg=dcfg)
  yield state
  while not bool(jnp.all(state.done)):
    state = step_jit(params, state, model_cfg=model_cfg, dcfg=dcfg)
    yield state
