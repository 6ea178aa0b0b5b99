"""Decode, verify and prefill-chunk attention over a row's cache slots in
use, on the CPU (``attention.cc``): the attention of packed models
(``decoder.forward``). XLA's attention computes every slot of the cache and
costs a third of a SmolLM2 decode step, and in a prefill chunk every slot
of the capacity for every token; this reads only the slots a row has filled
and, of the chunk's own tokens, those up to the last one a token sees. Its
VJP is XLA's attention (``models.layers``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.kernels import native

TARGET = "specjax_attention"
# The library's symbol behind the XLA FFI target (``native`` registers it).
FFI_TARGETS = {TARGET: "SpecjaxAttention"}


def attention(q_BTNH: jax.Array, k_BGHS: jax.Array, v_BGSH: jax.Array,
              k_new_BTGH: jax.Array, v_new_BTGH: jax.Array,
              lengths_B: jax.Array, mask_BTT: jax.Array) -> jax.Array:
  """``f32[B, T, N * H]``: the T new queries of each row attend over its
  cache prefix (slots ``s < lengths[b]``, only read) and over the new
  tokens' own keys/values: new token u is visible to t iff ``mask[b, t, u]``.
  Reads only the slots in use; needs ``native.available()``
  (``decoder.forward`` falls back to XLA's attention)."""
  if not native.available():
    raise RuntimeError("attention: the native library is not "
                       "available (see the warning)")
  B, T, N, H = q_BTNH.shape
  f32 = lambda a: a.astype(jnp.float32)
  out = jax.ffi.ffi_call(
      TARGET, jax.ShapeDtypeStruct((B, T, N, H), jnp.float32),
      vmap_method="sequential")(
          f32(q_BTNH), f32(k_BGHS), f32(v_BGSH), f32(k_new_BTGH),
          f32(v_new_BTGH), lengths_B.astype(jnp.int32), mask_BTT.astype(bool))
  return out.reshape(B, T, N * H)
