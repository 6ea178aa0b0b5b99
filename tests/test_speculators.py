"""A specjax EAGLE-3 head exported in the vLLM speculators layout computes,
in speculators' own model code (``speculators.models.eagle3``), the
logits it computes in specjax: the layout, the config fields and the
math are read the way vLLM's training and serving stack reads them.

speculators 0.9.0 and the modules it imports live in
``.venv/speculators`` (``make test-long`` installs them ``--no-deps``: its
pins would downgrade transformers); its model runs in a child process with
that directory on its path, on torch's CPU in f32.
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.heads import head_module
from specjax.heads.base import HeadConfig
from specjax.heads.interop import export_head
from specjax.heads.vocab import build_draft_vocab
from specjax.models.decoder import Decoder

pytestmark = pytest.mark.long

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPECULATORS = ROOT / ".venv" / "speculators"

# The child: speculators' Eagle3DraftModel built from the exported
# config.json (no verifier: from_pretrained would fetch it from the hub),
# the exported weights loaded, the token embedding set to the target's (the
# layout carries none: vLLM shares the target's), one step of its own
# forward (TTT step 0, eager attention); the logits are what its LM head
# returns.
_CHILD = r"""
import json, sys
import numpy as np, torch
from safetensors.torch import load_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
head_dir, inputs, out = sys.argv[1:]
cfg = Eagle3SpeculatorConfig.from_pretrained(head_dir)
cfg.transformer_layer_config._attn_implementation = "eager"
model = Eagle3DraftModel(cfg).eval()
missing, unexpected = model.load_state_dict(
    load_file(f"{head_dir}/model.safetensors"), strict=False)
x = np.load(inputs)
with torch.no_grad():
  model.embed_tokens.weight.copy_(torch.from_numpy(x["embed"]))
seen = {}
model.lm_head.register_forward_hook(lambda m, i, o: seen.setdefault("logits", o))
ids = torch.from_numpy(x["tokens"]).long()
with torch.no_grad():
  model(torch.from_numpy(x["taps"]), ids, torch.zeros_like(ids),
        position_ids=torch.from_numpy(x["positions"]).long(), ttt_steps=1)
np.save(out, seen["logits"].float().numpy())
print(json.dumps(dict(missing=sorted(missing), unexpected=sorted(unexpected),
                      d2t=None if model.d2t is None else model.d2t.tolist())))
"""


def _randomized(params, seed: int):
  """Every weight moved by normal(0, 0.2): norms away from one, a layer
  whose every part changes the output (an untrained head's are ~0.02)."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [
      x + 0.2 * jax.random.normal(k, x.shape, x.dtype)
      for x, k in zip(leaves, keys)])


def test_an_exported_head_computes_in_speculators_what_it_computes_here(
    tmp_path):
  """Invariant: for the same tokens, taps and positions, speculators'
  Eagle3DraftModel on the exported directory gives the draft logits
  specjax's head gives (f32, 1e-4 relative to the logits' scale); it loads
  every exported tensor and needs nothing else but the target's embedding
  and the verifier's own tensors; its d2t maps the draft vocabulary onto
  the ids specjax drafts."""
  assert (SPECULATORS / "speculators").is_dir(), (
      f"{SPECULATORS} is missing: `make test-long` installs speculators")
  from specjax.training.train import init_head
  cfg, tparams = testing.tiny("llama_gqa_tied", seed=3)
  vd = 12
  hcfg = HeadConfig.for_target(cfg, vd, taps=(0, 1, 2), rope_theta=123.0)
  stream = np.random.default_rng(1).zipf(1.5, 400) % cfg.vocab_size
  vocab = build_draft_vocab([stream], cfg.vocab_size, vd)
  target = Decoder(cfg)
  params = _randomized(init_head(jax.random.key(2), hcfg, target, tparams,
                                 vocab), seed=5)
  out = export_head(tmp_path / "head", hcfg, jax.device_get(params),
                    np.asarray(vocab.ids), "speculators", target_name="tiny")
  B, T = 1, 9
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
  taps = rng.normal(0, 1, (B, T, 3 * cfg.dim)).astype(np.float32)
  positions = (1 + np.arange(T))[None].astype(np.int32)
  embed = np.asarray(target.embedding(tparams), np.float32)
  np.savez(tmp_path / "inputs.npz", tokens=tokens, taps=taps,
           positions=positions, embed=embed)
  child = subprocess.run(
      [sys.executable, "-c", _CHILD, str(out), str(tmp_path / "inputs.npz"),
       str(tmp_path / "theirs.npy")], capture_output=True, text=True,
      env={"PYTHONPATH": str(SPECULATORS), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}, timeout=600)
  assert child.returncode == 0, child.stderr[-3000:]
  report = json.loads(child.stdout.strip().splitlines()[-1])
  assert report["unexpected"] == [], report
  assert set(report["missing"]) <= {"embed_tokens.weight",
                                    "verifier_lm_head.weight",
                                    "verifier_norm.weight"}, report
  d2t = np.asarray(report["d2t"])
  np.testing.assert_array_equal(np.arange(vd) + d2t, np.asarray(vocab.ids))
  theirs = np.load(tmp_path / "theirs.npy")
  ours = np.asarray(head_module(hcfg).apply(
      {"params": params}, jnp.asarray(taps), jnp.asarray(tokens),
      jnp.asarray(embed), jnp.asarray(positions)))
  assert theirs.shape == ours.shape == (B, T, vd)
  scale = float(np.abs(ours).max())
  assert scale > 1.0  # logits that differ across tokens: not a vacuous match
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4 * scale)
