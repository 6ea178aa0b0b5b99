"""Explicit fixed-capacity KV cache with per-row lengths.

Rows of a batch hold different numbers of valid entries: row b's keys/values
live in slots ``[0, lengths[b])``. Everything past a row's length is stale and
masked out by attention; it is overwritten by the next write. Rolling back a
rejected draft is therefore just ``cache.with_lengths(new_lengths)``: nothing is
copied or reallocated and every shape stays fixed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  """Per-layer keys and values plus per-row lengths.

  Attributes:
    k: ``[L, B, S, G, H]`` keys (RoPE already applied).
    v: ``[L, B, S, G, H]`` values.
    lengths: ``int32[B]`` number of valid slots per row.
  """
  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @classmethod
  def init(cls, num_layers: int, batch: int, capacity: int,
           num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> "KVCache":
    shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def capacity(self) -> int:
    return self.k.shape[2]

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    """Roll back (or forward) every row to ``lengths [B]``; O(1), no copies."""
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

  def append(self, k_new: jax.Array, v_new: jax.Array) -> "KVCache":
    """Writes ``[L, B, T, G, H]`` new entries at each row's own offset.

    Row b's T entries go to slots ``lengths[b] + arange(T)``; lengths grow by
    T. Slots past the capacity are dropped (the engine stops rows before that
    can matter), so a write can never wrap or clobber valid entries.
    """
    num_new = k_new.shape[2]
    slots_BT = (self.lengths[:, None]
                + jnp.arange(num_new, dtype=jnp.int32)[None, :])
    rows_BT = jnp.broadcast_to(
        jnp.arange(slots_BT.shape[0])[:, None], slots_BT.shape)

    def write(buf, new):
      return buf.at[:, rows_BT, slots_BT].set(new.astype(buf.dtype),
                                              mode="drop")

    return KVCache(k=write(self.k, k_new), v=write(self.v, v_new),
                   lengths=self.lengths + num_new)
