"""CPU kernels for decode and verify steps, as XLA custom calls:
a matmul for a few rows and attention over the cache slots in use.

Decode and verify forwards multiply M = batch x tokens <= 64 rows by weights
far larger than any cache; XLA CPU's dot runs that shape well below the
weight-read limit (docs/DESIGN.md, "Why verification costs ~2 forwards
with XLA's ops on a CPU"). ``small_matmul`` calls ``small_gemm.cc`` (beside
this file) through
``jax.ffi``: part of the compiled program, not a host callback, so it stays
inside ``jit`` and ``lax.while_loop``. The weight must be ``pack``-ed once
into 16-column panels (``[ceil(N / 16), K, 16]``), which the kernel reads
front to back. ``attention`` (``attention.cc``) is the decode and
verify attention of packed models (``decoder.forward``): XLA's spends a third
of a decode step on every slot of the cache; it reads only the slots in use.

Each kernel runs the widest of its AVX-512, AVX2 + FMA and plain C++
variants that the CPU has (``isa()``; ``SPECJAX_NATIVE_ISA=avx2`` or
``generic`` caps it, read once a process).

The shared library builds with the package (``setup.py``: ``pip install``
of the repository, a wheel or ``make install``, against jaxlib's FFI
headers). When it is missing or
fails to load, or ``SPECJAX_NATIVE=0`` is set, ``available()`` is False with
one warning line saying why, ``small_matmul`` computes the same product
with XLA on the packed layout and ``decoder.forward`` uses XLA's attention.
Differentiable: the kernels compute the forward; their VJPs are XLA's
(``small_matmul``'s here, the attention's in ``models.layers``), so
``jax.grad`` runs through a packed model on the kernels' path.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import warnings

import jax
import jax.numpy as jnp

LIBRARY = pathlib.Path(__file__).with_name("_native.so")
TARGET = "specjax_small_gemm"
TARGET_BF16 = "specjax_small_gemm_bf16"  # bf16 panels (``pack(w, bf16)``)
ATTENTION = "specjax_attention"
LANES = 16  # output columns per panel (small_gemm.cc: kLanes)
_status: dict = {}


def available() -> bool:
  """Whether the kernel is built, loaded and registered (once a process);
  the first call that finds it is not warns with the reason, once."""
  if "ok" not in _status:
    reason = _load()
    _status["ok"] = reason is None
    if reason:
      warnings.warn(f"specjax: native CPU kernels off ({reason}); using "
                    "XLA's ops", RuntimeWarning, stacklevel=2)
  return _status["ok"]


def isa() -> str:
  """The instruction set the kernels run on this CPU: ``"avx512"``,
  ``"avx2"`` or ``"generic"`` (plain C++), the widest the CPU has unless
  the environment variable ``SPECJAX_NATIVE_ISA`` (``avx2``, ``generic``)
  caps it; ``"unavailable"`` without the library."""
  if not available():
    return "unavailable"
  lib = ctypes.cdll.LoadLibrary(str(LIBRARY))
  return ("generic", "avx2", "avx512")[lib.SpecjaxIsa()]


def default_on(dtype) -> bool:
  """Whether a model is packed for the kernel unless told otherwise
  (``registry.load_model``): JAX's default backend is the CPU, the weights
  are f32 and the kernel is ``available()``. Elsewhere XLA's dot is the path."""
  return (jax.default_backend() == "cpu"
          and jnp.dtype(dtype) == jnp.float32 and available())


def _load():
  """None when registered, else why not."""
  if os.environ.get("SPECJAX_NATIVE", "1") == "0":
    return "SPECJAX_NATIVE=0"
  if not LIBRARY.is_file():
    return (f"{LIBRARY.name} not built when specjax was installed (no "
            "C++17 compiler, or its build failed); reinstall with g++")
  try:
    lib = ctypes.cdll.LoadLibrary(str(LIBRARY))
    for target, fn in ((TARGET, lib.SpecjaxSmallGemm),
                       (TARGET_BF16, lib.SpecjaxSmallGemmBf16),
                       (ATTENTION, lib.SpecjaxAttention)):
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn),
                                  platform="cpu")
  except (OSError, AttributeError, RuntimeError) as e:
    return f"{LIBRARY.name} failed to load: {e}"
  return None


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
  panels f32 or bf16). The native kernel when ``available()``, else XLA on
  the packed layout (bf16 widened to f32 first: the same products). Its
  VJP is the XLA product's."""
  if available():
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


def attention(q_BTNH: jax.Array, k_BGHS: jax.Array, v_BGSH: jax.Array,
              k_new_BTGH: jax.Array, v_new_BTGH: jax.Array,
              lengths_B: jax.Array, mask_BTT: jax.Array) -> jax.Array:
  """``f32[B, T, N * H]``: the T new queries of each row attend over its
  cache prefix (slots ``s < lengths[b]``, only read) and over the new
  tokens' own keys/values: new token u is visible to t iff ``mask[b, t, u]``.
  Reads only the slots in use; needs ``available()`` (``decoder.forward``
  falls back to XLA's attention)."""
  if not available():
    raise RuntimeError("native.attention: the native library is not "
                       "available (see the warning)")
  B, T, N, H = q_BTNH.shape
  f32 = lambda a: a.astype(jnp.float32)
  out = jax.ffi.ffi_call(
      ATTENTION, jax.ShapeDtypeStruct((B, T, N, H), jnp.float32),
      vmap_method="sequential")(
          f32(q_BTNH), f32(k_BGHS), f32(v_BGSH), f32(k_new_BTGH),
          f32(v_new_BTGH), lengths_B.astype(jnp.int32), mask_BTT.astype(bool))
  return out.reshape(B, T, N * H)
