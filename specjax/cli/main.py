"""``specjax`` command line: ``generate``, ``bench``, ``tune`` and ``demo``.

Bad input never produces a traceback: it prints one line naming the problem
to stderr and exits with status 2 (``UsageError``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import textwrap
import time
import warnings

import jinja2
from typing import Optional, Sequence

from specjax.core.runner import DoesNotFit
from specjax.drafters.methods import KNOBS, METHODS, knobs_of

EXIT_USAGE = 2
EXIT_NONFINITE = 1  # the model's logits turned NaN or inf (output kept)


class UsageError(Exception):
  """Bad user input; printed as one line, exit status 2."""


class _Formatter(argparse.HelpFormatter):
  """argparse's help, never breaking a line inside a flag's name."""

  def _split_lines(self, text, width):
    return textwrap.wrap(" ".join(text.split()), width,
                         break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
  def __init__(self, *args, **kw):
    super().__init__(*args, formatter_class=_Formatter, **kw)

  def error(self, message):  # argparse prints usage + message; we want one line
    raise UsageError(message)


def _build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="specjax", description=__doc__.splitlines()[0])
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

  g = sub.add_parser("generate", help="generate text for one or more prompts")
  _add_model_args(g)
  src = g.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="prompt text")
  src.add_argument("--prompt-file",
                   help='JSONL file, one {"prompt": ...} object per line')
  g.add_argument("--max-new-tokens", type=int, default=128)
  g.add_argument("--min-new-tokens", type=int, default=0,
                 help="tokens generated before an EOS or a --stop can end a "
                 "reply (its EOS is masked until then)")
  g.add_argument("--num-samples", type=int, default=1, metavar="N",
                 help="N completions per prompt, each from its own key "
                 "(seed, prompt, sample): a group for RL; with --json, "
                 "each row says its sample")
  g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                 help="end a reply where the tokens of TEXT are generated "
                 "(kept in it, like an EOS); repeatable")
  _add_sampling_args(g)
  g.add_argument("--batch-size", type=int, default=8)
  g.add_argument("--no-chat-template", action="store_true",
                 help="feed the prompt text as is")
  g.add_argument("--json", action="store_true",
                 help="print one JSON object per prompt")
  g.add_argument("--stream", action=argparse.BooleanOptionalAction,
                 default=None, help="print text as it is generated, one "
                 "prompt at a time (default: when printing text to a "
                 "terminal)")

  b = sub.add_parser("bench", help="speculative vs AR on a dataset, one run")
  _add_model_args(b, several=True)
  b.add_argument("--dataset", default="mtbench",
                 help="mtbench, humaneval, sharegpt, longdoc (tasks over long "
                      "passages) or a FILE.jsonl")
  b.add_argument("--num-prompts", type=int, default=None,
                 help="first N prompts (default: all)")
  b.add_argument("--max-new-tokens", type=int, default=128)
  _add_sampling_args(b)
  b.add_argument("--batch-size", type=int, default=1)
  b.add_argument("--repeats", type=int, default=1,
                 help="timed passes over the prompts (median speedup)")
  b.add_argument("--json", metavar="OUT",
                 help="also append one JSON line per method to OUT")
  b.add_argument("--journal", metavar="FILE",
                 help="keep each finished batch in FILE; rerunning the same "
                      "command resumes after the last one")

  t = sub.add_parser("tune", help="recommend a method and K for a workload")
  t.add_argument("--model", default="smollm2-135m",
                 help="known name (smollm2-135m), a .gguf file or an HF dir")
  t.add_argument("--batch-size", type=int, default=1)
  t.add_argument("--task", default="chat",
                 help="chat, code, summarize or creative")
  t.add_argument("--temperature", type=float, default=0.0)
  t.add_argument("--latency-target", type=float, default=None,
                 help="wanted milliseconds per token per row")
  t.add_argument("--prompt-tokens", type=int, default=0,
                 help="a request's prompt length: time its prefill (the "
                      "time to first token) and count it in the speedup")
  t.add_argument("--new-tokens", type=int, default=256,
                 help="a request's new tokens (with --prompt-tokens)")
  t.add_argument("--json", action="store_true", help="print JSON")

  tr = sub.add_parser(
      "train", help="train an EAGLE-3 head (resumable)",
      epilog="Any field of the config can be set after it by its dotted "
      "path, typed by the field: --config.steps=200 --config.optim.lr=1e-4 "
      "--config.head.init_head=DIR (ml_collections' config flags). The "
      "fields: specjax/training/config.py.")
  tr.add_argument("--config", required=True, metavar="FILE[:ARG]",
                  help="an ml_collections config file: its get_config() "
                  "(or get_config(ARG)) returns the run's ConfigDict")
  tr.add_argument("--sweep", action="store_true",
                  help="run each point of the file's get_sweep() in turn, "
                  "each in WORKDIR/NAME of the point (resumable)")
  tr.add_argument("--workdir", required=True,
                  help="checkpoints, metrics.jsonl; rerun to resume")
  tr.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                  help="stop at this step (the schedule still spans all "
                  "steps); rerun without it to go on")
  tr.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                  help="stop after the first step that ends this long after "
                  "the start, with a checkpoint there; rerun to go on")
  tr.add_argument("--allow-config-change", action="store_true",
                  help="resume although the config differs from the one the "
                  "run started with (WORKDIR/config.json); the change is "
                  "recorded in WORKDIR/provenance.jsonl")

  for sp in (g, b, tr):
    sp.add_argument("--distributed", default=None, metavar="auto|HOST:PORT,N,I",
                    help="one of N processes (hosts) of one run: 'auto' "
                    "detects TPU pods, SLURM, Open MPI, Kubernetes; else the "
                    "coordinator's address, N and this process's index. "
                    "--mesh / --config.mesh= then span every process's "
                    "devices; "
                    "process 0 prints and writes the results")

  e = sub.add_parser("export-head", help="write an EAGLE-3 head in the "
                     "SpecForge/SGLang or vLLM speculators layout, an MTP "
                     "module in DeepSeek-V3's, Qwen3.5's or speculators'")
  e.add_argument("head", help="a specjax head file (.npz)")
  e.add_argument("--format", required=True,
                 choices=("specforge", "speculators", "deepseek", "qwen3.5"),
                 help="EAGLE-3: specforge (SafeAILab/SpecForge/SGLang, "
                 "midlayer.*) or speculators (vLLM's, layers.0.*); MTP: "
                 "deepseek (model.layers.L.*), qwen3.5 (mtp.*) or "
                 "speculators (mtp_layers.0.*)")
  e.add_argument("--out", required=True, help="the directory to write")
  e.add_argument("--target-name", default="",
                 help="the target's name or path, for the speculators "
                 "verifier entry")

  d = sub.add_parser("demo", help="SmolLM2 decoding demo (the README's main job)")
  d.add_argument("--max-new-tokens", type=int, default=96)
  return p


def _add_model_args(p, several: bool = False):
  p.add_argument("--model", default="smollm2-135m",
                 help="known name (smollm2-135m), a .gguf file or an HF dir")
  p.add_argument("--method", action="append" if several else None,
                 default=None if several else "ar",
                 metavar="NAME[:key=value...]",
                 help="a method and the knobs it reads: "
                 + "; ".join(f"{m}" + (f" ({', '.join(knobs_of(m))})"
                                       if knobs_of(m) else "")
                             for m in METHODS)
                 + "; e.g. eagle3:k=5:shape=2x2x1. The flags below set the "
                 "knobs a method does not set itself ("
                 + ", ".join(f"{k}: {_FLAGS[f]}" for k, f in KNOBS.items()
                             if f in _FLAGS) + ")"
                 + ("; repeat it or separate methods by commas to compare "
                    "several (default ngram)" if several else
                    " (default ar)"))
  p.add_argument("--num-draft", type=int, default=None,
                 help="K, drafts per verify step (speculative methods; "
                 "default 4)")
  p.add_argument("--tree-nodes", type=int, default=0,
                 help="draft trees of up to this many nodes, --num-draft "
                 "deep, verified in one forward (ngram, retrieval, eagle, "
                 "eagle3, mtp; 0 = chains)")
  p.add_argument("--tree-width", type=int, default=4,
                 help="trees: n-gram matches merged, or EAGLE's top-k per "
                 "node")
  p.add_argument("--tree-shape", default="",
                 help="eagle, eagle3, mtp, medusa: a static tree (for EAGLE "
                 "instead of a dynamic one), as children per depth (2x2x1) "
                 "or rank paths (0,1,0.0; `specjax tune` proposes one); sets "
                 "--tree-nodes and --num-draft")
  p.add_argument("--lookup-nodes", type=int, default=0,
                 help="eagle, eagle3, mtp, medusa trees: merge this many nodes of "
                 "the n-gram/retrieval trie into the head's tree (counted in "
                 "--tree-nodes; with --tree-shape, added to its nodes, and "
                 "--num-draft bounds the trie's depth)")
  p.add_argument("--layers", type=int, default=None,
                 help="layer-skip: target layers the drafter runs "
                 "(default 80%% of them)")
  p.add_argument("--min-confidence", type=float, default=0.0,
                 help="dynamic K (draft, layerskip, eagle, eagle3, mtp, medusa): stop "
                 "drafting a row when the draft's top probability falls "
                 "below this")
  p.add_argument("--draft-model", default=None,
                 help="--method draft: the draft model (.gguf or HF dir)")
  p.add_argument("--head", default=None,
                 help="--method eagle, eagle3, mtp, medusa: a head file or "
                 "directory (default: the shipped one)")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="weights and KV cache (default: float32 on a CPU, "
                 "bfloat16 on GPUs/TPUs); logits and verification stay f32")
  p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                 help="decode over a device mesh: rows split over D devices, "
                 "the target tensor-parallel over M (D x M = the device "
                 "count; on a CPU, XLA_FLAGS="
                 "--xla_force_host_platform_device_count=N makes N)")


def _add_sampling_args(p):
  p.add_argument("--temperature", type=float, default=0.0,
                 help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--min-p", type=float, default=0.0,
                 help="keep tokens at least this fraction as likely as the "
                 "most likely one (after top-p); 0 = off")
  p.add_argument("--repetition-penalty", type=float, default=1.0,
                 help="divide positive logits (multiply negative ones) of "
                 "tokens in the prompt or output by this; 1 = off")
  p.add_argument("--presence-penalty", type=float, default=0.0,
                 help="subtract from the logits of tokens already generated; "
                 "0 = off")
  p.add_argument("--frequency-penalty", type=float, default=0.0,
                 help="subtract this per time a token was generated; 0 = off")
  p.add_argument("--logit-bias", action="append", default=[],
                 metavar="ID=BIAS", help="add BIAS to token ID's logit "
                 "(repeatable)")
  p.add_argument("--seed", type=int, default=0)


# Each flag that sets a MethodSpec field, by the field.
_FLAGS = {"num_draft": "--num-draft", "tree_nodes": "--tree-nodes",
          "tree_width": "--tree-width", "tree_shape": "--tree-shape",
          "lookup_nodes": "--lookup-nodes", "layers": "--layers",
          "min_confidence": "--min-confidence", "draft_model": "--draft-model",
          "head": "--head"}


def _method_texts(args) -> list[str]:
  """The methods ``--method`` names (once, repeated or comma-separated)."""
  given = args.method or ["ngram"]
  items = [given] if isinstance(given, str) else given
  return [m.strip() for item in items for m in item.split(",")]


def _method_specs(args) -> list:
  from specjax.drafters.methods import (MethodError, MethodSpec, parse_knobs,
                                        readers)
  texts = _method_texts(args)
  try:
    parsed = [parse_knobs(t) for t in texts]
  except MethodError as e:
    raise UsageError(str(e)) from None
  names = {name for name, _ in parsed}
  for field in ("head", "draft_model", "layers", "num_draft", "tree_nodes"):
    if _flag_given(args, field) and not names & readers(field):
      raise UsageError(f"{_FLAGS[field]} is for --method "
                       f"{', '.join(sorted(readers(field)))}; --method "
                       f"{','.join(texts)} would ignore it")
  flags = dict(num_draft=4 if args.num_draft is None else args.num_draft,
               tree_nodes=args.tree_nodes, tree_width=args.tree_width,
               tree_shape=args.tree_shape, lookup_nodes=args.lookup_nodes,
               layers=args.layers, min_confidence=args.min_confidence,
               draft_model=args.draft_model, head=args.head)
  specs = []
  for text, (name, knobs) in zip(texts, parsed):
    for field in knobs:
      if _flag_given(args, field):
        raise UsageError(f"{_FLAGS[field]} and --method {text!r} both set "
                         f"{field}; give it once")
    try:
      specs.append(MethodSpec(name=name, **{**flags, **knobs}))
    except (ValueError, TypeError) as e:
      raise UsageError(_flagged(str(e))) from None
  return specs


def _flag_given(args, field: str) -> bool:
  """Whether the flag for the ``MethodSpec`` field ``field`` was set (to
  other than the field's default; --num-draft's own default is None). A
  field the method grammar alone sets has no flag."""
  from specjax.drafters.methods import MethodSpec
  if field not in _FLAGS:
    return False
  if field == "num_draft":
    return args.num_draft is not None
  return getattr(args, field) != getattr(MethodSpec, field)


def _flagged(message: str) -> str:
  """A library message with each ``MethodSpec`` field it names written as
  the CLI's flag for it."""
  for field, flag in _FLAGS.items():
    if "_" in field:  # "head", "layers" are words too
      message = re.sub(rf"\b{field}\b", flag, message)
  return message


