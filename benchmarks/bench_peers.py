"""specjax against its peers on one GGUF: greedy AR and each one's speculative method.

  .venv/bin/python -m benchmarks.bench_peers --dataset mtbench --llama-f32 \
      --json benchmarks/results/peers_mtbench80_t0.jsonl --journal runs/peers_mt.journal

Engines, each decoding every prompt greedily (T = 0), AR and speculative:
  specjax       AR and every --specjax spec (bench_methods.py's syntax).
  transformers  ``generate(do_sample=False)`` and prompt lookup
                (``prompt_lookup_num_tokens=--lookup``), torch on the CPU, f32
                weights dequantized from the GGUF (as specjax computes).
  llama.cpp     ``llama_cpp.Llama.generate`` greedy, and with
                ``LlamaPromptLookupDecoding(num_pred_tokens=--lookup)``, on the
                GGUF as it is (SmolLM2's: Q4_1 weights); with --llama-f32 also
                on a copy dequantized to f32 by llama.cpp's own quantizer (the
                weights the other two compute with).
A peer that is not installed (the ``peers`` extra) is skipped with one line.

All engines get the same token ids, one prompt at a time, and run back to back
on a prompt before the next (round robin), so machine noise hits them alike.
Tokens/s: new tokens over each call's wall time, prefill included, for every
engine alike (specjax's calls are compiled before they are timed). Prints and
appends one JSON line per (engine, method): tokens/s, that engine's AR tokens/s,
its speedup over its own AR, whether its outputs equal its own greedy AR's, and
``specjax_best_over_this`` (the fastest specjax row's tokens/s over this row's).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import sys
import time
from typing import Callable


Call = Callable[[list], tuple]  # prompt ids -> (new ids, seconds)
PEERS = ("transformers", "llama_cpp")


def installed(module: str) -> bool:
  return importlib.util.find_spec(module) is not None


def version(dist: str) -> str:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def specjax_engine(model, specs, max_new: int) -> dict[str, Call]:
  """AR and each bench_methods spec, by its text."""
  from specjax.core import runner
  from specjax.drafters import methods

  def call_for(text):
    spec = methods.MethodSpec.parse(text)
    method = methods.build(model, spec)

    def call(ids):
      res = runner.generate_ids(model, [ids], max_new_tokens=max_new,
                                method=method)
      return res.rows[0].output_ids, res.wall_s
    return call
  return {text: call_for(text) for text in ("ar", *specs)}


def transformers_engine(path: pathlib.Path, max_new: int, lookup: int,
                        eos_ids, pad_id) -> dict[str, Call]:
  import torch
  import transformers
  torch.set_num_threads(os.cpu_count())
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

  def call_for(**extra):
    def call(ids):
      x = torch.tensor([ids])
      start = time.perf_counter()
      with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x),
                          do_sample=False, max_new_tokens=max_new,
                          eos_token_id=list(eos_ids), pad_token_id=pad_id,
                          **extra)
      return out[0, len(ids):].tolist(), time.perf_counter() - start
    return call
  return {"ar": call_for(),
          f"prompt-lookup:k={lookup}": call_for(prompt_lookup_num_tokens=lookup)}


def llama_cpp_engine(path: pathlib.Path, max_new: int, lookup: int,
                     eos_ids, n_ctx: int) -> dict[str, Call]:
  import llama_cpp
  from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
  threads = os.cpu_count()

  def call_for(draft_model=None):
    # With a draft model, Llama keeps every position's logits but sizes that
    # buffer by ``logits_all`` (n_batch rows without it): a prompt past 512
    # tokens would overflow it (llama-cpp-python 0.3.36).
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads,
                          n_threads_batch=threads, draft_model=draft_model,
                          logits_all=draft_model is not None, verbose=False)

    def call(ids):
      llm.reset()  # no KV reuse from the previous call's common prefix
      out, start = [], time.perf_counter()
      for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                              repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if tok in eos_ids or len(out) >= max_new:
          break
      return out, time.perf_counter() - start
    return call
  return {"ar": call_for(),
          f"prompt-lookup:k={lookup}": call_for(
              LlamaPromptLookupDecoding(num_pred_tokens=lookup))}


def dequantized_copy(path: pathlib.Path, cache_dir: pathlib.Path) -> pathlib.Path:
  """``path`` rewritten with every tensor in f32 by llama.cpp's quantizer
  (kept in ``cache_dir``; written once)."""
  import llama_cpp
  out = cache_dir / f"{path.stem}-f32.gguf"
  if out.exists():
    return out
  cache_dir.mkdir(parents=True, exist_ok=True)
  params = llama_cpp.llama_model_quantize_default_params()
  params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
  params.allow_requantize = True
  params.nthread = os.cpu_count()
  tmp = out.with_suffix(".partial")
  rc = llama_cpp.llama_model_quantize(str(path).encode(), str(tmp).encode(),
                                      ctypes.byref(params))
  if rc != 0:
    raise SystemExit(f"bench_peers: error: llama.cpp could not write an f32 "
                     f"copy of {path} (rc {rc})")
  tmp.rename(out)
  return out


def stored_type(path: pathlib.Path) -> str:
  """The type most of a GGUF file's matrices are stored in (e.g. Q4_1)."""
  import collections
  import gguf
  kinds = collections.Counter(t.tensor_type.name
                              for t in gguf.GGUFReader(path).tensors
                              if len(t.shape) > 1)
  return kinds.most_common(1)[0][0]


