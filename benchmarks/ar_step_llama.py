"""AR decode step and prefill: specjax (its default path) against llama.cpp on
an f32 copy of the same GGUF, one chat prompt, interleaved repeats.

  .venv/bin/python -m benchmarks.ar_step_llama   # needs the peers extra
  .venv/bin/python -m benchmarks.ar_step_llama --dataset longdoc  # 1st task

Each engine (``bench_peers``' AR calls) generates 1 and 129 tokens greedily
from the same token ids; step = (t(129) - t(1)) / 128, prefill ~ t(1). The
f32 copy is the one ``bench_peers.py --llama-f32`` writes. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from specjax import data


N = 129
PROMPT = ("Write a long, detailed essay about the history of the printing "
          "press in Europe.")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dataset", choices=("essay",) + data.DATASETS,
                  default="essay",
                  help="the prompt: the essay above, or a set's first")
  args = ap.parse_args()
  from benchmarks import bench_peers
  from benchmarks.common import machine
  from specjax import assets
  from specjax.measure import bench
  from specjax.models.registry import load_model
  model = load_model("smollm2-135m")
  ids = model.tokenizer.encode_chat(PROMPT if args.dataset == "essay" else
                                   data.load_prompts(args.dataset, 1)[0])
  f32 = bench_peers.dequantized_copy(
      assets.smollm2_gguf(), pathlib.Path.home() / ".cache" / "specjax" / "peers")
  # No EOS: every call runs its whole budget (checked below).
  calls = {(e, n): make(n)["ar"] for n in (1, N) for e, make in (
      ("specjax", lambda n: bench_peers.specjax_engine(model, [], n)),
      ("llama_f32", lambda n: bench_peers.llama_cpp_engine(
          f32, n, 1, eos_ids=set(), n_ctx=2048)))}

  def timed(key):
    tokens, seconds = calls[key](ids)
    if len(tokens) != key[1]:
      raise SystemExit(f"ar_step_llama: {key[0]} stopped after {len(tokens)} "
                       "tokens; pick a prompt with a longer answer")
    return seconds

  for key in calls:  # compile, warm up
    timed(key)
  t = {key: [] for key in calls}
  for _ in range(7):
    for key in calls:
      t[key].append(timed(key))
  m = {key: statistics.median(v) for key, v in t.items()}
  out = dict(prompt_tokens=len(ids), git_sha=bench.git_sha(), machine=machine())
  for e in ("specjax", "llama_f32"):
    out[f"{e}_prefill_ms"] = round(m[e, 1] * 1e3, 2)
    out[f"{e}_step_ms"] = round((m[e, N] - m[e, 1]) / (N - 1) * 1e3, 2)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
