"""A plain (non-editable) install carries the native kernels: pip installs
the checkout into a fresh virtual environment, from a directory outside it,
and that install decodes on the kernels. The new environment reads its
dependencies from the running one's site-packages (``make install``
resolves and installs them; here they would only be downloaded and unpacked
again): what is checked is the build, not the resolver."""

import json
import pathlib
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).parents[1]

# Run by the fresh environment's Python, from outside the checkout: greedy
# tokens of a random model with its matmuls packed for the kernels (AR and
# n-gram drafts) equal those of the same weights on XLA's dot.
_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
import specjax
from specjax.kernels import native
from specjax.models import decoder, layers
assert native.available()
cfg = specjax.ModelConfig(vocab_size=37, dim=24, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=6, ffn_dim=40,
                          max_position=64)
plain = decoder.random_params(jax.random.key(0), cfg, scale=0.3)
packed = decoder.pack_params(plain)
assert isinstance(packed.layers[0].wqkv, layers.PackedWeight)
prompt, lengths = specjax.pad_prompts([[5, 6, 7, 5, 6, 7, 5], [9, 1, 9]])

def run(params, **kw):
  dcfg = specjax.DecodeConfig(capacity=48, **kw)
  st = jax.jit(specjax.generate, static_argnames=("target", "dcfg"))(
      params, prompt, lengths, jax.random.key(0), 24,
      target=specjax.Decoder(cfg), dcfg=dcfg)
  return np.asarray(st.tokens).tolist()

ngram = dict(drafter=specjax.NGramDrafter(), num_draft=3)
print(json.dumps(dict(
    file=specjax.__file__, isa=native.isa(),
    same=run(packed) == run(plain) and run(packed, **ngram) == run(plain))))
"""


@pytest.mark.long
def test_a_plain_install_carries_the_kernels(tmp_path):
  """Invariant: ``pip install <checkout>`` (not editable) into a new venv
  builds the kernels into the installed package (in pip's isolated build
  environment, as a user's install does): specjax imports from the venv,
  ``native.available()`` is true, and greedy decoding on the packed
  weights equals XLA's, AR and with n-gram drafts."""
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  python = venv / "bin" / "python"
  # After the venv's own site-packages on sys.path: the installed specjax
  # shadows the checkout's editable one, the dependencies are found.
  site = sysconfig.get_path("purelib", vars={"base": str(venv)})
  (pathlib.Path(site) / "deps.pth").write_text(
      sysconfig.get_path("purelib") + "\n")
  install = subprocess.run(
      [str(python), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)],
      cwd=tmp_path, capture_output=True, text=True, timeout=1200)
  assert install.returncode == 0, install.stderr[-3000:]
  run = subprocess.run([str(python), "-c", _SCRIPT], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.splitlines()[-1])
  assert pathlib.Path(out["file"]).is_relative_to(venv), out
  assert out["isa"] in ("avx512", "avx2", "generic") and out["same"], out
