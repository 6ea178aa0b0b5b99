"""What an AR decode step costs as the context grows, and whether it follows
the tokens in the cache or the cache's capacity.

  .venv/bin/python -m benchmarks.decode_context --lengths 64,640,1216 \
      --capacities 1408,2048

For each prompt length n and capacity S (n + 129 new tokens must fit), one
row of n token ids (the ``longdoc`` set's first prompt, repeated) runs
``engine.generate`` on the packed SmolLM2 with no EOS, once for 1 new token
and once for 129: step = (t(129) - t(1)) / 128, prefill ~ t(1). The prompt
is padded to its own length rounded up to 64 (not the runner's bucket), so
only S and n move. Rounds interleave every (n, S) pair; medians. One JSON
line per pair, then the machine. ``--xla``: the plain weights and XLA's own
attention (``load_model(native=False)``, the path of GPUs and TPUs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

N = 129


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--lengths", default="64,640,1216")
  ap.add_argument("--capacities", default="1408,2048")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--xla", action="store_true",
                  help="plain weights, XLA's attention (no native kernels)")
  args = ap.parse_args(argv)
  import jax
  import numpy as np
  from benchmarks.common import machine, text_ids
  from specjax.core import engine
  from specjax.measure.bench import git_sha
  from specjax.models.registry import load_model
  model = load_model("smollm2-135m", native=False if args.xla else None)
  lengths = [int(x) for x in args.lengths.split(",")]
  caps = [int(x) for x in args.capacities.split(",")]
  pairs = [(n, s) for n in lengths for s in caps if n + N + 1 <= s]

  def run(n, s, new):
    ids = text_ids(model.tokenizer, n)
    padded = -(-n // 64) * 64
    prompt = np.zeros((1, padded), np.int32)
    prompt[0, :n] = ids
    dcfg = engine.DecodeConfig(capacity=s)
    t0 = time.perf_counter()
    out = engine.generate_jit(model.params, prompt, np.array([n], np.int32),
                              jax.random.key(0), np.int32(new),
                              target=model.target, dcfg=dcfg)
    got = int(jax.block_until_ready(out.num_tokens)[0]) - n
    if got != new:
      raise SystemExit(f"decode_context: {got} tokens instead of {new}")
    return time.perf_counter() - t0

  for n, s in pairs:  # compile and warm up both programs
    run(n, s, 1), run(n, s, N)
  times = {(p, new): [] for p in pairs for new in (1, N)}
  for _ in range(args.repeats):
    for p in pairs:
      for new in (1, N):
        times[p, new].append(run(*p, new))
  for n, s in pairs:
    one, many = (statistics.median(times[(n, s), new]) for new in (1, N))
    print(json.dumps({"prompt_tokens": n, "capacity": s, "xla": args.xla,
                      "prefill_ms": round(1e3 * one, 1),
                      "step_ms": round(1e3 * (many - one) / (N - 1), 2)}),
          flush=True)
  print(json.dumps({"machine": machine(), "git_sha": git_sha(),
                    "repeats": args.repeats}))


if __name__ == "__main__":
  main()
