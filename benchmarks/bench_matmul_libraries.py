"""The target's matmuls for a few rows: our kernel against maintained libraries.

  .venv/bin/python -m benchmarks.bench_matmul_libraries --rows 1,2,4,8,16

The CPU small-row matmul is chosen by measurement. Every
library multiplies the same M rows by all of SmolLM2-135M's matmul weights
(120 layer matrices and the LM head, 538 MB of f32), each in the layout it
prefers, with the machine's cores:

  native    ``specjax.kernels.small_gemm.small_matmul`` on packed panels (jitted);
  xla       XLA's dot, ``x @ W`` (jitted), the path it replaces;
  openblas  numpy's ``x @ W`` (numpy links the scipy-openblas build);
  mkl       torch's ``F.linear`` on ``[out, in]`` weights (MKL's sgemm);
  onednn    torch's oneDNN linear with weights reordered once at load
            (``torch.utils.mkldnn.to_mkldnn``), the packed-weight GEMM.

plus a jitted read of every weight once (the roofline). Per round each
library runs twice and the second call is timed (the first soaks up other
libraries' spinning threads); medians over rounds. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


import jax
import jax.numpy as jnp
import numpy as np
from benchmarks.bench_verify import programs, weights_KN
from benchmarks.common import machine, median
from specjax.kernels import native, small_gemm
from specjax.measure.bench import git_sha
from specjax.models.registry import load_model


def jax_calls(ws: list, M: int) -> dict:
  """The native and XLA programs of ``bench_verify.programs``."""
  progs = programs(ws, [small_gemm.pack(w) for w in ws], M)
  return {name: lambda fn=fn, a=a: jax.block_until_ready(fn(*a))
          for name, (fn, a) in progs.items() if name != "read"}


def library_calls(ws_np: list, M: int) -> dict:
  import torch
  torch.set_num_threads(os.cpu_count())
  xs = [np.ones((M, w.shape[0]), np.float32) for w in ws_np]
  calls = {"openblas": lambda: [x @ w for x, w in zip(xs, ws_np)]}
  linears = []
  for w in ws_np:
    lin = torch.nn.Linear(w.shape[0], w.shape[1], bias=False)
    lin.weight.data = torch.from_numpy(np.ascontiguousarray(w.T))
    linears.append(lin.eval())
  txs = [torch.from_numpy(x) for x in xs]

  def mkl():
    with torch.no_grad():
      return [lin(x) for lin, x in zip(linears, txs)]
  calls["mkl"] = mkl
  if torch.backends.mkldnn.is_available():
    from torch.utils import mkldnn
    packed = [mkldnn.to_mkldnn(lin) for lin in linears]

    def onednn():
      with torch.no_grad():
        return [lin(x.to_mkldnn()).to_dense() for lin, x in zip(packed, txs)]
    calls["onednn"] = onednn
  return calls


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", default="1,2,4,8,16")
  ap.add_argument("--repeats", type=int, default=7)
  args = ap.parse_args(argv)
  if not native.available():
    raise SystemExit("bench_matmul_libraries: the native kernel is not built")
  rows = [int(r) for r in args.rows.split(",")]
  ws = weights_KN(load_model("smollm2-135m", native=False).params)
  ws_np = [np.asarray(w) for w in ws]
  read = jax.jit(lambda ws: sum(jnp.sum(w) for w in ws))
  calls = {("read", 0): lambda: jax.block_until_ready(read(ws))}
  for M in rows:
    for name, call in {**jax_calls(ws, M), **library_calls(ws_np, M)}.items():
      call()
      calls[(name, M)] = call
  times = {k: [] for k in calls}
  for _ in range(args.repeats):
    for k, call in calls.items():
      call()
      start = time.perf_counter()
      call()
      times[k].append(time.perf_counter() - start)
  ms = {k: median(v) * 1e3 for k, v in times.items()}
  names = [n for n in ("native", "xla", "openblas", "mkl", "onednn")
           if (n, rows[0]) in ms]
  import torch
  print(json.dumps(dict(
      machine=machine(), git_sha=git_sha(), numpy=np.__version__,
      torch=torch.__version__, weight_mb=round(sum(w.nbytes
                                                   for w in ws_np) / 1e6, 1),
      read_ms=round(ms[("read", 0)], 2), matmuls=[dict(rows=M, **{
          n: dict(ms=round(ms[(n, M)], 2),
                  vs_read=round(ms[(n, M)] / ms[("read", 0)], 3))
          for n in names}) for M in rows])))
  return 0


if __name__ == "__main__":
  sys.exit(main())
