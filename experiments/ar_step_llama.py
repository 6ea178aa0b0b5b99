"""AR decode step and prefill: specjax (its default path) against llama.cpp on
an f32 copy of the same GGUF, one chat prompt, interleaved repeats.

  .venv/bin/python experiments/ar_step_llama.py   # needs the peers extra

Each engine generates 1 and 129 tokens greedily from the same token ids;
step = (t(129) - t(1)) / 128, prefill ~ t(1). The f32 copy is the one
bench_peers.py --llama-f32 writes. Prints one JSON line.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

N = 129
PROMPT = ("Write a long, detailed essay about the history of the printing "
          "press in Europe.")


def main():
  import llama_cpp
  from experiments.bench_peers import dequantized_copy
  from experiments.common import machine
  from specjax import assets, bench, runner
  from specjax.models.registry import load_model
  model = load_model("smollm2-135m")
  ids = model.tokenizer.encode_chat(PROMPT)
  f32 = dequantized_copy(assets.smollm2_gguf(),
                         pathlib.Path.home() / ".cache" / "specjax" / "peers")
  llm = llama_cpp.Llama(str(f32), n_ctx=1024, n_threads=2, n_threads_batch=2,
                        verbose=False)

  def specjax_s(n):
    r = runner.generate_ids(model, [ids], max_new_tokens=n)
    if len(r.rows[0].output_ids) != n:
      raise SystemExit("ar_step_llama: the answer stopped early")
    return r.wall_s

  def llama_s(n):
    llm.reset()
    start, k = time.perf_counter(), 0
    for _ in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
      k += 1
      if k >= n:
        break
    return time.perf_counter() - start

  runs = {"specjax": specjax_s, "llama_f32": llama_s}
  for f in runs.values():  # compile, warm up
    f(1), f(N)
  t = {(e, n): [] for e in runs for n in (1, N)}
  for _ in range(7):
    for e, f in runs.items():
      for n in (1, N):
        t[e, n].append(f(n))
  m = {k: statistics.median(v) for k, v in t.items()}
  out = dict(prompt_tokens=len(ids), git_sha=bench.git_sha(), machine=machine())
  for e in runs:
    out[f"{e}_prefill_ms"] = round(m[e, 1] * 1e3, 2)
    out[f"{e}_step_ms"] = round((m[e, N] - m[e, 1]) / (N - 1) * 1e3, 2)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