def _build(model, spec):
  from specjax.assets import AssetError
  from specjax.drafters import methods
  from specjax.models.weights import WeightError
  try:
    return methods.build(model, spec)
  except (methods.MethodError, AssetError, WeightError, OSError) as e:
    raise UsageError(_flagged(str(e))) from None


def _check_common(args):
  if args.max_new_tokens < 1:
    raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  if args.batch_size < 1:
    raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
  if not 0 <= args.seed < 2**63:
    raise UsageError(f"--seed must be in [0, 2**63), got {args.seed}")


def _ends(args, model) -> dict:
  """``generate_ids``' ``min_new_tokens`` and ``stop`` (each --stop text's
  token ids, no BOS) from the flags."""
  if not 0 <= args.min_new_tokens <= args.max_new_tokens:
    raise UsageError(f"--min-new-tokens must be in [0, --max-new-tokens], "
                     f"got {args.min_new_tokens}")
  stop = [model.tokenizer.encode(text, add_special_tokens=False)
          for text in args.stop]
  for text, seq in zip(args.stop, stop):
    if not seq:
      raise UsageError(f"--stop {text!r} encodes to no tokens")
  return dict(min_new_tokens=args.min_new_tokens, stop=stop)


def _check_fits(model, ids, max_new_tokens: int, specs, sampling) -> None:
  """Each prompt and its new tokens fit the context, and so does the
  widest verify block (``runner.check_context``); the logit bias names
  tokens of the vocabulary; worded with the flags."""
  from specjax.core import runner
  try:
    sampling.check_vocab(model.config.vocab_size)
  except ValueError as e:
    raise UsageError(f"--logit-bias: {e}") from None
  widest = max(specs, key=lambda s: s.block)
  try:
    runner.check_context(model, [len(p) for p in ids], max_new_tokens,
                         widest.block)
  except runner.ContextError as e:
    if e.block > e.context:
      knob = (f"--tree-nodes {widest.tree_nodes}" if widest.tree_nodes
              else f"--num-draft {widest.k}")
      raise UsageError(f"{knob} is too large: a verify block of {e.block} "
                       f"is wider than the model's context of "
                       f"{e.context}") from None
    raise UsageError(f"prompt {e.index + 1} is {e.length} tokens; with "
                     f"--max-new-tokens {max_new_tokens} it exceeds the "
                     f"model's context of {e.context}") from None


