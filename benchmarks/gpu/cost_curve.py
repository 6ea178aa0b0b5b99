"""Verify-cost curve on whatever device JAX runs on (a lent GPU).

  python -m benchmarks.gpu curve --out cost_curve.json
  python -m benchmarks.gpu curve --shapes tiny --repeats 5   # a CPU try

Times a target forward over T new tokens per row on top of a cached context
(T in {1, 2, 4, 8, 16}, batch {1, 8}, f32 and bf16) on SmolLM2-135M's shape
and an 8B Llama's, and the EAGLE-3 head's drafting (``EagleDrafter.propose``
at K = 1 and K = 7 on SmolLM2's head shape: their difference over 6 is one
head step). Weights are random: the time of a forward does not depend on
its values. The cache is donated and fed back, as in the decode loop, so a
forward writes its keys in place rather than copying the cache.

All programs are lowered first and compiled on a thread pool (XLA compiles
outside the GIL): 48 sequential compiles would take minutes of a 15-minute
lease. Each program's time is the median over ``repeats / 10`` windows of
10 back-to-back calls (dependent through the cache, like decode steps),
blocked once per window. The JSON is rewritten after every group, so a
command cut at its limit still returns what was measured; ``--seconds`` stops
starting new groups past a deadline and lists them under ``skipped``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import decoder
from specjax.models.config import ModelConfig

SHAPES = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, dim=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, ffn_dim=1536, rope_theta=100000.0, tie_embeddings=True),
    "llama-8b": ModelConfig(
        vocab_size=128256, dim=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=500000.0),
    "tiny": ModelConfig(
        vocab_size=512, dim=64, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, ffn_dim=128, tie_embeddings=True),
}
TOKENS = (1, 2, 4, 8, 16)
BATCHES = (1, 8)
DTYPES = ("float32", "bfloat16")
HEAD_K = (1, 7)
DRAFT_VOCAB = 16384
WINDOW = 10


def donated_forward(cfg: ModelConfig):
  """Jitted ``(params, tokens_BT, cache) -> (logits, cache)``: the cache
  donated and returned with its lengths unchanged, so calls fed their own
  output write in place like decode steps and always see the same context."""
  def fwd(params, tokens_BT, cache):
    out = decoder.forward(params, cfg, tokens_BT, cache)
    return out.logits, out.cache.with_lengths(cache.lengths)
  return jax.jit(fwd, donate_argnums=2)


def context_cache(cfg: ModelConfig, B: int, context: int, dtype=jnp.float32):
  """A cache of capacity ``2 * context`` holding ``context`` tokens a row."""
  return decoder.init_cache(cfg, B, 2 * context, dtype).with_lengths(
      jnp.full((B,), context, jnp.int32))


def forward_program(cfg: ModelConfig, params, B: int, T: int, context: int):
  """``(donated_forward, argument shapes)`` for ``params`` (shapes)."""
  cache = jax.eval_shape(
      lambda: context_cache(cfg, B, context, params.embed.dtype))
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
  return donated_forward(cfg), (params, tokens, cache)


def head_program(cfg: ModelConfig, B: int, K: int, dtype, context: int):
  """``(jitted propose, (params, state, tokens, num_tokens, key))``: an
  EAGLE-3 head drafting K tokens greedily after a verify of K + 1."""
  from specjax.core.sampling import SamplingParams
  from specjax.drafters.base import Context
  from specjax.drafters.eagle import EagleDrafter, EagleParams
  from specjax.heads import head_module
  from specjax.heads.base import HeadConfig
  hcfg = HeadConfig.for_target(cfg, min(DRAFT_VOCAB, cfg.vocab_size))
  drafter = EagleDrafter(hcfg)
  F = len(hcfg.taps) * cfg.dim

  def make():
    embed = jnp.zeros((cfg.vocab_size, cfg.dim), dtype)
    head = head_module(hcfg).init(
        jax.random.key(0), jnp.zeros((1, 4, F), dtype),
        jnp.zeros((1, 4), jnp.int32), embed, jnp.zeros((1, 4), jnp.int32)
    )["params"]
    params = EagleParams(jax.tree.map(lambda a: a.astype(dtype), head),
                         jnp.arange(hcfg.draft_vocab, dtype=jnp.int32), embed)
    prompt = Context(jnp.ones((B, context), jnp.int32),
                     jnp.full((B,), context, jnp.int32))
    state = drafter.init(params, prompt, 2 * context, K,
                         features=jnp.zeros((B, context, F), dtype))
    return params, state

  def propose(params, state, ctx, key):
    p = drafter.propose(params, state, ctx, key, K, SamplingParams())
    return p.tokens, p.state
  params, state = make()
  args = (params, state, Context(jnp.ones((B, 2 * context), jnp.int32),
                                 jnp.full((B,), context + 1, jnp.int32)),
          jax.random.key(1))
  return jax.jit(propose), args


def time_calls(call, repeats: int) -> dict:
  """Median and min milliseconds per call over windows of back-to-back
  calls; ``call()`` returns what to block on."""
  jax.block_until_ready(call())
  jax.block_until_ready(call())
  per = []
  for _ in range(max(repeats // WINDOW, 1)):
    t = time.perf_counter()
    for _ in range(WINDOW):
      out = call()
    jax.block_until_ready(out)
    per.append((time.perf_counter() - t) / WINDOW * 1e3)
  return dict(ms=round(float(np.median(per)), 4), ms_min=round(min(per), 4))


def compile_all(lowered: dict, workers: int) -> dict:
  """``{name: compiled}``, compiled on ``workers`` threads."""
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = {k: pool.submit(low.compile) for k, low in lowered.items()}
    return {k: f.result() for k, f in futures.items()}


def forward_group(shape: str, dtype: str, compiled: dict, batches, tokens,
                  context: int, repeats: int) -> list[dict]:
  """Times every compiled (batch, tokens) forward of one shape and dtype
  on one set of random weights."""
  cfg = SHAPES[shape]
  params = decoder.random_params(jax.random.key(0), cfg, dtype=jnp.dtype(dtype))
  rows = []
  for B in batches:
    holder = [context_cache(cfg, B, context, jnp.dtype(dtype))]
    for T in tokens:
      run = compiled[("fwd", shape, dtype, B, T)]
      tokens_BT = jnp.ones((B, T), jnp.int32)

      def call():
        logits, holder[0] = run(params, tokens_BT, holder[0])
        return logits
      rows.append(dict(shape=shape, dtype=dtype, batch=B, tokens=T,
                       **time_calls(call, repeats)))
  ones = {r["batch"]: r["ms"] for r in rows if r["tokens"] == 1}
  for r in rows:
    if r["batch"] in ones:
      r["ratio_to_1"] = round(r["ms"] / ones[r["batch"]], 3)
  return rows


def head_group(shape: str, dtype: str, compiled: dict, args: dict, batches,
               repeats: int) -> list[dict]:
  rows = []
  for B in batches:
    for K in HEAD_K:
      run, a = compiled[("head", dtype, B, K)], args[("head", dtype, B, K)]
      rows.append(dict(shape=shape, dtype=dtype, batch=B, k=K,
                       **time_calls(lambda: run(*a)[0], repeats)))
    k1, k7 = rows[-2]["ms"], rows[-1]["ms"]
    rows[-1]["step_ms"] = round((k7 - k1) / (HEAD_K[1] - HEAD_K[0]), 4)
  return rows


def measure(shapes, dtypes, out: pathlib.Path, *, batches=BATCHES,
            tokens=TOKENS, context: int = 512, repeats: int = 50,
            deadline: float = float("inf"), workers: int = 1) -> dict:
  """Lowers, compiles and times everything; writes ``out`` after each group."""
  t0 = time.time()
  result = dict(device=str(jax.devices()[0]), backend=jax.default_backend(),
                jax=jax.__version__, context=context, repeats=repeats,
                forward=[], head=[], skipped=[], seconds={})
  lowered, head_args = {}, {}
  for shape in shapes:
    for dtype in dtypes:
      params = jax.eval_shape(lambda: decoder.random_params(
          jax.random.key(0), SHAPES[shape], dtype=jnp.dtype(dtype)))
      for B in batches:
        for T in tokens:
          fn, a = forward_program(SHAPES[shape], params, B, T, context)
          lowered[("fwd", shape, dtype, B, T)] = fn.lower(*a)
  head_shape = "smollm2-135m" if "smollm2-135m" in shapes else shapes[0]
  for dtype in dtypes:
    for B in batches:
      for K in HEAD_K:
        fn, a = head_program(SHAPES[head_shape], B, K, jnp.dtype(dtype),
                             context)
        lowered[("head", dtype, B, K)] = fn.lower(*a)
        head_args[("head", dtype, B, K)] = a
  result["seconds"]["lower"] = round(time.time() - t0, 1)
  compiled = compile_all(lowered, workers)
  result["seconds"]["compile"] = round(time.time() - t0, 1)
  groups = [("forward", s, d) for s in shapes for d in dtypes]
  groups += [("head", head_shape, d) for d in dtypes]
  for kind, shape, dtype in groups:
    if time.time() > deadline:
      result["skipped"].append(f"{kind} {shape} {dtype}")
      continue
    if kind == "forward":
      result["forward"] += forward_group(shape, dtype, compiled, batches,
                                         tokens, context, repeats)
    else:
      result["head"] += head_group(shape, dtype, compiled, head_args,
                                   batches, repeats)
    result["seconds"]["total"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(result, indent=1))
  out.write_text(json.dumps(result, indent=1))
  return result


def predicted_speedups(curve: dict, alpha: float | None = None
                       ) -> list[dict]:
  """What the tuner's cost model (``theory.speedup``) predicts from a curve
  for an EAGLE-3 chain on the head's shape, per (dtype, batch): the speedup
  at K = 7 and the best K among those whose verify width K + 1 was timed.
  A step costs propose(1) + (K - 1) head steps + a forward over K + 1, in
  one-token forwards; ``alpha`` defaults to the shipped head's MT-bench
  T = 0 prior."""
  from specjax.measure import theory, tuner
  if alpha is None:
    alpha, _ = tuner.alpha_for("eagle3", "chat", 0.0)
  out = []
  for h in curve["head"]:
    if h["k"] != HEAD_K[1]:
      continue
    fwd = {r["tokens"]: r["ms"] for r in curve["forward"] if
           (r["shape"], r["dtype"], r["batch"]) ==
           (h["shape"], h["dtype"], h["batch"])}
    k1 = next(r["ms"] for r in curve["head"] if r["k"] == HEAD_K[0] and
              (r["dtype"], r["batch"]) == (h["dtype"], h["batch"]))
    if 1 not in fwd:
      continue
    c = max(h["step_ms"], 0.0) / fwd[1]
    verify = lambda k: (fwd[k + 1] + k1 - h["step_ms"]) / fwd[1]
    by_k = {t - 1: theory.speedup(alpha, t - 1, c, verify)
            for t in sorted(fwd) if t > 1}
    best = max(by_k, key=by_k.get)
    out.append(dict(shape=h["shape"], dtype=h["dtype"], batch=h["batch"],
                    alpha=round(alpha, 4), draft_step=round(c, 4),
                    speedup_k7=round(by_k[7], 3) if 7 in by_k else None,
                    best_k=best, best_speedup=round(by_k[best], 3)))
  return out


def pearl_predictions(curve: dict, alphas=(0.6, 0.7, 0.8), k: int = 4
                      ) -> list[dict]:
  """What the cost model predicts from a curve for SmolLM2-135M drafting
  for the 8B shape, per (dtype, batch, α): the plain chain at K - 1 and
  PEARL at K (``theory.pearl_steps``), both scoring K tokens a forward, on
  one device and, for PEARL, on two (the 135M's K one-token forwards
  beside the 8B's forward over K, ``step_speedup(overlap=True)``). Costs
  in the 8B's one-token forwards; empty unless both shapes were timed at
  1 and K tokens."""
  from specjax.measure import theory
  fwd = {}
  for r in curve["forward"]:
    fwd.setdefault((r["dtype"], r["batch"]), {})[r["shape"], r["tokens"]] = (
        r["ms"])
  out = []
  for (dtype, batch), ms in sorted(fwd.items()):
    need = [("llama-8b", 1), ("llama-8b", k), ("smollm2-135m", 1)]
    if not all(n in ms for n in need):
      continue
    unit = ms["llama-8b", 1]
    draft, verify = k * ms["smollm2-135m", 1] / unit, ms["llama-8b", k] / unit
    for alpha in alphas:
      steps = theory.pearl_steps(alpha, k)
      chain = theory.step_speedup(theory.expected_tokens(alpha, k - 1),
                                  verify, draft * (k - 1) / k)
      out.append(dict(
          dtype=dtype, batch=batch, alpha=alpha, k=k,
          draft=round(draft, 4), verify=round(verify, 4),
          chain_speedup=round(chain, 3),
          pearl_one_device=round(theory.step_speedup(
              steps.tokens, verify, draft), 3),
          pearl_two_devices=round(theory.step_speedup(
              steps.tokens, verify, draft, overlap=True), 3)))
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu curve",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="cost_curve.json")
  ap.add_argument("--shapes", default="smollm2-135m,llama-8b",
                  help=f"comma-separated, of {', '.join(SHAPES)}")
  ap.add_argument("--dtypes", default=",".join(DTYPES))
  ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
  ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
  ap.add_argument("--context", type=int, default=512,
                  help="cached tokens per row before the timed forward")
  ap.add_argument("--repeats", type=int, default=50)
  ap.add_argument("--seconds", type=float, default=240,
                  help="start no new group after this many seconds")
  ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
  args = ap.parse_args(argv)
  shapes = args.shapes.split(",")
  unknown = [s for s in shapes if s not in SHAPES]
  if unknown:
    ap.error(f"unknown shape {unknown[0]!r} (known: {', '.join(SHAPES)})")
  out = pathlib.Path(args.out)
  ints = lambda s: tuple(int(x) for x in s.split(","))
  result = measure(shapes, args.dtypes.split(","), out,
                   batches=ints(args.batches), tokens=ints(args.tokens),
                   context=args.context, repeats=args.repeats,
                   deadline=time.time() + args.seconds, workers=args.workers)
  print(json.dumps(dict(out=str(out), rows=len(result["forward"]),
                        head_rows=len(result["head"]),
                        skipped=result["skipped"],
                        seconds=result["seconds"])))
  return 0


if __name__ == "__main__":
  sys.exit(main())
