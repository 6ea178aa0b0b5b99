"""PEARL on two device groups against one device and AR, measured on
forced host devices, with the cost model's prediction for two real devices.

  .venv/bin/python -m benchmarks.bench_pearl --num-prompts 20 \
      layerskip:k=3:layers=24:pearl=1 ngram:k=5:pearl=1

Starts JAX on two forced host devices (``--xla_force_host_platform_device
_count=2``): on this CPU they share its cores, so "groups" measures
``shard_map``'s program with both halves, not two accelerators. Per prompt,
back to back: AR on one device, each spec on one device, each spec on
``pearl.make_mesh(data=1)`` (the drafter on device 0, the target on device
1), all on XLA's dot (the native kernels run on one device only), greedy.
Prints one JSON line per spec: tokens/s of each, speedups over AR, τ, the
steps in each mode, whether the outputs equal AR's, and ``bench``'s
prediction from the measured costs on one device (``predicted_one_device``,
``predicted_two_groups``: a step waits for the longer half).
"""

from __future__ import annotations

import argparse
import os


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("specs", nargs="+")
  ap.add_argument("--dataset", default="mtbench")
  ap.add_argument("--num-prompts", type=int, default=20)
  ap.add_argument("--max-new-tokens", type=int, default=96)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=2")

  from benchmarks.common import emit, machine
  from specjax import data
  from specjax.core import bucketing, pearl, runner
  from specjax.core.sampling import SamplingParams
  from specjax.core.sharding import on_mesh
  from specjax.drafters import methods
  from specjax.measure import bench
  from specjax.models.registry import load_model
  try:
    specs = [methods.MethodSpec.parse(s) for s in args.specs]
  except methods.MethodError as e:
    raise SystemExit(f"bench_pearl: {e}") from None
  if not all(s.pearl for s in specs):
    raise SystemExit("bench_pearl: every spec must set pearl=1")
  one = load_model("smollm2-135m", native=False)
  groups = on_mesh(one, pearl.make_mesh(data=1))
  prompts = data.load_prompts(args.dataset, args.num_prompts)
  chat = args.dataset != "humaneval"
  ids = [one.tokenizer.encode_chat(p) if chat else one.tokenizer.encode(p)
         for p in prompts]
  built = {s: (methods.build(one, s), methods.build(groups, s))
           for s in specs}
  kw = dict(max_new_tokens=args.max_new_tokens, sampling=SamplingParams())
  ar = bench.Tally()
  runs = {s: (bench.Tally(), bench.Tally()) for s in specs}
  for i, prompt in enumerate(ids):
    ar.add(runner.generate_ids(one, [prompt], **kw))
    for s, (m_one, m_groups) in built.items():
      runs[s][0].add(runner.generate_ids(one, [prompt], method=m_one, **kw))
      runs[s][1].add(runner.generate_ids(groups, [prompt], method=m_groups,
                                         **kw))
    print(f"prompt {i + 1}/{len(ids)}", flush=True)
  tok_s = lambda tally: tally.new_tokens / tally.wall_s
  ar_step_s = ar.wall_s / ar.steps
  for s, (on_one, on_groups) in runs.items():
    method = built[s][0]
    dcfg = runner.decode_config(
        one, bucketing.bucket_length(len(ids[0])),
        args.max_new_tokens, kw["sampling"], method)
    costs = bench.measure_costs(one, ids[:1], dcfg, method.params)
    rows = on_one.rows
    acc = bench.acceptance_stats(rows, s.k)
    line = dict(
        method=s.text(), dataset=args.dataset, num_prompts=len(ids),
        max_new_tokens=args.max_new_tokens, temperature=0.0,
        ar_tokens_per_s=round(tok_s(ar), 3),
        one_device_tokens_per_s=round(tok_s(on_one), 3),
        two_groups_tokens_per_s=round(tok_s(on_groups), 3),
        one_device_speedup=round(tok_s(on_one) / tok_s(ar), 4),
        two_groups_speedup=round(tok_s(on_groups) / tok_s(ar), 4),
        tau=round(acc["tau"], 4),
        pre_verify_steps=sum(r.pre_verify_steps for r in rows),
        post_verify_steps=sum(r.post_verify_steps for r in rows),
        greedy_identical_one_device=on_one.outputs == ar.outputs,
        greedy_identical_two_groups=on_groups.outputs == ar.outputs,
        predicted_one_device=round(costs.predicted_speedup(
            acc["tau"], ar_step_s), 4),
        predicted_two_groups=round(costs.predicted_speedup(
            acc["tau"], ar_step_s, overlap=True), 4),
        costs_ms=dict(draft=round(costs.draft * 1e3, 3),
                      verify_forward=round(costs.verify * 1e3, 3),
                      target_forward_1=round(costs.target_1 * 1e3, 3),
                      ar_step=round(ar_step_s * 1e3, 3)),
        matmul="xla", git_sha=bench.git_sha(), machine=machine())
    emit(line, args.json)


if __name__ == "__main__":
  main()