def _read_prompts(args) -> list[str]:
  from specjax import data
  try:
    if args.prompt is not None:
      if not args.prompt.strip():
        raise UsageError("empty prompt")
      return [data.check_text(args.prompt, "--prompt")]
    return data.prompts_from_jsonl(args.prompt_file)
  except data.DataError as e:
    raise UsageError(str(e)) from None


def _logit_bias(items) -> tuple[tuple[int, float], ...]:
  pairs = []
  for item in items:
    tok, sep, bias = item.partition("=")
    try:
      pairs.append((int(tok), float(bias)))
    except ValueError:
      sep = ""
    if not sep:
      raise UsageError(f"--logit-bias takes ID=BIAS (an integer token id "
                       f"and a number), got {item!r}")
  return tuple(pairs)


def _sampling(args):
  from specjax.core.sampling import SamplingParams
  bias = _logit_bias(args.logit_bias)
  try:
    return SamplingParams(
        args.temperature, args.top_k, args.top_p, args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=bias)
  except ValueError as e:  # "top_p must be ..." -> "--top-p must be ..."
    field, rest = str(e).split(" ", 1)
    if field not in vars(args):  # "the logit bias of token 3 must be ..."
      raise UsageError(f"--logit-bias: {e}") from None
    raise UsageError(f"--{field.replace('_', '-')} {rest}") from None


