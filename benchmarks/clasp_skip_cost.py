"""What CLaSp's skipped layers and its choice of them cost on this machine.

  .venv/bin/python -m benchmarks.clasp_skip_cost --skipped 0,6,10,15

One JSON line per M (layers skipped): the draft forward over K tokens with
M layers passed over by ``forward(skip=)`` (a ``lax.cond`` per layer), the
same forward with the first L - M layers as a static subset
(``forward(layers=)``, layer-skip's), the full forward, and CLaSp's dynamic
programme choosing M layers (``clasp.choose_skip``); medians of rounds in
which every call runs once, in turn. A skipped layer that costs nothing
puts the first two columns together, at about (L - M) / L of the full
forward plus the LM head.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--skipped", default="0,6,10,15")
  ap.add_argument("--tokens", type=int, default=3, help="K, the draft block")
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--rounds", type=int, default=9)
  args = ap.parse_args(argv)

  from benchmarks.common import machine
  from specjax.drafters.clasp import choose_skip
  from specjax.measure.bench import git_sha
  from specjax.models.registry import load_model
  model = load_model(args.model)
  target, params = model.target, model.params
  L, D = target.config.num_layers, target.config.dim
  cache = target.init_cache(params, 1, 2 * args.context).with_lengths(
      np.full((1,), args.context, np.int32))
  tokens = np.ones((1, args.tokens), np.int32)
  hidden = jax.random.normal(jax.random.key(0), (1, L + 1, D))
  last = jnp.zeros((1, 1), jnp.int32)
  skipping = jax.jit(lambda p, s: target.forward(
      p, tokens, cache, skip=s, write_cache=False,
      logit_positions_BP=last).logits)
  full = jax.jit(lambda p: target.forward(
      p, tokens, cache, write_cache=False, logit_positions_BP=last).logits)
  for M in map(int, args.skipped.split(",")):
    skip = jnp.asarray(np.arange(L) >= L - M)
    subset = jax.jit(lambda p, M=M: target.forward(
        p, tokens, cache.with_lengths(cache.lengths), layers=tuple(range(L - M)),
        write_cache=False, logit_positions_BP=last).logits) if M else full
    calls = {"skip": lambda: skipping(params, skip),
             "subset": lambda: subset(params),
             "full": lambda: full(params)}
    if M:
      choose = jax.jit(lambda p, h, c, M=M: choose_skip(target, p, h, c, M))
      calls["programme"] = lambda: choose(params, hidden, cache)
    times = {name: [] for name in calls}
    for call in calls.values():
      jax.block_until_ready(call())
    for _ in range(args.rounds):
      for name, call in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(call())
        times[name].append(time.perf_counter() - start)
    ms = {f"{name}_ms": round(float(np.median(t)) * 1e3, 3)
          for name, t in times.items()}
    print(json.dumps(dict(model=args.model, layers=L, skipped=M,
                          tokens=args.tokens, context=args.context, **ms,
                          skip_over_full=round(ms["skip_ms"] / ms["full_ms"],
                                               3),
                          git_sha=git_sha(), machine=machine())), flush=True)


if __name__ == "__main__":
  main()
