"""``y = x @ W`` on the CPU on pre-arranged weights (``small_gemm.cc``).

Decode and verify forwards multiply M = batch x tokens rows, a few, by
weights far larger than any cache; XLA CPU's dot runs that shape well below
the weight-read limit (docs/DESIGN.md, "Why verification costs ~2 forwards
with XLA's ops on a CPU"). The kernel streams each weight once with every
row's partial sums in registers; past 16 rows (prefill chunks, wide batches)
it blocks for the FMA units instead, 74-93% of their peak at 128 to 512 rows
(docs/DESIGN.md, "Prefill on the native path"). The weight must be
``pack``-ed once into 16-column panels (``[ceil(N / 16), K, 16]``), which
the kernel reads front to back; without the library (``native.available()``)
``small_matmul`` computes the same product with XLA on the packed layout.
Differentiable: the kernel computes the forward, its VJP is XLA's product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.kernels import native

TARGET = "specjax_small_gemm"
TARGET_BF16 = "specjax_small_gemm_bf16"  # bf16 panels (``pack(w, bf16)``)
# The library's symbol behind each XLA FFI target (``native`` registers them).
FFI_TARGETS = {TARGET: "SpecjaxSmallGemm", TARGET_BF16: "SpecjaxSmallGemmBf16"}
LANES = 16  # output columns per panel (small_gemm.cc: kLanes)


def pack(w_KN: jax.Array, dtype=jnp.float32) -> jax.Array:
  """``[K, N]`` -> ``[ceil(N / 16), K, 16]`` panels, zero-padded: each
  panel's K x 16 weights contiguous, in the order the kernel reads them.
  ``dtype`` f32 or bf16: bf16 panels are read at half the bytes and widened
  exactly, so they give the f32 result for weights that bf16 holds exactly
  (``exact_in``)."""
  K, N = w_KN.shape
  P = -(-N // LANES)
  w = jnp.pad(jnp.asarray(w_KN).astype(dtype), ((0, 0), (0, P * LANES - N)))
  return w.reshape(K, P, LANES).transpose(1, 0, 2)


def unpack(packed_PKL: jax.Array, n: int) -> jax.Array:
  """The ``[K, n]`` weight back from ``pack``'s panels."""
  P, K, L = packed_PKL.shape
  return packed_PKL.transpose(1, 0, 2).reshape(K, P * L)[:, :n]


def exact_in(w: jax.Array, dtype) -> bool:
  """Whether every value of ``w`` survives a round trip through ``dtype``
  (host-side, once, at pack time)."""
  w = jnp.asarray(w)
  return bool(jnp.all(w.astype(dtype).astype(w.dtype) == w))


def small_matmul(x_MK: jax.Array, packed_PKL: jax.Array, n: int
                 ) -> jax.Array:
  """``x @ W`` as ``f32[M, n]`` for ``packed = pack(W)`` (W: ``[K, n]``,
  panels f32 or bf16). The native kernel when ``native.available()``, else
  XLA on
  the packed layout (bf16 widened to f32 first: the same products). Its
  VJP is the XLA product's."""
  if native.available():
    return _kernel_matmul(x_MK, packed_PKL, n)
  return _xla_matmul(x_MK, packed_PKL, n)


def _xla_matmul(x_MK, packed_PKL, n):
  y = jnp.einsum("mk,pkl->mpl", x_MK.astype(jnp.float32),
                 packed_PKL.astype(jnp.float32),
                 preferred_element_type=jnp.float32)
  return y.reshape(x_MK.shape[0], -1)[:, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _kernel_matmul(x_MK, packed_PKL, n):
  bf16 = packed_PKL.dtype == jnp.bfloat16
  return jax.ffi.ffi_call(TARGET_BF16 if bf16 else TARGET,
                          jax.ShapeDtypeStruct((x_MK.shape[0], n),
                                               jnp.float32),
                          vmap_method="sequential")(
      x_MK.astype(jnp.float32),
      packed_PKL if bf16 else packed_PKL.astype(jnp.float32))


def _kernel_matmul_fwd(x_MK, packed_PKL, n):
  return _kernel_matmul(x_MK, packed_PKL, n), (x_MK, packed_PKL)


def _kernel_matmul_bwd(n, res, dy_MN):
  return jax.vjp(lambda x, w: _xla_matmul(x, w, n), *res)[1](dy_MN)


_kernel_matmul.defvjp(_kernel_matmul_fwd, _kernel_matmul_bwd)
