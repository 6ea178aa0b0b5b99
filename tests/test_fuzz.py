"""The CLI's promise under random input: every argument list either runs or
is one stderr line ``specjax: error: ...`` with exit 2 -- never a traceback,
never another exit status, never more lines.

hypothesis draws a subcommand and a random subset of its flags, each with
a value from a hostile pool (huge, negative and non-finite numbers, text
that is empty, not Unicode, or a path to nothing, a directory or
/dev/null; method, tree and mesh spellings that almost parse). The real
model is loaded once (``tests/test_cli.py``'s fixture) and the decoding,
benchmarking, tuning and training themselves are stubbed out: the cases
check the boundary, and a case that passes it is recorded as accepted.
Each case has a time limit (a hang fails it). The long stage draws more
examples than the fast one. Then the API's config objects, from any numbers,
and a table of hostile files.
"""

import os
import signal

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

# The model is loaded once for the module (an autouse fixture).
from tests.test_cli import _load_each_model_once  # noqa: F401

# Each flag's value is a plausible one or, a third of the time, a hostile
# one.
HOSTILE_NUMBER = st.one_of(
    st.sampled_from([0, -1, 2**31, 2**63, 2**70, 10**6]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["1e-40", "1e-320", "nan", "-inf", "0x10", "", "3.5",
                     "1_000", "\u0663"]))
HOSTILE_TEXT = st.one_of(st.text(max_size=12), st.sampled_from(
    ["", "   ", "a\udcffb", "x" * 5000, "/", "/dev/null", "/no/such/file",
     "configs"]))
INT = st.integers(1, 8)
UNIT = st.sampled_from(["0", "0.5", "0.9", "1"])
MODEL = st.sampled_from(["smollm2-135m", "gpt-17", "/no/such.gguf",
                         "/dev/null", "/"])
METHOD = st.sampled_from(
    ["ar", "ngram", "retrieval", "ngram+retrieval", "eagle3", "medusa",
     "layerskip", "eagle", "draft", "bogus", "ngram,ar", "ngram,,eagle3", "",
     "EAGLE3"])
SHAPE = st.sampled_from(["", "2x2", "2x0", "0", "1000x1000", "3,1x2",
                         "0,1,1", "0.0,0.0", "a", "-1", "2x2x2x2x2x2x2"])
MESH = st.sampled_from(["data=1", "model=3", "data=0", "data=1,model=1",
                        "x=1", "data", ""])

COMMON = {  # generate, bench and tune's method options: (plausible value)
    "--method": METHOD, "--num-draft": INT, "--tree-nodes": INT,
    "--tree-width": INT, "--tree-shape": SHAPE, "--lookup-nodes": INT,
    "--layers": st.integers(1, 29), "--min-confidence": UNIT,
    "--head": st.just("/no/such/head.npz"),
    "--draft-model": st.just("/no/such/draft.gguf"),
    "--dtype": st.sampled_from(["float32", "bfloat16", "float16"]),
    "--mesh": MESH, "--temperature": st.sampled_from(["0", "0.7", "1.3"]),
    "--top-k": st.integers(0, 50), "--top-p": UNIT, "--seed": INT,
    "--repetition-penalty": UNIT, "--presence-penalty": UNIT,
    "--logit-bias": st.sampled_from(["3=1.5", "3", "=", "-1=2", "9e9=1"]),
    "--model": MODEL}
FLAGS = {
    "generate": {**COMMON, "--prompt": st.just("hi"),
                 "--max-new-tokens": INT, "--batch-size": INT},
    "bench": {**COMMON, "--dataset": st.sampled_from(
        ["mtbench", "humaneval", "nope", "/no/such.jsonl", "/"]),
              "--num-prompts": INT, "--max-new-tokens": INT,
              "--batch-size": INT, "--repeats": INT},
    "tune": {"--model": MODEL, "--batch-size": INT,
             "--task": st.sampled_from(["chat", "code", "poetry", ""]),
             "--temperature": UNIT, "--latency-target": INT},
    "train": {"--config": st.sampled_from(
        ["configs/eagle3_smollm2.py", "configs", "/dev/null",
         "/no/such.py"]), "--workdir": st.sampled_from(
             ["WORK", "/dev/null", "/dev/null/x"]),
              "--config.steps": st.sampled_from(["3", "", "-1", "x"]),
              "--config.keep": st.sampled_from(["0", "2"]),
              "--config.optim.lr": st.sampled_from(["nan", "1e-3", "x"]),
              "--config.head.variant": st.sampled_from(["x", "eagle1"]),
              "--config.seed": st.sampled_from(["-1", "1"]),
              "--config.nonsense": st.just("1"),
              "--config.optim": st.just("3"),
              "--stop-after": INT, "--time-limit": INT},
    "demo": {"--max-new-tokens": INT},
}
REQUIRED = {"generate": ("--prompt",), "train": ("--config", "--workdir")}


