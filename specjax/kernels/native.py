"""The shared library of the CPU kernels (``_native.so``, built from the
``.cc`` files beside this file): loading it, registering each kernel's XLA
FFI targets, and what it can run on this machine.

The kernels, one module each: ``small_gemm`` (a matmul for a few rows on
packed weights) and ``attention`` (decode and verify attention over the
cache slots in use). Each is called through ``jax.ffi``: part of the
compiled program, not a host callback, so it stays inside ``jit`` and
``lax.while_loop``. Each runs the widest of its AVX-512, AVX2 + FMA and
plain C++ variants that the CPU has (``isa()``; ``SPECJAX_NATIVE_ISA=avx2``
or ``generic`` caps it, read once a process).

The library builds with the package (``setup.py``: ``pip install`` of the
repository, a wheel or ``make install``, against jaxlib's FFI headers).
When it is missing or fails to load, or ``SPECJAX_NATIVE=0`` is set,
``available()`` is False with one warning line saying why, and the kernels'
callers use XLA's ops.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import warnings

import jax
import jax.numpy as jnp

LIBRARY = pathlib.Path(__file__).with_name("_native.so")
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
  from specjax.kernels import attention, small_gemm
  try:
    lib = ctypes.cdll.LoadLibrary(str(LIBRARY))
    for module in (small_gemm, attention):
      for target, symbol in module.FFI_TARGETS.items():
        jax.ffi.register_ffi_target(
            target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  except (OSError, AttributeError, RuntimeError) as e:
    return f"{LIBRARY.name} failed to load: {e}"
  return None
