"""Shared bits for benchmark scripts: provenance, timing, chat prompts."""

from __future__ import annotations

import os
import platform
import statistics
import time

import jax

# Eight chat prompts of different lengths (benchmarks take the first B).
CHAT_PROMPTS = (
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clear emails to a busy manager.",
    "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Write a haiku about autumn leaves falling in the rain.",
    "How do I sort a list of dictionaries by a key in Python? Show code.",
    "Translate 'good morning, how are you?' into French and Spanish.",
)


def machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(l.split(":", 1)[1].strip() for l in f if "model name" in l)
  except (OSError, StopIteration):
    pass
  return (f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__} "
          f"({jax.default_backend()}), python {platform.python_version()}")


def timed(fn, *args):
  """Seconds for one call, blocking until device work is done."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def median(xs):
  return statistics.median(xs)