def _load(name: str, mesh_spec: Optional[str] = None,
          dtype: Optional[str] = None):
  from specjax.assets import AssetError
  from specjax.core import sharding
  from specjax.models.registry import load_model
  from specjax.models.weights import WeightError
  try:
    mesh = None if mesh_spec is None else sharding.make_mesh(mesh_spec)
  except sharding.MeshError as e:
    raise UsageError(f"--mesh: {e}") from None
  try:
    return sharding.on_mesh(
        load_model(name, dtype, native=False if mesh else None), mesh)
  except (AssetError, WeightError, ValueError, OSError) as e:
    raise UsageError(str(e)) from None


def _encode(model, prompts: Sequence[str], chat: bool) -> list[list[int]]:
  tok = model.tokenizer
  out = []
  for i, p in enumerate(prompts):
    try:
      ids = tok.encode_chat(p) if chat else tok.encode(p)
    except (ValueError, jinja2.TemplateError) as e:
      raise UsageError(f"prompt {i + 1}: {e}") from None
    if not ids:
      raise UsageError(f"prompt {i + 1} encodes to no tokens")
    out.append(ids)
  return out


def cmd_generate(args) -> int:
  from specjax.core import runner
  _check_common(args)
  specs = _method_specs(args)
  if len(specs) != 1:
    raise UsageError("generate takes one --method")
  spec = specs[0]
  sampling = _sampling(args)
  prompts = _read_prompts(args)
  model = _load(args.model, args.mesh, args.dtype)
  ids = _encode(model, prompts, chat=not args.no_chat_template)
  _check_fits(model, ids, args.max_new_tokens, [spec], sampling)
  method = _build(model, spec)
  ends = _ends(args, model)

  if args.stream and args.json:
    raise UsageError("--stream prints text; it does not go with --json")
  if args.num_samples < 1:
    raise UsageError(f"--num-samples must be >= 1, got {args.num_samples}")
  if args.num_samples > 1 and args.stream:
    raise UsageError("--stream prints one reply at a time; it does not go "
                     "with --num-samples")
  if args.stream or (args.stream is None and not args.json
                     and args.num_samples == 1 and sys.stdout.isatty()):
    return _stream_generate(args, model, spec, prompts, ids, sampling,
                            method, ends)
  from tqdm import tqdm
  batches = range(0, len(ids), args.batch_size)
  bar = tqdm(batches, desc="generating", unit="batch", file=sys.stderr,
             disable=len(batches) < 2)
  all_rows, wall, new_tokens = [], 0.0, 0
  for start in bar:
    chunk = ids[start:start + args.batch_size]
    res = runner.generate_ids(model, chunk, max_new_tokens=args.max_new_tokens,
                              sampling=sampling, seed=args.seed,
                              first_prompt=start, method=method,
                              num_samples=args.num_samples, **ends)
    all_rows += res.rows
    wall, new_tokens = wall + res.wall_s, new_tokens + res.new_tokens
    for row in res.rows:
      text = model.tokenizer.decode(row.output_ids, skip_special_tokens=True)
      if args.json:
        n = len(row.output_ids)
        print(json.dumps(dict(
            prompt=prompts[row.prompt_index], sample=row.sample_index,
            prompt_ids=row.prompt_ids,
            output_ids=row.output_ids, text=text, new_tokens=n,
            logprobs=[round(x, 6) for x in row.logprobs],
            raw_logprobs=[round(x, 6) for x in row.raw_logprobs],
            stop_reason=row.stop_reason, wall_s=round(res.wall_s, 4),
            compile_s=round(res.compile_s, 3),
            # The batch shares one wall clock; per row we report the batch's.
            tokens_per_s=round(res.new_tokens / res.wall_s, 3),
            batch_size=len(chunk), method=args.method, model=args.model,
            num_draft=spec.k, tree_nodes=spec.tree_nodes,
            tree_shape=spec.tree_shape,
            target_forwards=row.target_forwards, tau=round(row.tau, 3),
            accepted_at=row.accepted_at, accepted_nodes=row.accepted_nodes,
            accepted_length_histogram=row.accepted_length_histogram,
            **row.spec_metrics, **sampling.record(),
            seed=args.seed),
            ensure_ascii=False))
      else:
        if len(res.rows) > 1 or len(prompts) > 1:
          sample = (f" (sample {row.sample_index + 1})"
                    if args.num_samples > 1 else "")
          print(f"### {row.prompt_index + 1}{sample}: "
                f"{prompts[row.prompt_index]}")
        print(text.strip() + "\n")
    sys.stdout.flush()
  if spec.k and not args.json:
    _speculative_summary(spec, all_rows, new_tokens / wall)
  return _nonfinite_status(all_rows)


