"""The repository's layout holds: training recipes in configs/ load as the
trainer's configs, benchmarks/ is a package run with ``python -m`` from the
repository root, and nothing there puts the repository on ``sys.path``."""

import pathlib
import re
import subprocess
import sys

import pytest

from specjax.training import config

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("configs/*.py")])
# sys.path edits that reach for the repository: the path of a file, its
# parents, or a ROOT derived from them.
REPO_ON_PATH = re.compile(r"sys\.path.*(__file__|parents|ROOT)")


def test_no_script_puts_the_repository_on_the_path():
  """Invariant: no benchmark or config edits sys.path to find the
  repository (they import it as a package); the pattern is shown to match
  the line every script used to carry."""
  assert REPO_ON_PATH.search(
      "sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))")
  assert len(SCRIPTS) > 20
  found = [f"{p.relative_to(ROOT)}:{i}" for p in SCRIPTS
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if REPO_ON_PATH.search(line)]
  assert not found, found


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/*.py")),
                         ids=lambda p: p.name)
def test_each_recipe_loads_as_a_training_config(path):
  """Invariant: each file in configs/ is a config ``specjax train
  --config`` accepts."""
  cfg = config.load(str(path)).train
  assert isinstance(cfg, config.TrainConfig) and cfg.steps > 0


@pytest.mark.parametrize("module", ["benchmarks.bench_methods",
                                    "benchmarks.gpu"])
def test_benchmarks_run_as_modules_from_the_root(module):
  """Invariant: ``python -m benchmarks.NAME --help`` works from the
  repository root with nothing added to the path."""
  run = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  assert "usage: " in run.stdout
