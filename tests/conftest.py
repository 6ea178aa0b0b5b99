"""Shared fixtures: strict JAX numerics, tiny reference models, the real model."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def smollm2():
  """The real SmolLM2-135M-Instruct (f32), loaded once per test session."""
  from specjax.models.registry import load_model
  return load_model("smollm2-135m")