def build_engines(args, model, path) -> list[tuple[str, dict, dict]]:
  """``[(engine name, provenance, {method: call})]``; peers not installed are
  skipped with one line each on stderr."""
  eos, pad = set(model.config.eos_ids), model.tokenizer.pad_id or 0
  engines = [("specjax", dict(version=version("specjax"), weights="f32"),
              specjax_engine(model, args.specjax, args.max_new_tokens))]
  for peer in args.peers:
    if not installed(peer):
      dist = "llama-cpp-python" if peer == "llama_cpp" else peer
      print(f"bench_peers: {peer} skipped: {dist} is not installed "
            f"(pip install -e '.[peers]')", file=sys.stderr)
      continue
    if peer == "transformers":
      engines.append(("transformers", dict(
          version=version("transformers"), torch=version("torch"),
          weights="f32"), transformers_engine(
              path, args.max_new_tokens, args.lookup, eos, pad)))
      continue
    files = [(path, f"{stored_type(path)} (as stored)")]
    if args.llama_f32:
      files.append((dequantized_copy(path, pathlib.Path(args.cache_dir)), "f32"))
    for file, weights in files:
      name = "llama.cpp" + ("-f32" if weights == "f32" else "")
      engines.append((name, dict(version=version("llama-cpp-python"),
                                 weights=weights, file=file.name),
                      llama_cpp_engine(file, args.max_new_tokens, args.lookup,
                                       eos, args.n_ctx)))
  return engines


def decode_all(engines, prompts, journal, key, partial: bool = False) -> dict:
  """``{(engine, method): [(ids, seconds) per prompt]}``, prompt by prompt,
  every engine's every method back to back; a journal's prompts are read back.
  ``partial``: only the journal's leading run of finished prompts, nothing
  decoded."""
  from tqdm import tqdm
  done = {}
  if journal and journal.exists():
    for line in journal.read_text().splitlines():
      row = json.loads(line)
      if row.get("key") == key:
        done[row["i"]] = row["runs"]
  runs = {(e, m): [] for e, _, calls in engines for m in calls}
  for i, ids in enumerate(tqdm(prompts, desc="peers", unit="prompt")):
    got = done.get(i)
    if got is None and partial:
      break
    if got is None:
      got = {f"{e}/{m}": call(ids) for e, _, calls in engines
             for m, call in calls.items()}
      if journal:
        with journal.open("a") as f:
          f.write(json.dumps(dict(key=key, i=i, runs=got)) + "\n")
    for (e, m), out in runs.items():
      tokens, seconds = got[f"{e}/{m}"]
      out.append((list(tokens), seconds))
  return runs


