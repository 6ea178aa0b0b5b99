"""GRPO-shaped rollouts: groups of samples per prompt, AR against each
speculative method, in one batch.

  .venv/bin/python -m benchmarks.rollouts --json benchmarks/results/rollouts.jsonl

For each dataset (MT-bench chat prompts, HumanEval code prompts) and each
sampling setting (T = 1; T = 0.7 with top-p 0.95): 8 prompts x 4 samples
(``generate_ids(num_samples=4)``, one batch of 32 rows, a key per row),
256 new tokens, AR and each method on the same rows. One JSON line per
(dataset, setting, method): tokens/s (compilation excluded), the ratio to
that setting's AR, τ (tokens per target forward), and the log-probs'
sum as a check that every row carries them.
"""

from __future__ import annotations

import argparse
import time

SETTINGS = {"t1": dict(temperature=1.0),
            "t0.7_p0.95": dict(temperature=0.7, top_p=0.95)}
METHODS = ("ar", "ngram:k=5", "ngram+retrieval:k=5", "eagle3:k=4:nodes=7")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval"])
  ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
  ap.add_argument("--methods", nargs="+", default=list(METHODS))
  ap.add_argument("--num-prompts", type=int, default=8)
  ap.add_argument("--num-samples", type=int, default=4)
  ap.add_argument("--max-new-tokens", type=int, default=256)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)

  from benchmarks.common import emit, machine
  from specjax import data
  from specjax.core import runner
  from specjax.core.sampling import SamplingParams
  from specjax.drafters import AR, methods
  from specjax.models.registry import load_model
  model = load_model("smollm2-135m")
  built = {m: AR if m == "ar" else methods.build(
      model, methods.MethodSpec.parse(m)) for m in args.methods}
  for dataset in args.datasets:
    prompts = data.load_prompts(dataset, args.num_prompts)
    ids = [model.tokenizer.encode(p) if dataset == "humaneval"
           else model.tokenizer.encode_chat(p) for p in prompts]
    for name in args.settings:
      sp = SamplingParams(**SETTINGS[name])
      ar_tok_s = None
      for m, method in built.items():
        res = runner.generate_ids(model, ids, max_new_tokens=args.max_new_tokens,
                                  sampling=sp, method=method,
                                  num_samples=args.num_samples, seed=0)
        tok_s = res.new_tokens / res.wall_s
        ar_tok_s = tok_s if m == "ar" else ar_tok_s
        forwards = sum(r.target_forwards for r in res.rows)
        line = dict(
            bench="rollouts", dataset=dataset, setting=name, method=m,
            rows=len(res.rows), new_tokens=res.new_tokens,
            wall_s=round(res.wall_s, 3), compile_s=round(res.compile_s, 1),
            tokens_per_s=round(tok_s, 2),
            speedup=None if ar_tok_s is None else round(tok_s / ar_tok_s, 3),
            tau=round((res.new_tokens - len(res.rows)) / max(forwards, 1), 3),
            logprob_sum=round(sum(sum(r.logprobs) for r in res.rows), 1),
            machine=machine(), when=time.strftime("%Y-%m-%d %H:%M"),
            **sp.record())
        emit(line, args.json)


if __name__ == "__main__":
  main()