def _nonfinite_status(rows) -> int:
  """0, or EXIT_NONFINITE after one stderr line per row the model's
  non-finite logits stopped (its text ends there; nothing was sampled from
  them)."""
  for row in rows:
    if row.stop_reason == "nonfinite":
      print(f"specjax: error: prompt {row.prompt_index + 1}: the model's "
            f"logits are not finite (NaN or inf) after "
            f"{len(row.output_ids)} new tokens; "
            "the output stops there", file=sys.stderr)
  return EXIT_NONFINITE if any(r.stop_reason == "nonfinite"
                               for r in rows) else 0


def _speculative_summary(spec, rows, tokens_per_s: Optional[float]) -> None:
  """The speculative metrics over all rows, one line on stderr (tokens/s:
  not for streamed runs, whose wall time holds compiles and host syncs)."""
  from specjax.measure import bench
  acc = bench.acceptance_stats(rows, spec.k)
  speed = "" if tokens_per_s is None else f", {tokens_per_s:.1f} tokens/s"
  print(f"[{spec.label()}] tau {acc['tau']:.2f} tokens/verify, acceptance "
        f"per position {acc['acceptance_per_position']}, accepted-length "
        f"histogram {acc['accepted_length_histogram']}{speed}",
        file=sys.stderr)


def _stream_generate(args, model, spec, prompts, ids, sampling, method,
                     ends) -> int:
  """``generate`` printing each prompt's text as the steps commit it."""
  from specjax.core import runner
  from specjax.models.tokenizer import StreamDecoder
  rows = []
  for i, prompt_ids in enumerate(ids):
    if len(ids) > 1:
      print(f"### {i + 1}: {prompts[i]}", flush=True)
    detok = StreamDecoder(model.tokenizer, skip_special_tokens=True)
    write = lambda new: (sys.stdout.write(detok.push(new[0])),
                         sys.stdout.flush())
    res = runner.stream_ids(model, [prompt_ids], write,
                            max_new_tokens=args.max_new_tokens,
                            sampling=sampling, seed=args.seed,
                            first_prompt=i,
                            method=method, **ends)
    print(detok.flush() + "\n", flush=True)
    rows += res.rows
  if spec.k:
    _speculative_summary(spec, rows, None)
  return _nonfinite_status(rows)


