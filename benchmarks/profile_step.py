"""Where a speculative step's time goes: each piece of ``engine.step`` timed
alone at the step's own shapes, on a real state, against the whole step.

  .venv/bin/python -m benchmarks.profile_step eagle3:k=4:nodes=7 ngram:k=5

Each spec is a ``bench_methods`` spec. The state is the one after the
prefill and a few steps of the first MT-bench prompt (``--prompt``). Prints
one JSON line per spec: milliseconds per piece (medians of ``--repeats``),
their sum and the whole step's time; the gap is what XLA does differently
when the pieces run fused in one program (or dispatch cost).
"""

from __future__ import annotations

import argparse
import functools
import json


def pieces(model, dcfg, dparams, state):
  """``{name: (jitted fn, args)}`` of one step's stages (``engine.step``'s
  own functions), each fed the real outputs of the stage before (computed
  once, untimed)."""
  import jax
  from specjax.core import engine
  target = model.target
  live_B = ~state.done
  key = jax.random.key(1)
  out = {}
  sampler = state.sampler(dcfg, model.config.vocab_size)
  draft_fn = jax.jit(lambda p, s, sp, k: engine._draft(p, s, dcfg, sp, k))
  draft = draft_fn(dparams, state, sampler, key)
  out["draft"] = (draft_fn, (dparams, state, sampler, key))
  score = jax.jit(lambda p, c, d, l: engine._score(p, c, d, l, target=target,
                                                   dcfg=dcfg))
  fo, _ = score(model.params, state.cache, draft, live_B)
  out["verify_forward"] = (score, (model.params, state.cache, draft, live_B))
  verify = jax.jit(lambda s, d, lg, l, sp, k: engine._verify(
      s, d, lg, l, sp, k, dcfg))
  res, path, logprobs, _ = verify(state, draft, fo.logits, live_B, sampler,
                                  key)
  out["verify"] = (verify, (state, draft, fo.logits, live_B, sampler, key))
  if fo.new_kv is not None:  # AR's forward wrote its entry itself
    write = jax.jit(lambda c, kv, p: c.write(engine._on_path(kv, p),
                                             c.new_slots(dcfg.k + 1)))
    out["write_cache"] = (write, (state.cache, fo.new_kv, path))
  emit = jax.jit(lambda s, t, n, l, lp: engine._emit(s, t, n, l, dcfg, lp))
  out["emit"] = (emit, (state, res.tokens, res.num_emitted, live_B,
                        logprobs))
  step = jax.jit(functools.partial(engine.step, target=target, dcfg=dcfg))
  out["whole_step"] = (lambda p, s, d: step(p, s, drafter_params=d),
                       (model.params, state, dparams))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("specs", nargs="+")
  ap.add_argument("--prompt", type=int, default=0)
  ap.add_argument("--warm-steps", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=15)
  args = ap.parse_args(argv)

  import jax
  import numpy as np
  from benchmarks.common import machine
  from specjax import data
  from specjax.core import bucketing, engine
  from specjax.drafters import methods
  from specjax.measure import bench
  from specjax.models.registry import load_model
  model = load_model("smollm2-135m")
  prompt = data.load_prompts("mtbench", args.prompt + 1)[args.prompt]
  ids = model.tokenizer.encode_chat(prompt)
  for text in args.specs:
    spec = methods.MethodSpec.parse(text)
    method = methods.build(model, spec)
    dparams = method.params
    dcfg = engine.DecodeConfig(capacity=512, drafter=method.drafter,
                               num_draft=method.num_draft,
                               tree_nodes=method.tree_nodes)
    prompt_BT, lengths = bucketing.pad_prompts([ids], 0)
    state = engine.prefill_jit(model.params, prompt_BT, lengths,
                               jax.random.key(0), np.int32(10_000),
                               target=model.target, dcfg=dcfg,
                               drafter_params=dparams)
    for _ in range(args.warm_steps):
      state = engine.step_jit(model.params, state, target=model.target,
                              dcfg=dcfg, drafter_params=dparams)
    ms = {name: 1e3 * bench.median_time(functools.partial(fn, *fargs),
                                        args.repeats)
          for name, (fn, fargs) in pieces(model, dcfg, dparams,
                                          state).items()}
    whole = ms.pop("whole_step")
    print(json.dumps({"spec": text, "ms": {k: round(v, 2)
                                           for k, v in ms.items()},
                      "sum_ms": round(sum(ms.values()), 2),
                      "whole_step_ms": round(whole, 2),
                      "machine": machine()}), flush=True)


if __name__ == "__main__":
  main()
