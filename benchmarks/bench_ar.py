"""AR decode speed on SmolLM2-135M: specjax vs transformers vs the roofline.

Run:  .venv/bin/python -m benchmarks.bench_ar [--repeats 5] [--out FILE]

All three are measured in the same process, interleaved repeat by repeat, and
reported as medians and ratios (this VM's timings drift by ~±20%):
  * specjax greedy, batch 1 and 8, exactly 128 new tokens (EOS ignored, like
    transformers' min_new_tokens), end-to-end tokens/s incl. prefill, and the
    decode step alone = (t(128 tokens) - t(1 token)) / 127;
  * transformers (torch CPU, f32 weights dequantized from the same GGUF),
    greedy generate with min_new_tokens = max_new_tokens = 128;
  * the memory-bandwidth roofline: one decode step must read every weight
    once (tied LM head included), so its floor is the time a jitted
    reduction takes to read a buffer of the same byte size.
Prints one JSON object; benchmarks/results/bench_ar.json keeps the last run.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import CHAT_PROMPTS, machine, median, timed
from specjax import assets
from specjax.core import bucketing, engine
from specjax.kernels import native
from specjax.measure.bench import git_sha
from specjax.models import decoder
from specjax.models.decoder import Decoder
from specjax.models.registry import load_model
from specjax.models.weights import num_params

NEW_TOKENS = 128


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--batch-sizes", default="1,8")
  ap.add_argument("--no-hf", action="store_true", help="skip transformers")
  ap.add_argument("--xla", action="store_true",
                  help="XLA's dot instead of the native CPU kernel")
  ap.add_argument("--out", default="benchmarks/results/bench_ar.json")
  args = ap.parse_args(argv)
  batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

  model = load_model("smollm2-135m", native=False)
  cfg, params = model.config, model.params
  prompts = [model.tokenizer.encode_chat(p) for p in CHAT_PROMPTS]

  weight_bytes = num_params(params) * params.embed.dtype.itemsize
  if not args.xla and native.default_on(params.embed.dtype):
    params = decoder.pack_params(params)  # after counting the plain weights
  matmul = "native" if decoder.is_packed(params) else "xla"
  buf = jnp.ones((weight_bytes // 4,), jnp.float32)
  read = jax.jit(jnp.sum)

  runs = {}
  for B in batch_sizes:
    prompt_BT, lengths = bucketing.pad_prompts(prompts[:B])
    dcfg = engine.DecodeConfig(
        capacity=bucketing.capacity_for(prompt_BT.shape[1], NEW_TOKENS))
    call = lambda n, p=prompt_BT, l=lengths, d=dcfg: engine.generate_jit(
        params, p, l, jax.random.key(0), np.int32(n), target=Decoder(cfg),
        dcfg=d).tokens
    call(1)  # compile (max_new_tokens is an array: one program for both)
    runs[B] = call

  hf = None
  if not args.no_hf:
    import torch
    import transformers
    path = assets.smollm2_gguf()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name)
    hf_tok.padding_side = "left"

    def hf_call(B):
      enc = hf_tok.pad({"input_ids": prompts[:B]}, return_tensors="pt")
      with torch.no_grad():
        return hf.generate(**enc, do_sample=False, max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS,
                           pad_token_id=model.tokenizer.pad_id)
    for B in batch_sizes:
      hf_call(B)  # warm-up

  t = {k: [] for k in ["read"] + [f"{kind}{B}" for B in batch_sizes
                                   for kind in ("full", "one", "hf")]}
  read(buf).block_until_ready()
  for _ in range(args.repeats):
    # Several reads per repeat: one 25 ms sample is too noisy to be a floor.
    t["read"] += [timed(read, buf) for _ in range(5)]
    for B in batch_sizes:
      t[f"full{B}"].append(timed(runs[B], NEW_TOKENS))
      t[f"one{B}"].append(timed(runs[B], 1))
      if hf is not None:
        t[f"hf{B}"].append(timed(hf_call, B))

  read_s = median(t["read"])
  result = dict(
      benchmark="ar_decode", model=cfg.name, new_tokens=NEW_TOKENS,
      dtype=str(params.embed.dtype), matmul=matmul, repeats=args.repeats,
      weight_bytes=weight_bytes, weight_read_ms=round(read_s * 1e3, 2),
      read_bandwidth_gb_s=round(weight_bytes / read_s / 1e9, 1),
      git_sha=git_sha(), machine=machine(), batches={})
  for B in batch_sizes:
    full, one = median(t[f"full{B}"]), median(t[f"one{B}"])
    step = (full - one) / (NEW_TOKENS - 1)
    row = dict(
        specjax_tokens_per_s=round(B * NEW_TOKENS / full, 2),
        specjax_step_ms=round(step * 1e3, 2),
        specjax_prefill_ms=round(one * 1e3, 1),
        roofline_tokens_per_s=round(B / read_s, 2),
        fraction_of_roofline=round(read_s / step, 3))
    if hf is not None:
      hf_s = median(t[f"hf{B}"])
      row.update(hf_tokens_per_s=round(B * NEW_TOKENS / hf_s, 2),
                 speedup_vs_hf=round(hf_s / full, 2))
    result["batches"][str(B)] = row
  print(json.dumps(result, indent=2))
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
  main()
