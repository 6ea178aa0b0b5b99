"""AR decoding per architecture: specjax next to transformers on the same
random weights, each model SmolLM2-135M's size (D 576, 30 layers, 9 query /
3 kv heads of 64, FFN 1536, vocab 49152) with its architecture's options.

  .venv/bin/python -m benchmarks.bench_architectures [--repeats 3]

Per architecture: transformers builds the model (random init, f32), saves
it, specjax loads the directory (``load_model``: the native CPU path where
it applies); both decode the same 4 prompts greedily to exactly 64 new
tokens at batch 1, interleaved repeat by repeat. Prints one JSON line per
architecture: tokens/s of each and their ratio, and whether the greedy
tokens agree (random weights: both are argmax over the same logits).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import numpy as np
import torch
import transformers

from benchmarks.common import machine, median, timed
from specjax.core import bucketing, engine
from specjax.kernels import native
from specjax.measure.bench import git_sha
from specjax.models.decoder import Decoder, pack_params
from specjax.models.hf_loader import load_hf

NEW = 64
SIZE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            head_dim=64, max_position_embeddings=2048, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
ARCHS = {
    "llama": lambda: transformers.LlamaConfig(**SIZE, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**SIZE, sliding_window=4096),
    "qwen2": lambda: transformers.Qwen2Config(**SIZE, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SIZE, tie_word_embeddings=True),
    "gemma2": lambda: transformers.Gemma2Config(
        **SIZE, query_pre_attn_scalar=64, sliding_window=4096,
        attn_implementation="eager"),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **SIZE, query_pre_attn_scalar=64, sliding_window=512),
    "phi3": lambda: transformers.Phi3Config(
        **{k: v for k, v in SIZE.items() if k != "head_dim"},
        original_max_position_embeddings=2048),
}
PROMPTS = [[int(t) for t in np.random.RandomState(i).randint(0, 49152, n)]
           for i, n in enumerate((24, 40, 56, 72))]


def run_arch(name: str, repeats: int) -> dict:
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(ARCHS[name]()).eval()
  with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(d)
    cfg, params = load_hf(d)
  if native.default_on(params.embed.dtype):
    params = pack_params(params)
  target = Decoder(cfg)
  calls = []
  for p in PROMPTS:
    prompt_BT, lengths = bucketing.pad_prompts([p])
    dcfg = engine.DecodeConfig(capacity=bucketing.capacity_for(
        prompt_BT.shape[1], NEW))
    calls.append(lambda pb=prompt_BT, l=lengths, dc=dcfg: engine.generate_jit(
        params, pb, l, jax.random.key(0), np.int32(NEW), target=target,
        dcfg=dc).tokens.block_until_ready())

  def ours():
    return [np.asarray(c()) for c in calls]

  def theirs():
    with torch.no_grad():
      return [hf.generate(torch.tensor([p]), do_sample=False,
                          max_new_tokens=NEW, min_new_tokens=NEW)[0].numpy()
              for p in PROMPTS]
  a, b = ours(), theirs()  # compile, warm up
  agree = [bool((x[0, len(p):len(p) + NEW] == y[len(p):]).all())
           for x, y, p in zip(a, b, PROMPTS)]
  t_ours, t_theirs = [], []
  for _ in range(repeats):
    t_ours.append(timed(ours))
    t_theirs.append(timed(theirs))
  tokens = NEW * len(PROMPTS)
  return dict(arch=name, specjax_tokens_per_s=round(tokens / median(t_ours), 1),
              transformers_tokens_per_s=round(tokens / median(t_theirs), 1),
              ratio=round(median(t_theirs) / median(t_ours), 2),
              greedy_agree=agree, layer_types=len(set(cfg.layer_types)) or 1,
              native=native.default_on(params.embed.dtype))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--archs", default=",".join(ARCHS))
  args = ap.parse_args(argv)
  torch.set_num_threads(max(1, torch.get_num_threads()))
  for name in args.archs.split(","):
    row = run_arch(name, args.repeats)
    row.update(git_sha=git_sha(), machine=machine(), new_tokens=NEW,
               batch=1, repeats=args.repeats)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
