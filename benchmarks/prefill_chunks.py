"""Prefill time per prompt length and prefill chunk, with the runner's
padding: a prompt is padded to its bucket (``bucketing.PROMPT_BUCKETS``) and
scored in chunks, the chunks past it skipped, so the chunk sets how much
padding is computed.

  .venv/bin/python -m benchmarks.prefill_chunks --lengths 300,620,1100 \
      --chunks 128,256,512

For each length n, one row of n token ids (the ``longdoc`` set's first
prompt, repeated) runs ``engine.prefill_jit`` on the packed SmolLM2 at the
capacity the runner would pick for 96 new tokens; rounds interleave every
(n, chunk) pair; medians. One JSON line per length, then the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--lengths", default="300,620,1100")
  ap.add_argument("--chunks", default="128,256,512")
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)
  import jax
  import numpy as np
  from benchmarks.common import machine, text_ids
  from specjax.core import bucketing, engine
  from specjax.measure.bench import git_sha
  from specjax.models.registry import load_model
  model = load_model("smollm2-135m")
  lengths = [int(x) for x in args.lengths.split(",")]
  chunks = [int(x) for x in args.chunks.split(",")]

  def run(n, chunk):
    ids = text_ids(model.tokenizer, n)
    prompt, lens = bucketing.pad_prompts([ids])
    dcfg = engine.DecodeConfig(
        capacity=bucketing.capacity_for(prompt.shape[1], 96, extra=1),
        prefill_chunk=chunk)
    t0 = time.perf_counter()
    state = engine.prefill_jit(model.params, prompt, lens, jax.random.key(0),
                               np.int32(96), target=model.target, dcfg=dcfg)
    jax.block_until_ready(state.tokens)
    return time.perf_counter() - t0

  pairs = [(n, c) for n in lengths for c in chunks]
  for p in pairs:  # compile
    run(*p)
  times = {p: [] for p in pairs}
  for _ in range(args.repeats):
    for p in pairs:
      times[p].append(run(*p))
  for n in lengths:
    print(json.dumps({
        "prompt_tokens": n, "bucket": bucketing.bucket_length(n),
        "prefill_ms": {str(c): round(1e3 * statistics.median(times[n, c]), 1)
                       for c in chunks}}), flush=True)
  print(json.dumps({"machine": machine(), "git_sha": git_sha(),
                    "repeats": args.repeats}))


if __name__ == "__main__":
  main()
