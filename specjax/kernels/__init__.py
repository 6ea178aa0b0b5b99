"""The native CPU kernels (C++ beside this file, built by ``make install``)
and their ``jax.ffi`` binding (``native``)."""
