"""Shared bits for benchmark scripts: provenance, timing, chat prompts."""

from __future__ import annotations

import json
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
  """The host as results name it: the CPU's model name (lscpu's line) and,
  since hosts sold under one name differ (AMD EPYC: Zen 3 with AVX2, Zen 5
  with AVX-512), its family/model and widest vector ISA; cores; jax."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      info = dict(l.split(":", 1) for l in f.read().split("\n\n")[0]
                  .splitlines() if ":" in l)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = set(info.get("flags", "").split())
    isa = ("avx512" if "avx512f" in flags else
           "avx2" if "avx2" in flags else "no avx2")
    cpu = (f"{info['model name']} (family {info.get('cpu family', '?')} "
           f"model {info.get('model', '?')}, {isa})")
  except (OSError, KeyError, ValueError):
    pass
  return (f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__} "
          f"({jax.default_backend()}), python {platform.python_version()}")


def emit(line: dict, path=None) -> None:
  """Prints one JSON line and, given a ``path``, appends it there."""
  text = json.dumps(line)
  print(text, flush=True)
  if path:
    with open(path, "a", encoding="utf-8") as f:
      f.write(text + "\n")


def timed(fn, *args):
  """Seconds for one call, blocking until device work is done."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def median(xs):
  return statistics.median(xs)


def text_ids(tokenizer, n: int) -> list[int]:
  """``n`` token ids of real text: the ``longdoc`` set's first prompt as a
  chat, repeated as often as it takes."""
  from specjax import data
  ids = tokenizer.encode_chat(data.load_prompts("longdoc", 1)[0])
  return (ids * -(-n // len(ids)))[:n]
