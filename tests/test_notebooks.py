"""The notebooks: committed without outputs, linked from the README, and each
run top to bottom in a Jupyter kernel (their own asserts included), as a
reader runs them."""

import configparser
import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _code_cells(path):
  return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_the_notebooks_are_found():
  """Invariant: the glob the tests run over finds the five notebooks (moved
  or renamed ones would otherwise leave them with nothing to run)."""
  assert [p.name for p in NOTEBOOKS][:1] == ["01_quickstart.ipynb"]
  assert len(NOTEBOOKS) >= 5


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_stripped(path):
  """Invariant: no outputs or execution counts in git (a rerun changes only
  what a reader edited), and the first code cell is the setup cell: the
  only one that installs anything, and only in Colab."""
  cells = _code_cells(path)
  for cell in cells:
    assert not cell["outputs"], f"{path.name}: commit notebooks with outputs stripped"
    assert cell["execution_count"] is None, f"{path.name}: execution counts in git"
  setup = "".join(cells[0]["source"])
  assert '"google.colab" in sys.modules' in setup, f"{path.name}: no Colab setup cell"
  for cell in cells[1:]:
    assert "pip" not in "".join(cell["source"]), f"{path.name}: pip outside the setup cell"


def test_colab_links():
  """Invariant: the README opens each notebook in Colab from the repository
  URL of setup.cfg, and each setup cell installs from that URL."""
  meta = configparser.ConfigParser(interpolation=None)
  meta.read(ROOT / "setup.cfg")
  url = meta["metadata"]["url"]
  readme = (ROOT / "README.md").read_text()
  repo = url.removeprefix("https://github.com/")
  for path in NOTEBOOKS:
    link = f"https://colab.research.google.com/github/{repo}/blob/main/notebooks/{path.name}"
    assert link in readme, f"README: no Colab link for {path.name}"
    assert f'"{url}"' in "".join(_code_cells(path)[0]["source"]), path.name


def test_the_own_model_notebook_defines_the_example_model():
  """Invariant: notebook 05's plain-JAX model (its cells defining
  ``init_params`` and ``PlainTarget``, run here) is
  examples/plain_jax_target.py's: the same weights from a key and the same
  logits and cache from a forward (a Colab runtime has no checkout to
  import the example from, so the notebook carries its own copy)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import specjax
  from examples import plain_jax_target as example
  cells = ["".join(c["source"]) for c in _code_cells(
      ROOT / "notebooks" / "05_your_own_model.ipynb")]
  ns = dict(specjax=specjax, jax=jax, jnp=jnp, np=np)
  for src in cells:
    if "def init_params" in src or "class PlainTarget" in src:
      exec(src, ns)
  cfg = specjax.ModelConfig(vocab_size=41, dim=24, num_layers=2, num_heads=4,
                            num_kv_heads=4, head_dim=6, ffn_dim=40,
                            max_position=32, name="plain")
  ours, theirs = ns["init_params"](jax.random.key(3), cfg), \
      example.init_params(jax.random.key(3), cfg)
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)
  tokens = jnp.array([[5, 6, 7, 8], [9, 1, 9, 1]])
  outs = [t.forward(ours, tokens, t.init_cache(ours, 2, 16), taps=(1,))
          for t in (ns["PlainTarget"](cfg), example.PlainTarget(cfg))]
  jax.tree.map(np.testing.assert_array_equal, *outs)


# Notebooks bound by running rather than compiling run at XLA's -O1 (the
# suite's -O0 elsewhere, tests/conftest.py): 03 trains a head (alone on Zen 3,
# 259 s at -O0, 227 s at -O1); 02 compiles more than it runs (130 s, 173 s).
RUN_BOUND = {"03_train_eagle3.ipynb"}


@pytest.mark.long
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path, monkeypatch):
  """Invariant: every cell runs without error, in order, in an IPython kernel
  of this interpreter (nbclient, as `jupyter nbconvert --execute` does).
  The kernel starts in an empty directory, so files a notebook writes (a
  training run's workdir) start fresh and stay out of the checkout; it
  inherits the suite's environment (XLA flags, compilation cache), and
  implicit rank promotion raises there too (tests/conftest.py)."""
  import nbclient
  import nbformat

  monkeypatch.setenv("JAX_NUMPY_RANK_PROMOTION", "raise")
  if path.name in RUN_BOUND:
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"].replace(
        "--xla_backend_optimization_level=0",
        "--xla_backend_optimization_level=1"))
  nb = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(nb, kernel_name="python3", timeout=1200,
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
