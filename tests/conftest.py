"""Shared fixtures: strict JAX numerics, tiny reference models, the real model."""

import gc
import os
import pathlib

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")

# Compile-time flags for the tests (benchmarks and users run XLA's
# defaults; tests/test_optimized.py checks greedy identity there): XLA's own
# code at LLVM -O0 (the tiny-model tests, bound by compiling, take 20-25%
# less time; a few that run the real model's XLA ops longer take up to
# ~1.3x; the native kernels are built apart), and fusions emitted by XLA's
# elemental emitter instead of its MLIR fusion emitters (a third less time
# compiling a tiny model's generate program), and each program's LLVM module
# compiled whole rather than split for parallel codegen (the workers already
# use every core; ~7% less compile time; docs/DESIGN.md). Set before the
# backend starts, inherited by subprocesses; a flag given in XLA_FLAGS wins.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",
                  "--xla_cpu_use_fusion_emitters=false",
                  "--xla_cpu_parallel_codegen_split_count=1")
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given] + [f for f in TEST_XLA_FLAGS if f.split("=")[0] not in _given]
).strip()

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


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """After a module, if the process holds over a quarter of the memory
  mappings it may, every compiled program goes (``runner.clear_compiled``).
  Each holds hundreds of mappings of its code, a process may hold 65,530
  (Linux's default vm.max_map_count), and an xdist worker that kept every
  program of the suite reached it and crashed inside XLA; the busiest
  module adds ~35,000."""
  yield
  from specjax.core import runner
  if runner._mappings_held() > runner._mapping_limit() // 4:
    runner.clear_compiled()
    gc.collect()


@pytest.fixture(scope="session")
def smollm2():
  """The real SmolLM2-135M-Instruct (f32), loaded once per test session."""
  from specjax.models.registry import load_model
  return load_model("smollm2-135m")


def pytest_ignore_collect(collection_path, config):
  """``test_tunix.py`` needs Tunix, which only the long stage installs
  (``make test-long``): a fast run (``-m "not long"``) does not collect it;
  a long run without Tunix fails on its import, never skips it."""
  if (collection_path.name == "test_tunix.py"
      and "not long" in (config.getoption("markexpr") or "")):
    return True
  return None
