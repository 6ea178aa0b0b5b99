"""The native CPU kernels (C++ beside this file, built with the package),
one module each with its ``jax.ffi`` binding: ``small_gemm`` (a matmul for
a few rows on packed weights) and ``attention`` (over the cache slots in
use); ``native`` loads the shared library and says what it can run."""
