"""The many-row matmul of a prefill chunk against the cores' FMA peak: the
native kernel on packed panels and XLA's dot on plain weights, per weight
shape of SmolLM2 and row count.

  .venv/bin/python -m benchmarks.prefill_gemm --rows 64,128,256,512

Each program runs the product ``--iterations`` times in a ``fori_loop``
(rows scaled by the step, every output summed into the carry), so the output
buffer is XLA's own scratch, allocated once: a program that returns a fresh
output per call pages it in every call (100 MB for the LM head at 512 rows),
which times the kernel's allocator, not its arithmetic. Programs
interleaved, ``--repeats`` rounds. ``of_peak``: the median round's GFLOP/s
over the cores' FMA peak in the kernels' registers (``fma_peak``, measured
in the same run); ``best_of_peak``: the fastest round's (this VM's noise
takes a fifth off some rounds). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common import machine, timed
from benchmarks.fma_peak import peak_gflops
from specjax.kernels import native, small_gemm
from specjax.measure.bench import git_sha

# SmolLM2-135M's matrices as [K, N]: fused q/k/v, o, fused gate/up, down,
# the LM head.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072),
          "down": (1536, 576), "lm_head": (576, 49152)}


def looped(matmul, x_MK, iterations: int):
  """A jitted program running ``matmul`` ``iterations`` times."""
  def body(i, acc):
    scale = 1.0 + i.astype(jnp.float32) * 1e-3
    return acc + jnp.sum(matmul(x_MK * scale)) * 1e-9
  return jax.jit(lambda: lax.fori_loop(0, iterations, body, jnp.float32(0)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", default="64,128,256,512")
  ap.add_argument("--iterations", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=7)
  args = ap.parse_args(argv)
  if not native.available():
    raise SystemExit("prefill_gemm: the native kernel is not available")
  rng = np.random.default_rng(0)
  rows = [int(r) for r in args.rows.split(",")]
  calls, flop = {}, {}
  for name, (K, N) in SHAPES.items():
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.float32)
    packed = small_gemm.pack(w)
    for M in rows:
      x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
      for kind, mm in (("native", lambda x, p=packed, N=N:
                        small_gemm.small_matmul(x, p, N)),
                       ("xla", lambda x, w=w: x @ w)):
        fn = looped(mm, x, args.iterations)
        jax.block_until_ready(fn())
        calls[(name, M, kind)] = fn
      flop[(name, M)] = 2 * M * K * N * args.iterations
  times = {key: [] for key in calls}
  for _ in range(args.repeats):
    for key, call in calls.items():
      times[key].append(timed(call))
  peak = peak_gflops(native.isa())
  ms = {key: float(np.median(t)) * 1e3 for key, t in times.items()}
  best = {key: min(t) * 1e3 for key, t in times.items()}
  gflops = lambda key, ms=ms: flop[key[:2]] / ms[key] / 1e6
  print(json.dumps(dict(
      machine=machine(), git_sha=git_sha(), isa=native.isa(),
      fma_peak_gflops=round(peak, 1), gemm=[
          dict(shape=name, K=SHAPES[name][0], N=SHAPES[name][1], rows=M,
               **{kind: dict(ms=round(ms[(name, M, kind)] / args.iterations,
                                      3),
                             gflops=round(gflops((name, M, kind)), 1),
                             of_peak=round(gflops((name, M, kind)) / peak, 3),
                             best_of_peak=round(
                                 gflops((name, M, kind), best) / peak, 3))
                  for kind in ("native", "xla")})
          for name in SHAPES for M in rows])))
  return 0


if __name__ == "__main__":
  sys.exit(main())
