"""Verify cost on this CPU: XLA's dot against the native small matmul.

  .venv/bin/python -m benchmarks.bench_verify --level forward --batch 1,8
  .venv/bin/python -m benchmarks.bench_verify --level matmul --rows 1,2,4,8,16

SmolLM2-135M's real weights (f32). ``forward``: ``specjax.forward`` over
T in {1, 2, 4, 8, 16} (``--tokens``) new tokens on top of 256 cached ones
per row, with the plain weights (XLA's dot) and with ``decoder.pack_params``
(the kernel), per batch size, and the weight read in the same rounds (``roofline``: the
read's time over the one-token step's, at the first batch size).
``matmul``: per row count M, three jitted programs:
every layer's four matmuls (fused q/k/v, o, fused gate/up, down: 120 for 30
layers) plus the LM head on independent inputs, once as XLA's ``x @ W`` and
once as ``small_gemm.small_matmul`` on packed weights, and a read of every
weight once (a sum: the weight-read roofline); ``of_peak``: the share of
the cores' FMA peak (``fma_peak``, in the kernels' register width) a
program reaches. Timed round-robin (one call
of each per round), median over rounds. Prints one JSON line: ms per
program and M, the ratio to M = 1, the machine and the kernels' instruction
set (``native.isa()``; ``SPECJAX_NATIVE_ISA=avx2`` runs the AVX2 variant on
an AVX-512 CPU).
"""

from __future__ import annotations

import argparse
import json
import sys


import jax
import jax.numpy as jnp
from benchmarks.common import machine, median, timed
from benchmarks.fma_peak import peak_gflops
from benchmarks.gpu.cost_curve import context_cache, donated_forward  # noqa: E501
from specjax.kernels import native, small_gemm
from specjax.measure.bench import git_sha
from specjax.models.registry import load_model


def weights_KN(params) -> list:
  """Every ``[in, out]`` matrix of a forward, the LM head's as ``[D, V]``."""
  ws = [w for lp in params.layers
        for w in (lp.wqkv, lp.wo, lp.w_gate_up, lp.w_down)]
  head = params.embed if params.lm_head is None else params.lm_head
  return ws + [head.T]


def weight_read(ws: list):
  """A jitted read of every weight once (a sum: the weight-read roofline)
  and its arguments."""
  return jax.jit(lambda ws: sum(jnp.sum(w) for w in ws)), (ws,)


def programs(ws: list, packed: list, M: int):
  """(xla, native, read) jitted callables and their arguments."""
  xs = [jnp.ones((M, w.shape[0]), jnp.float32) for w in ws]
  xla = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws)])
  nat = jax.jit(lambda xs, ps: [small_gemm.small_matmul(x, p, w.shape[1])
                                for x, p, w in zip(xs, ps, ws)])
  return {"xla": (xla, (xs, ws)), "native": (nat, (xs, packed)),
          "read": weight_read(ws)}


def forward_calls(model, batches, tokens, context: int = 256) -> dict:
  """``{(layout, B, T): call}``: one compiled forward per shape and layout
  (``gpu_cost_curve.donated_forward``: the cache fed back, written in
  place as in a decode loop)."""
  from specjax.models import decoder
  cfg = model.config
  layouts = {"xla": model.params, "native": decoder.pack_params(model.params)}
  fwd = donated_forward(cfg)
  calls = {}
  for B in batches:
    for name, params in layouts.items():
      holder = [context_cache(cfg, B, context)]
      for T in tokens:
        tok = jnp.ones((B, T), jnp.int32)

        def call(params=params, tok=tok, holder=holder):
          logits, holder[0] = fwd(params, tok, holder[0])
          return logits
        jax.block_until_ready(call())
        calls[(name, B, T)] = call
  return calls


def time_round_robin(calls: dict, repeats: int) -> dict:
  """Median ms of each call, one call of each per round."""
  times = {k: [] for k in calls}
  for _ in range(repeats):
    for k, call in calls.items():
      times[k].append(timed(call))
  return {k: median(v) * 1e3 for k, v in times.items()}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--level", choices=("forward", "matmul"), default="forward")
  ap.add_argument("--batch", default="1", help="forward: batch sizes")
  ap.add_argument("--rows", default="1,2,4,8,16", help="matmul: row counts")
  ap.add_argument("--tokens", default="1,2,4,8,16",
                  help="forward: new tokens per row (the first is the step "
                       "the others are compared with)")
  ap.add_argument("--repeats", type=int, default=9)
  args = ap.parse_args(argv)
  if not native.available():
    raise SystemExit("bench_verify: the native kernel is not available")
  model = load_model("smollm2-135m", native=False)
  ints = lambda s: [int(x) for x in s.split(",")]
  out = dict(machine=machine(), git_sha=git_sha(), level=args.level,
             isa=native.isa())
  if args.level == "forward":
    tokens = ints(args.tokens)
    calls = forward_calls(model, ints(args.batch), tokens)
    read, read_args = weight_read(weights_KN(model.params))
    calls["read"] = lambda: read(*read_args)
    ms = time_round_robin(calls, args.repeats)
    B1 = ints(args.batch)[0]
    out["read_ms"] = round(ms["read"], 2)
    out["roofline"] = {name: round(ms["read"] / ms[(name, B1, tokens[0])], 3)
                       for name in ("xla", "native")}
    out["forward"] = [dict(batch=B, tokens=T, **{
        name: dict(ms=round(ms[(name, B, T)], 2),
                   vs_t1=round(ms[(name, B, T)] / ms[(name, B, tokens[0])],
                               3))
        for name in ("xla", "native")}) for B in ints(args.batch)
        for T in tokens]
  else:
    out.update(matmuls(weights_KN(model.params), ints(args.rows),
                       args.repeats))
  print(json.dumps(out))
  return 0


def matmuls(ws: list, rows: list[int], repeats: int) -> dict:
  """The layer matmuls and LM head alone, and the weight read."""
  calls = {}
  packed = [small_gemm.pack(w) for w in ws]
  for M in rows:
    for name, (fn, a) in programs(ws, packed, M).items():
      if name == "read" and M != rows[0]:
        continue
      jax.block_until_ready(fn(*a))
      calls[(name, M)] = lambda fn=fn, a=a: fn(*a)
  ms = time_round_robin(calls, repeats)
  peak = peak_gflops(native.isa())
  nbytes = sum(w.size * 4 for w in ws)
  gflop = lambda M: 2 * M * sum(w.size for w in ws) / 1e9
  read_ms = ms[("read", rows[0])]
  return dict(weight_mb=round(nbytes / 1e6, 1), read_ms=round(read_ms, 2),
              read_gb_s=round(nbytes / read_ms / 1e6, 2),
              fma_peak_gflops=round(peak, 1), matmuls=[
                  dict(rows=M, **{name: dict(
                      ms=round(ms[(name, M)], 2),
                      vs_m1=round(ms[(name, M)] / ms[(name, rows[0])], 3),
                      vs_read=round(ms[(name, M)] / read_ms, 3),
                      of_peak=round(gflop(M) / ms[(name, M)] * 1e3 / peak, 3))
                      for name in ("xla", "native")}) for M in rows])


if __name__ == "__main__":
  sys.exit(main())
