"""Prefill on SmolLM2 per prompt length: time to first token of specjax's
packed weights and native kernels (its default), of its XLA path (plain
weights, XLA's dot and attention), and of llama.cpp on an f32 copy of the
same GGUF (``bench_peers --llama-f32``'s), all on the same token ids.

  .venv/bin/python -m benchmarks.prefill --lengths 64,256,1024,4096,8191

Each engine generates one token greedily from a prompt of random ids (the
prefill and its first sample: ``runner.generate_ids`` with
``max_new_tokens=1``, llama.cpp's ``generate`` up to its first token),
engines interleaved, median over ``--repeats`` after one untimed call.
``matmul_of_peak``: the prefill's matmul FLOPs (2 x the 106.2M weights of
the layers' matmuls x the prompt's tokens, and the LM head's 28.3M once, at
the last token; attention not counted) over the time, as a share of the
cores' FMA peak in the kernels' registers (``fma_peak``); a lower bound on
how busy the FMA units are. llama.cpp is
left out when ``llama_cpp`` is not installed (``make test-long`` builds it).
One JSON line per length, printed when it is measured; a length past the
model's context (the prompt and its one new token) is refused first.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import numpy as np


def llama_call(max_len: int):
  from benchmarks import bench_peers
  from specjax import assets
  try:
    import llama_cpp  # noqa: F401
  except ImportError:
    return None
  f32 = bench_peers.dequantized_copy(
      assets.smollm2_gguf(), pathlib.Path.home() / ".cache" / "specjax" / "peers")
  return bench_peers.llama_cpp_engine(f32, 1, 1, eos_ids=set(),
                                      n_ctx=max_len + 16)["ar"]


def matmul_weights(params) -> tuple[int, int]:
  """(weights every prompt token multiplies: the layers' matmuls, the LM
  head's weights, which only the last token multiplies)."""
  from benchmarks.bench_verify import weights_KN
  *layers, head = weights_KN(params)
  return sum(int(w.size) for w in layers), int(head.size)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--lengths", default="64,128,256,512,1024,2048,4096,8191")
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args(argv)
  from benchmarks.common import machine
  from benchmarks.fma_peak import peak_gflops
  from specjax.kernels import native
  from specjax.measure.bench import git_sha
  from specjax.models.registry import load_model
  lengths = [int(n) for n in args.lengths.split(",")]
  # The peak first, before any engine's threads exist.
  head = dict(machine=machine(), git_sha=git_sha(), isa=native.isa(),
              fma_peak_gflops=round(peak_gflops(native.isa()), 1))
  plain = load_model("smollm2-135m", native=False)
  context = plain.config.max_position
  if not all(0 < n < context for n in lengths):
    raise SystemExit(f"prefill: error: lengths must be in [1, {context - 1}] "
                     f"(the prompt and its one new token fit the context)")
  from benchmarks.bench_peers import specjax_engine
  engines = {"specjax": specjax_engine(load_model("smollm2-135m"), [], 1)["ar"],
             "specjax_xla": specjax_engine(plain, [], 1)["ar"]}
  llama = llama_call(max(lengths))
  if llama is not None:
    engines["llama_f32"] = llama
  per_token, head_weights = matmul_weights(plain.params)
  rng = np.random.default_rng(0)
  for n in lengths:
    ids = rng.integers(100, plain.config.vocab_size, n).tolist()
    times = {e: [] for e in engines}
    for rep in range(args.repeats + 1):
      for e, call in engines.items():
        out, seconds = call(ids)
        if len(out) != 1:
          raise SystemExit(f"prefill: {e} gave {len(out)} tokens, not 1")
        if rep:
          times[e].append(seconds)
    ms = {e: statistics.median(t) * 1e3 for e, t in times.items()}
    flop = 2 * (per_token * n + head_weights)
    print(json.dumps(dict(head, tokens=n, **{e: dict(
        ms=round(t, 1), tokens_per_s=round(n / t * 1e3, 1),
        matmul_of_peak=round(flop / t / 1e6 / head["fma_peak_gflops"], 3))
        for e, t in ms.items()})), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
