"""Shared fixtures: strict JAX numerics, tiny reference models, the real model."""

import os
import pathlib

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")

# XLA's own code at LLVM -O0: the tiny-model tests, bound by compiling, take
# 20-25% less time (measured on test_engine + test_speculative, cold cache);
# a few that run the real model's XLA ops longer take up to ~1.3x (the
# native kernels are built apart). Set before the backend starts, inherited
# by subprocesses; XLA_FLAGS given wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

# Most of the suite's time is XLA compilation, and many tests compile the same
# programs (the same model forward under a new closure, a CLI subprocess, the
# other xdist worker). A compilation cache shared by all of them, through the
# environment for subprocesses, compiles each program once per machine.
_CACHE = pathlib.Path(__file__).parents[1] / ".pytest_cache" / "jax-compilation"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
jax.config.update("jax_compilation_cache_dir",
                  os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


@pytest.fixture(scope="session")
def smollm2():
  """The real SmolLM2-135M-Instruct (f32), loaded once per test session."""
  from specjax.models.registry import load_model
  return load_model("smollm2-135m")
