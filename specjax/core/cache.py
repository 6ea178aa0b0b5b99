"""Explicit fixed-capacity KV cache with per-row lengths.

Rows of a batch hold different numbers of valid entries: row b's keys/values
live in slots ``[0, lengths[b])``. Everything past a row's length is stale and
masked out by attention; it is overwritten by the next write. Rolling back a
rejected draft is therefore just ``cache.with_lengths(new_lengths)``: nothing is
copied or reallocated and every shape stays fixed.

Layout (measured on XLA CPU: docs/DESIGN.md, "Layers are unrolled over
per-layer buffers"): one array per layer rather than one stacked ``[L, ...]``
array, because a dot that reads a static slice of a stacked array runs
several times slower than one reading its own buffer; keys stored
transposed (``[B, G, H, S]``) so that q @ k is a plain batched matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  """Per-layer keys and values plus per-row lengths.

  Attributes:
    k: L arrays ``[B, G, H, S]``: keys (RoPE applied), transposed.
    v: L arrays ``[B, G, S, H]``: values.
    lengths: ``int32[B]`` number of valid slots per row.
  """
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array

  @classmethod
  def init(cls, num_layers: int, batch: int, capacity: int,
           num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> "KVCache":
    k_shape = (batch, num_kv_heads, head_dim, capacity)
    v_shape = (batch, num_kv_heads, capacity, head_dim)
    return cls(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(num_layers)),
               v=tuple(jnp.zeros(v_shape, dtype) for _ in range(num_layers)),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def capacity(self) -> int:
    return self.v[0].shape[2]

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    """Roll back (or forward) every row to ``lengths [B]``; O(1), no copies."""
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

  def new_slots(self, num_new: int) -> jax.Array:
    """``int32[B, T]`` slots the next ``num_new`` entries of each row go to."""
    return (self.lengths[:, None]
            + jnp.arange(num_new, dtype=jnp.int32)[None, :])

  def write(self, new_kv, slots_BT: jax.Array) -> "KVCache":
    """Every layer's new ``(k, v)`` (``[B, T, G, H]`` each, as a forward
    with ``write_cache=False`` returns them) at ``slots_BT``; lengths are
    left to the caller. In place when the cache is donated."""
    ks, vs = zip(*(write_kv(kc, vc, k, v, slots_BT) for kc, vc, (k, v)
                   in zip(self.k, self.v, new_kv)))
    return self.replace(k=tuple(ks), v=tuple(vs))


def write_kv(k_BGHS: jax.Array, v_BGSH: jax.Array, k_BTGH: jax.Array,
             v_BTGH: jax.Array, slots_BT: jax.Array):
  """One layer's cache buffers with row b's T new entries at ``slots_BT[b]``.

  Slots past the capacity are dropped, so a write can never wrap around and
  clobber a row's own prefix (the engine stops rows before they fill up). With the
  buffers donated, XLA performs the scatter in place. Per row (``vmap``, as
  ``specjax.core.rows``): on a mesh each device writes its own rows.
  """
  def row(k_GHS, v_GSH, k_TGH, v_TGH, slots_T):
    k_TGH, v_TGH = k_TGH.astype(k_GHS.dtype), v_TGH.astype(v_GSH.dtype)
    return (k_GHS.at[:, :, slots_T].set(k_TGH.transpose(1, 2, 0), mode="drop"),
            v_GSH.at[:, slots_T].set(v_TGH.transpose(1, 0, 2), mode="drop"))
  return jax.vmap(row)(k_BGHS, v_BGSH, k_BTGH, v_BTGH, slots_BT)
