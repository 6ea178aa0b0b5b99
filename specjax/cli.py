"""``specjax`` command line: ``generate`` and ``demo``.

Bad input never produces a traceback: it prints one line naming the problem
to stderr and exits with status 2 (``UsageError``).
"""

from __future__ import annotations

import argparse
import json
import sys

import jinja2
from typing import Optional, Sequence

METHODS = ("ar", "ngram")
EXIT_USAGE = 2


class UsageError(Exception):
  """Bad user input; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # argparse prints usage + message; we want one line
    raise UsageError(message)


def _build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="specjax", description=__doc__.splitlines()[0])
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

  g = sub.add_parser("generate", help="generate text for one or more prompts")
  g.add_argument("--model", default="smollm2-135m",
                 help="known name (smollm2-135m), a .gguf file or an HF dir")
  g.add_argument("--method", default="ar", help=f"one of {', '.join(METHODS)}")
  src = g.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="prompt text")
  src.add_argument("--prompt-file",
                   help='JSONL file, one {"prompt": ...} object per line')
  g.add_argument("--num-draft", type=int, default=4,
                 help="K, drafts per verify step (speculative methods)")
  g.add_argument("--max-new-tokens", type=int, default=128)
  g.add_argument("--temperature", type=float, default=0.0,
                 help="0 = greedy (default)")
  g.add_argument("--top-k", type=int, default=0, help="0 = off")
  g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--batch-size", type=int, default=8)
  g.add_argument("--no-chat-template", action="store_true",
                 help="feed the prompt text as is")
  g.add_argument("--json", action="store_true",
                 help="print one JSON object per prompt")

  d = sub.add_parser("demo", help="SmolLM2 decoding demo (the README's main job)")
  d.add_argument("--max-new-tokens", type=int, default=96)
  return p


def _read_prompts(args) -> list[str]:
  if args.prompt is not None:
    if not args.prompt.strip():
      raise UsageError("empty prompt")
    return [args.prompt]
  try:
    with open(args.prompt_file, encoding="utf-8-sig") as f:
      lines = [(i, l) for i, l in enumerate(f, 1) if l.strip()]
  except (OSError, UnicodeDecodeError) as e:
    raise UsageError(f"cannot read prompt file {args.prompt_file!r}: "
                     f"{getattr(e, 'strerror', None) or e}") from None
  prompts = []
  for i, line in lines:
    where = f"{args.prompt_file}:{i}"
    try:
      prompt = json.loads(line)["prompt"]
    except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
      raise UsageError(f'{where}: expected a JSON object with a "prompt" '
                       "string") from None
    if not isinstance(prompt, str):
      raise UsageError(f'{where}: "prompt" must be a string')
    if not prompt.strip():
      raise UsageError(f"{where}: empty prompt")
    prompts.append(prompt)
  if not prompts:
    raise UsageError(f"prompt file {args.prompt_file!r} has no prompts")
  return prompts


def _sampling(args):
  from specjax.sampling import SamplingParams
  try:
    return SamplingParams(args.temperature, args.top_k, args.top_p)
  except ValueError as e:  # "top_p must be ..." -> "--top-p must be ..."
    field, rest = str(e).split(" ", 1)
    raise UsageError(f"--{field.replace('_', '-')} {rest}") from None


def _load(name: str):
  from specjax.assets import AssetError
  from specjax.models.registry import load_model
  from specjax.models.weights import WeightError
  try:
    return load_model(name)
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
  from specjax import runner
  if args.method not in METHODS:
    raise UsageError(f"unknown method {args.method!r} "
                     f"(choose from {', '.join(METHODS)})")
  if args.max_new_tokens < 1:
    raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  if args.batch_size < 1:
    raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
  if not 0 <= args.seed < 2**63:
    raise UsageError(f"--seed must be in [0, 2**63), got {args.seed}")
  drafter = None
  if args.method == "ngram":
    from specjax.drafters import NGramDrafter
    drafter = NGramDrafter()
  if drafter is not None and args.num_draft < 1:
    raise UsageError(f"--num-draft must be >= 1, got {args.num_draft}")
  sampling = _sampling(args)
  prompts = _read_prompts(args)
  model = _load(args.model)
  ids = _encode(model, prompts, chat=not args.no_chat_template)
  ctx = model.config.max_position
  for i, p in enumerate(ids):
    if len(p) + args.max_new_tokens > ctx:
      raise UsageError(
          f"prompt {i + 1} is {len(p)} tokens; with --max-new-tokens "
          f"{args.max_new_tokens} it exceeds the model's context of {ctx}")

  from tqdm import tqdm
  batches = range(0, len(ids), args.batch_size)
  bar = tqdm(batches, desc="generating", unit="batch", file=sys.stderr,
             disable=len(batches) < 2)
  for start in bar:
    chunk = ids[start:start + args.batch_size]
    res = runner.generate_ids(model, chunk, max_new_tokens=args.max_new_tokens,
                              sampling=sampling, seed=args.seed + start,
                              drafter=drafter, num_draft=args.num_draft)
    for j, row in enumerate(res.rows):
      text = model.tokenizer.decode(row.output_ids, skip_special_tokens=True)
      if args.json:
        n = len(row.output_ids)
        print(json.dumps(dict(
            prompt=prompts[start + j], prompt_ids=row.prompt_ids,
            output_ids=row.output_ids, text=text, new_tokens=n,
            stop_reason=row.stop_reason, wall_s=round(res.wall_s, 4),
            compile_s=round(res.compile_s, 3),
            # The batch shares one wall clock; per row we report the batch's.
            tokens_per_s=round(res.new_tokens / res.wall_s, 3),
            batch_size=len(chunk), method=args.method, model=args.model,
            num_draft=args.num_draft if drafter else 0,
            target_forwards=row.target_forwards, tau=round(row.tau, 3),
            accepted_at=row.accepted_at,
            temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=args.seed), ensure_ascii=False))
      else:
        if len(prompts) > 1:
          print(f"### {start + j + 1}: {prompts[start + j]}")
        print(text.strip() + "\n")
    sys.stdout.flush()
  return 0


def cmd_demo(args) -> int:
  from specjax import demo
  if args.max_new_tokens < 1:
    raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  demo.run(_load("smollm2-135m"), max_new_tokens=args.max_new_tokens)
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  try:
    args = _build_parser().parse_args(argv)
    return {"generate": cmd_generate, "demo": cmd_demo}[args.command](args)
  except UsageError as e:
    print(f"specjax: error: {e}", file=sys.stderr)
    return EXIT_USAGE
  except KeyboardInterrupt:
    print("specjax: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())