def cmd_bench(args) -> int:
  from specjax import data
  from specjax.measure import bench
  _check_common(args)
  if args.num_prompts is not None and args.num_prompts < 1:
    raise UsageError(f"--num-prompts must be >= 1, got {args.num_prompts}")
  if args.repeats < 1:
    raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
  specs = [s for s in _method_specs(args) if s.name != "ar"]
  if not specs:
    raise UsageError("bench compares speculative methods with AR: give at "
                     "least one --method other than ar")
  sampling = _sampling(args)
  try:
    prompts = data.load_prompts(args.dataset, args.num_prompts)
  except (data.DataError, data.AssetError) as e:
    raise UsageError(str(e)) from None
  model = _load(args.model, args.mesh, args.dtype)
  ids = _encode(model, prompts, chat=args.dataset != "humaneval")
  _check_fits(model, ids, args.max_new_tokens, specs, sampling)
  built = [(s, _build(model, s)) for s in specs]  # bad knobs fail here

  import jax
  if jax.process_count() > 1 and args.journal:
    raise UsageError("--journal keeps one process's progress; leave it out "
                     "with --distributed")

  def emit(result: dict):
    line = json.dumps(result)
    print(line, flush=True)
    if args.json and jax.process_index() == 0:
      with open(args.json, "a", encoding="utf-8") as f:
        f.write(line + "\n")

  for flag, path in (("--json", args.json), ("--journal", args.journal)):
    if path:
      try:
        open(path, "a", encoding="utf-8").close()
      except OSError as e:
        raise UsageError(f"cannot write {flag} {path!r}: {e.strerror}"
                         ) from None
  bench.run(model, built, ids, max_new_tokens=args.max_new_tokens,
            sampling=sampling, batch_size=args.batch_size,
            repeats=args.repeats, seed=args.seed, dataset=args.dataset,
            on_result=emit, journal=args.journal)
  return 0