@st.composite
def argvs(draw):
  command = draw(st.sampled_from(sorted(FLAGS)))
  flags = FLAGS[command]
  chosen = draw(st.lists(st.sampled_from(sorted(flags)), max_size=5,
                         unique=True))
  if draw(st.booleans()):  # usually the required flags too
    chosen = list(dict.fromkeys([*REQUIRED.get(command, ()), *chosen]))
  argv = [command]
  for flag in chosen:
    hostile = draw(st.integers(0, 2)) == 0
    value = draw((HOSTILE_TEXT if flags[flag] in (MODEL, METHOD, SHAPE, MESH)
                  or flag in ("--prompt", "--head", "--draft-model",
                              "--config", "--workdir", "--config.head.variant",
                              "--task",
                              "--dataset")
                  else HOSTILE_NUMBER) if hostile else flags[flag])
    argv.append(f"{flag}={value}")  # "=": a value may start with "-"
  return argv


class Accepted(Exception):
  """Raised by the stubs: the arguments passed every check."""


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
  """Decoding, benchmarking, tuning and training replaced by a raise of
  ``Accepted``; the working directory a fresh one (train's WORK)."""
  from specjax.cli import demo
  from specjax.core import runner
  from specjax.measure import bench, tuner
  from specjax.training import train

  def accept(*a, **kw):
    raise Accepted
  for module, name in ((runner, "generate_ids"), (runner, "stream_ids"),
                       (bench, "run"), (train, "train"),
                       (tuner, "measure_costs"), (demo, "run")):
    monkeypatch.setattr(module, name, accept)
  monkeypatch.chdir(tmp_path)
  os.symlink(os.path.join(os.path.dirname(__file__), "..", "configs"),
             tmp_path / "configs")


def _hung(signum, frame):
  raise TimeoutError("a case ran past its time limit: a hang")


def _contract(argv, capsys, seconds: int = 120):
  """"accepted", or the one error line of a refusal (exit 2); a case still
  running after ``seconds`` (loading a model included) fails as a hang."""
  from specjax.cli.main import main
  capsys.readouterr()
  signal.signal(signal.SIGALRM, _hung)
  signal.alarm(seconds)
  try:
    code = main(argv)
  except Accepted:
    return "accepted"
  except SystemExit as e:  # argparse
    code = e.code
  finally:
    signal.alarm(0)
  err = capsys.readouterr().err.strip().splitlines()
  # ascii(): a report must carry no lone surrogate (xdist cannot send one).
  assert code == 2, ascii((argv, code, err))
  assert len(err) == 1 and err[0].startswith("specjax: error: "), ascii(
      (argv, err))
  assert err[0].isprintable() and err[0].encode(), ascii(err)  # a terminal's
  return err[0]


def _fuzz(examples):
  @settings(max_examples=examples, deadline=None, derandomize=True,
            suppress_health_check=[HealthCheck.function_scoped_fixture,
                                   HealthCheck.too_slow])
  @given(argv=argvs())
  def run(argv, capsys, stubbed):
    outcome = _contract(argv, capsys)
    event(f"{argv[0]}: {'accepted' if outcome == 'accepted' else 'refused'}")
  return run


test_cli_boundary_holds_for_random_arguments = _fuzz(150)
test_cli_boundary_holds_for_more_random_arguments = pytest.mark.long(
    _fuzz(1500))


@pytest.mark.parametrize("mutation", ["argparse_errors", "unicode_check"])
def test_the_fuzz_finds_a_broken_boundary(capsys, stubbed, monkeypatch,
                                          mutation):
  """Invariant (mutation check): the same search fails when argparse's own
  error handling comes back (usage and message: two lines), and when the
  prompt's Unicode check is removed (a lone surrogate reaches the
  tokenizer: its TypeError escapes; generate's pool is then that prompt
  alone)."""
  import argparse
  from specjax import data
  from specjax.cli import main as cli
  if mutation == "argparse_errors":
    monkeypatch.setattr(cli._Parser, "error", argparse.ArgumentParser.error)
    expected = AssertionError
  else:
    monkeypatch.setattr(data, "check_text", lambda text, where: text)
    monkeypatch.setitem(FLAGS, "generate", {"--prompt": st.just("a\udcffb")})
    expected = TypeError  # tokenizers: "TextInputSequence must be str"
  with pytest.raises(expected):
    _fuzz(150)(capsys=capsys, stubbed=stubbed)


def _hostile(kind, path):
  """Writes a hostile file of ``kind`` at ``path``; returns the path."""
  import zipfile
  import numpy as np
  from specjax import assets
  rng = np.random.default_rng(0)
  if kind == "junk":
    path.write_bytes(rng.bytes(4096))
  elif kind == "empty":
    path.write_bytes(b"")
  elif kind == "gguf_magic_only":
    path.write_bytes(b"GGUF" + rng.bytes(12))
  elif kind == "gguf_truncated":  # the real file's first megabyte
    with open(assets.smollm2_gguf(), "rb") as f:
      path.write_bytes(f.read(2**20))
  elif kind == "zip_of_nothing":
    zipfile.ZipFile(path, "w").close()
  elif kind == "npz_without_meta":
    np.savez(path, x=np.zeros(3))
  elif kind == "deep_json":
    path.write_text("[" * 100_000 + "\n")
  elif kind == "hf_dir_bad_config":
    path.mkdir()
    (path / "config.json").write_text("{not json")
  elif kind == "hf_dir_empty":
    path.mkdir()
  return path


