"""Per-row gathers and scatters: row b reads or writes its own positions.

``at_rows(x, idx)`` is ``x[b, idx[b]]`` and ``set_at_rows`` its update, for
every row at once. They are written with ``vmap``, so the batch is a batching
dimension of the gather/scatter rather than an ``arange(B)`` index array:
on a mesh (``specjax.core.sharding``) XLA's partitioner then keeps each row's
reads and writes on the devices that hold the row, where an explicit row
index makes it all-gather the indices and the updates (two all-gathers per
layer per step for the KV cache writes, measured).
"""

from __future__ import annotations

from typing import Optional

import jax


def at_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """``x[b, idx[b]]`` for each row b: ``idx`` is ``[B]`` (one position per
  row: ``[B, ...]`` out) or ``[B, T]`` (``[B, T, ...]``)."""
  return jax.vmap(lambda row, i: row[i])(x, idx)


def set_at_rows(x: jax.Array, idx: jax.Array, values: jax.Array,
                mode: Optional[str] = None) -> jax.Array:
  """``x`` with ``x[b, idx[b]] = values[b]`` for each row b (``mode="drop"``:
  positions past the end are skipped)."""
  return jax.vmap(lambda row, i, v: row.at[i].set(v, mode=mode))(x, idx,
                                                                 values)