def cmd_tune(args) -> int:
  from specjax.measure import tuner
  try:
    workload = tuner.Workload(batch_size=args.batch_size, task=args.task,
                              temperature=args.temperature,
                              latency_target_ms=args.latency_target,
                              prompt_tokens=args.prompt_tokens,
                              new_tokens=args.new_tokens)
  except ValueError as e:
    raise UsageError(str(e)) from None
  model = _load(args.model)
  context = model.config.max_position
  if workload.prompt_tokens + workload.new_tokens > context:
    raise UsageError(f"--prompt-tokens {workload.prompt_tokens} and "
                     f"--new-tokens {workload.new_tokens} run past the "
                     f"model's context of {context} tokens")
  costs = tuner.measure_costs(model, workload.batch_size,
                              prompt_tokens=workload.prompt_tokens,
                              new_tokens=workload.new_tokens)
  rec = tuner.recommend(workload, costs)
  tree = tuner.recommend_tree(workload, costs)
  if args.json:
    out = rec.as_dict()
    out["tree"] = tree and dataclasses.asdict(tree)
    print(json.dumps(out))
    return 0
  label = (rec.method if rec.method == "ar" or ":" in rec.method
           else f"{rec.method} --num-draft {rec.num_draft}")
  print(f"recommended: --method {label}  ({rec.expected_speedup:.2f}x "
        f"predicted, {rec.ms_per_token:.1f} ms/token vs AR "
        f"{rec.ar_ms_per_token:.1f})")
  for line in rec.reasoning:
    print(f"  - {line}")
  if tree:
    print(f"static tree: --method {tree.method} --tree-shape {tree.shape}  "
          f"({tree.num_nodes} nodes, depth {tree.depth}: "
          f"{tree.expected_tokens:.2f} tokens/verify, {tree.speedup:.2f}x "
          f"predicted; {tree.source})")
  return 0


def cmd_train(args) -> int:
  from specjax.training import config as tconfig
  try:
    loaded = tconfig.load(args.config, args.overrides)
    runs = ([(args.workdir, loaded.train, {})] if not args.sweep else
            [(os.path.join(args.workdir, name), cfg, point) for name, cfg,
             point in tconfig.sweep(loaded, args.config)])
  except ValueError as e:
    raise UsageError(str(e)) from None
  if args.stop_after is not None and args.stop_after < 1:
    raise UsageError(f"--stop-after must be >= 1, got {args.stop_after}")
  if args.time_limit is not None and not args.time_limit > 0:
    raise UsageError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
  deadline = None if args.time_limit is None else time.time() + args.time_limit
  for workdir, cfg, _ in runs:  # every point checked before any trains
    _check_workdir(workdir)
    try:
      changes = tconfig.config_changes(cfg, workdir)
    except ValueError as e:
      raise UsageError(str(e)) from None
    if changes and not args.allow_config_change:
      raise UsageError(tconfig.ConfigChanged(workdir, changes).summary() +
                       "; rerun with the run's settings, or add "
                       "--allow-config-change")
  for i, (workdir, cfg, point) in enumerate(runs):
    if deadline is not None and time.time() >= deadline:
      print(json.dumps(dict(stopped="time limit", not_started=[
          w for w, _, _ in runs[i:]])))
      break
    _train_one(cfg, workdir, args, deadline,
               dict(loaded.origin, **({"sweep_point": point} if point
                                      else {})))
  return 0