HOSTILE_FILES = [  # (flag, kind, the first words of the error)
    *(("--model", kind, words) for kind, words in (
        ("junk", "GGUF magic invalid"), ("empty", "empty file"),
        ("gguf_magic_only", "truncated or damaged"),
        ("gguf_truncated", "truncated or damaged"),
        ("hf_dir_bad_config", "config.json"), ("hf_dir_empty", ""))),
    *(("--head", kind, "head file") for kind in (
        "junk", "empty", "zip_of_nothing", "npz_without_meta")),
    *(("--prompt-file", kind, "prompt") for kind in ("junk", "deep_json",
                                                     "empty")),
    *(("--draft-model", kind, "draft model") for kind in (
        "junk", "gguf_magic_only", "gguf_truncated")),
]


@pytest.mark.parametrize("flag,kind,words", HOSTILE_FILES,
                         ids=[f"{f}:{k}" for f, k, _ in HOSTILE_FILES])
def test_hostile_files_are_one_line(capsys, tmp_path, flag, kind, words):
  """Invariant: a truncated, corrupted, empty or foreign file given as a
  model, a head, a prompt file or a draft model is one stderr line naming
  the problem, exit 2."""
  suffix = {"--model": ".gguf", "--draft-model": ".gguf", "--head": ".npz",
            "--prompt-file": ".jsonl"}[flag]
  if kind.startswith("hf_dir"):
    suffix = ""
  path = _hostile(kind, tmp_path / f"file{suffix}")
  method = {"--head": ["--method", "eagle3"],
            "--draft-model": ["--method", "draft"]}.get(flag, [])
  source = [] if flag == "--prompt-file" else ["--prompt", "hi"]
  argv = ["generate", "--max-new-tokens", "2", *source, *method, flag,
          str(path)]
  line = _contract(argv, capsys)
  assert line != "accepted" and words in line, line


# --- the API's config objects ------------------------------------------------

ANY_NUMBER = st.one_of(
    st.integers(-2**64, 2**64), st.floats(allow_nan=True,
                                          allow_infinity=True),
    st.sampled_from([0, 1, -1, 1e-40, 1e-320, 2**63]))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(temperature=ANY_NUMBER, top_k=ANY_NUMBER, top_p=ANY_NUMBER,
       capacity=ANY_NUMBER, num_draft=ANY_NUMBER, tree_nodes=ANY_NUMBER,
       chunk=ANY_NUMBER, with_drafter=st.booleans())
def test_api_configs_are_valid_or_refused_by_type(
    temperature, top_k, top_p, capacity, num_draft, tree_nodes, chunk,
    with_drafter):
  """Invariant: ``SamplingParams`` and ``DecodeConfig`` built from any
  numbers either hold values the engine can run (finite, in range, a tree
  within ``tree.MAX_NODES``, a block within the capacity) or raise a
  ``ValueError`` or ``TypeError`` naming a field: never another exception,
  never an object the engine would then misuse."""
  from specjax.core import engine, tree
  from specjax.core.sampling import F32_MAX, F32_TINY, SamplingParams
  from specjax.drafters import NGramDrafter
  try:
    sp = SamplingParams(temperature, top_k, top_p)
  except (ValueError, TypeError) as e:
    assert any(f in str(e) for f in ("temperature", "top_p", "top_k")), e
  else:
    assert isinstance(sp.top_k, int), sp
    assert sp.temperature == 0 or F32_TINY <= sp.temperature <= F32_MAX
    assert 0 < sp.top_p <= 1 and sp.top_k >= 0
  try:
    dcfg = engine.DecodeConfig(
        capacity=capacity, num_draft=num_draft, tree_nodes=tree_nodes,
        prefill_chunk=chunk,
        drafter=NGramDrafter(num_paths=3) if with_drafter else None)
  except (ValueError, TypeError) as e:
    assert any(f in str(e) for f in ("capacity", "num_draft", "tree_nodes",
                                     "prefill_chunk", "drafter", "block",
                                     "scores")), e
  else:
    for field in ("capacity", "num_draft", "tree_nodes", "prefill_chunk"):
      assert isinstance(getattr(dcfg, field), int), (field, dcfg)
    assert dcfg.capacity >= 1 and dcfg.prefill_chunk >= 1
    assert 0 <= dcfg.tree_nodes <= tree.MAX_NODES
    assert dcfg.block <= dcfg.capacity and (dcfg.k >= 1) == with_drafter


def test_a_hanging_case_fails(capsys, stubbed, monkeypatch):
  """Invariant: a case that does not return within its limit (here a demo
  that sleeps past 1 s) fails the contract instead of hanging the suite."""
  import time
  from specjax.cli import demo
  assert _contract(["demo", "--max-new-tokens=4"], capsys) == "accepted"
  monkeypatch.setattr(demo, "run", lambda *a, **kw: time.sleep(30))
  with pytest.raises(TimeoutError, match="a hang"):
    _contract(["demo", "--max-new-tokens=4"], capsys, seconds=1)