def summarize(engines, runs, common: dict) -> list[dict]:
  rows = []
  specjax_ar = [t for t, _ in runs[("specjax", "ar")]]
  for e, prov, calls in engines:
    ar = runs[(e, "ar")]
    tok_s = lambda r: sum(len(t) for t, _ in r) / sum(s for _, s in r)
    for m in calls:
      r = runs[(e, m)]
      same_as_own_ar = [a == b for (a, _), (b, _) in zip(ar, r)]
      same_as_specjax = [a == b for a, (b, _) in zip(specjax_ar, r)]
      rows.append(dict(
          benchmark="peers", engine=e, method=m, **prov,
          tokens_per_s=round(tok_s(r), 3), ar_tokens_per_s=round(tok_s(ar), 3),
          speedup_over_own_ar=round(tok_s(r) / tok_s(ar), 4),
          new_tokens=sum(len(t) for t, _ in r),
          equals_own_greedy=all(same_as_own_ar),
          rows_differing_from_own_greedy=same_as_own_ar.count(False),
          rows_equal_to_specjax_greedy=sum(same_as_specjax), **common))
  best = max((r for r in rows if r["engine"] == "specjax"),
             key=lambda r: r["tokens_per_s"])
  for r in rows:
    r["specjax_best"] = best["method"]
    r["specjax_best_over_this"] = round(best["tokens_per_s"] / r["tokens_per_s"], 4)
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m",
                  help="a known model name or a .gguf file (all engines read it)")
  ap.add_argument("--dataset", default="mtbench")
  ap.add_argument("--num-prompts", type=int, default=None)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--specjax", nargs="+",
                  default=["ngram:k=5", "eagle3:shape=0,1,2,0.0,0.1,1.0,0.0.0"],
                  help="specjax's speculative methods (bench_methods.py specs)")
  ap.add_argument("--peers", default="transformers,llama_cpp",
                  type=lambda s: [p for p in s.split(",") if p])
  ap.add_argument("--lookup", type=int, default=5,
                  help="the peers' prompt-lookup draft length")
  ap.add_argument("--llama-f32", action="store_true",
                  help="also run llama.cpp on an f32 copy of the GGUF")
  ap.add_argument("--cache-dir", default=str(pathlib.Path.home() / ".cache"
                                             / "specjax" / "peers"))
  ap.add_argument("--n-ctx", type=int, default=4096)
  ap.add_argument("--json", default=None)
  ap.add_argument("--journal", default=None,
                  help="finished prompts go here; a rerun resumes after them")
  ap.add_argument("--partial", action="store_true",
                  help="with --journal: report the prompts it holds (from "
                  "the first on, in order) and decode nothing")
  args = ap.parse_args(argv)
  if args.partial and not args.journal:
    ap.error("--partial reads a --journal")
  unknown = set(args.peers) - set(PEERS)
  if unknown:
    ap.error(f"unknown peer {sorted(unknown)[0]!r} (one of {', '.join(PEERS)})")
  for p in (args.json, args.journal):
    if p:
      pathlib.Path(p).parent.mkdir(parents=True, exist_ok=True)
      open(p, "a").close()

  from benchmarks.common import machine
  from specjax import data
  from specjax.measure import bench
  from specjax.models.registry import KNOWN_MODELS, load_model
  path = pathlib.Path(KNOWN_MODELS[args.model]() if args.model in KNOWN_MODELS
                      else args.model)
  model = load_model(args.model)
  chat = args.dataset != "humaneval"
  prompts = [model.tokenizer.encode_chat(p) if chat else model.tokenizer.encode(p)
             for p in data.load_prompts(args.dataset, args.num_prompts)]
  engines = build_engines(args, model, path)
  settings = dict(model=path.name, dataset=args.dataset,
                  num_prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                  lookup=args.lookup, temperature=0.0)
  key = hashlib.sha256(json.dumps(
      [settings, prompts, [(e, list(c)) for e, _, c in engines]]).encode()
  ).hexdigest()[:16]
  runs = decode_all(engines, prompts,
                    pathlib.Path(args.journal) if args.journal else None, key,
                    partial=args.partial)
  settings["num_prompts"] = len(runs[("specjax", "ar")])
  if not settings["num_prompts"]:
    raise SystemExit("bench_peers: error: the journal holds no finished "
                     "prompt of this benchmark")
  common = dict(settings, git_sha=bench.git_sha(), machine=machine())
  rows = summarize(engines, runs, common)
  for row in rows:
    line = json.dumps(row)
    print(line, flush=True)
    if args.json:
      with open(args.json, "a") as f:
        f.write(line + "\n")
  return rows


if __name__ == "__main__":
  main()