def _train_one(cfg, workdir: str, args, deadline, origin: dict) -> None:
  """One run (or one point of a sweep) in ``workdir``: its JSON line."""
  from specjax.training import train
  # A bad model or mesh fails here, before any data work.
  model = _load(cfg.model, cfg.mesh or None)
  run = train.train(cfg, workdir, model=model, stop_after=args.stop_after,
                    deadline=deadline,
                    allow_config_change=args.allow_config_change,
                    origin=origin)
  print(json.dumps(dict(step=run.step, workdir=workdir,
                        last_loss=run.losses.get(run.step - 1))))


def _check_workdir(workdir: str) -> None:
  """The run directory exists (or is created) and takes files."""
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise UsageError(f"--workdir {workdir!r}: {e.strerror or e}") from None
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise UsageError(f"--workdir {workdir!r} is not writable")


def _join(spec: str) -> None:
  """Joins the multi-process run; every process but 0 computes silently."""
  import jax
  from specjax.core import sharding
  try:
    sharding.initialize_distributed(spec)
  except sharding.MeshError as e:
    raise UsageError(f"--distributed: {e}") from None
  if jax.process_index() != 0:
    sys.stdout = open(os.devnull, "w")


def cmd_demo(args) -> int:
  from specjax.cli import demo
  if args.max_new_tokens < 1:
    raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  model = _load("smollm2-135m")
  limit = demo.max_new_tokens_limit(model)
  if args.max_new_tokens > limit:
    raise UsageError(
        f"--max-new-tokens {args.max_new_tokens} is above the demo's limit of "
        f"{limit}: its prompts and twice the budget must fit the model's "
        f"context of {model.config.max_position}")
  demo.run(model, max_new_tokens=args.max_new_tokens)
  return 0


def error_line(e: Exception) -> str:
  """``specjax: error: ...`` on one printable line, whatever the user typed
  into the message: a line break, a terminal escape or a lone surrogate
  (undecodable argv) is written as its Python escape."""
  return "specjax: error: " + "".join(
      c if c.isprintable() else ascii(c)[1:-1] for c in str(e))


def _notes_as_lines(show):
  """``warnings.showwarning`` printing a ``HeadNote`` (what loading a head
  directory assumed) as one ``specjax: note:`` line."""
  def note_or_warning(message, category, *args, **kw):
    if category.__name__ == "HeadNote":
      print(f"specjax: note: {message}", file=sys.stderr)
    else:
      show(message, category, *args, **kw)
  return note_or_warning


def cmd_export_head(args) -> int:
  from specjax.heads.export import export_layout, load_head
  try:
    cfg, params, draft_ids = load_head(args.head)
    out = export_layout(args.out, cfg, params, draft_ids, args.format,
                        target_name=args.target_name)
  except ValueError as e:
    raise UsageError(str(e)) from None
  except OSError as e:
    raise UsageError(f"cannot write {args.out!r}: {e}") from None
  print(f"wrote {out} ({args.format} layout)")
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  try:
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":  # --config.PATH=VALUE: the config's flags
      args.overrides = extra
    elif extra:
      parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if vars(args).get("distributed"):
      _join(args.distributed)
    warnings.showwarning = _notes_as_lines(warnings.showwarning)
    return {"generate": cmd_generate, "bench": cmd_bench, "tune": cmd_tune,
            "train": cmd_train, "export-head": cmd_export_head,
            "demo": cmd_demo}[args.command](args)
  except (UsageError, DoesNotFit) as e:  # DoesNotFit: found at the shapes
    print(error_line(e), file=sys.stderr)
    return EXIT_USAGE
  except KeyboardInterrupt:
    print("specjax: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())
