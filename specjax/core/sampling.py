"""Logits -> probabilities: the one warping every code path uses.

Draft and target distributions must be warped identically for speculative
sampling to be exact, so temperature / top-k / top-p live here and nowhere
else. Order follows transformers' warpers: temperature, then top-k, then top-p
on the top-k-renormalized distribution; ties at a cut-off are kept. All math in
f32 whatever the model dtype. Temperature 0 means greedy: the "distribution" is
the one-hot of the argmax (ties -> lowest id, like ``jnp.argmax``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal f32
F32_MAX = float(np.finfo(np.float32).max)


def require_int(name: str, value) -> None:
  """Raises ``TypeError`` unless ``value`` is an integer (numpy's too):
  never 4.0, True or "4"."""
  if isinstance(value, bool) or not hasattr(value, "__index__"):
    raise TypeError(f"{name} must be an int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling knobs (hashable; changing them recompiles).

  Attributes:
    temperature: 0 for greedy, else a normal f32 (``F32_TINY`` up to
      ``F32_MAX``).
    top_k: keep the k most likely tokens; 0 disables.
    top_p: keep the most likely tokens until their mass reaches top_p, plus
      every token tied with the last one kept; 1 disables. In (0, 1].
    min_p: then keep the tokens whose probability is at least min_p times
      the most likely one's; 0 disables. In [0, 1].
  The order is transformers' ``generate``'s: temperature, top-k, top-p,
  min-p.
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  def __post_init__(self):
    require_int("top_k", self.top_k)
    if not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    # Acceptance math is f32: a temperature f32 cannot hold as a normal
    # number (XLA flushes subnormals to 0) would divide 0 by 0.
    if not (self.temperature == 0 or F32_TINY <= self.temperature <= F32_MAX):
      raise ValueError(f"temperature {self.temperature} is outside f32's "
                       f"range [{F32_TINY:.3g}, {F32_MAX:.3g}]; 0 is greedy")
    if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
      raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def warp(logits_XV: jax.Array, sp: SamplingParams) -> jax.Array:
  """Probabilities ``f32[..., V]`` after temperature, top-k, top-p and
  min-p."""
  logits = logits_XV.astype(jnp.float32)
  V = logits.shape[-1]
  if sp.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
  # Shift first: the max becomes 0, so even a tiny temperature gives -inf,
  # never NaN, for the other tokens.
  logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / sp.temperature
  k = sp.top_k if 0 < sp.top_k < V else 0
  if k:
    top_vals = jax.lax.top_k(logits, k)[0]
    logits = jnp.where(logits < top_vals[..., -1:], -jnp.inf, logits)
  probs = jax.nn.softmax(logits, axis=-1)
  if sp.top_p < 1:
    # Sorted probabilities: the top-k survivors if any, else the whole vocab.
    sorted_p = (jax.lax.top_k(probs, k)[0] if k
                else -jnp.sort(-probs, axis=-1))
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep = mass_before < sp.top_p  # the top token always survives
    threshold = jnp.min(jnp.where(keep, sorted_p, jnp.inf), axis=-1,
                        keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  if sp.min_p > 0:  # the most likely token always survives
    top = jnp.max(probs, axis=-1, keepdims=True)
    probs = jnp.where(probs >= sp.min_p * top, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


def seed_key(seed: int) -> jax.Array:
  """The PRNG key of an integer seed, every bit of it counted. Without
  x64, ``jax.random.key`` keeps a seed's low 32 bits only (2**32 and 0
  give one key); here the bits above fold in, so seeds below 2**32 keep
  the keys they always had and larger ones get their own. Taken modulo
  2**63 (a CLI's seed plus a prompt's index may pass it)."""
  require_int("seed", seed)
  seed = int(seed) % 2**63
  key = jax.random.key(seed & 0xFFFFFFFF)
  return jax.random.fold_in(key, seed >> 32) if seed >> 32 else key


def split(key: jax.Array, num: int = 2) -> jax.Array:
  """``jax.random.split`` of one key (``[num]``) or of a key per row
  (``key[B]`` -> ``[num, B]``, row b's from key[b] alone): index the first
  axis either way."""
  if jnp.ndim(key) == 0:
    return jax.random.split(key, num)
  return jax.vmap(lambda k: jax.random.split(k, num), out_axes=1)(key)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """U[0, 1) draws of ``shape``: from one key, or row b's (the first axis)
  from ``key[b]`` alone."""
  if jnp.ndim(key) == 0:
    return jax.random.uniform(key, shape)
  return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(key)


def sample(probs_XV: jax.Array, key: jax.Array) -> jax.Array:
  """One token per leading index from probabilities (zeros are never
  drawn); with a key per row (``key[B]``), row b's from ``key[b]`` alone."""
  pick = lambda p, k: jax.random.categorical(k, jnp.log(p), axis=-1)
  if jnp.ndim(key) == 0:
    return pick(probs_XV, key).astype(jnp.int32)
  return jax.vmap(pick)(probs_XV, key).astype(jnp.int32)


def draw(probs_XV: jax.Array, sp: SamplingParams,
         key: jax.Array) -> jax.Array:
  """``int32[...]`` tokens from ``warp``-ed probabilities: the argmax when
  greedy (no random draw), else a sample."""
  if sp.greedy:
    return jnp.argmax(probs_XV, axis=-1).astype(jnp.int32)
  return sample(probs_XV, key)


def sample_logits(logits_XV: jax.Array, sp: SamplingParams,
                  key: jax.Array) -> jax.Array:
  """``int32[...]`` next tokens from logits (``draw`` of ``warp``)."""
  return draw(warp(logits_XV, sp), sp, key)
