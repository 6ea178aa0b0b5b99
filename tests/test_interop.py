"""EAGLE-3 heads in the SpecForge/SGLang and vLLM speculators layouts
(``specjax.heads.interop``): export then import gives the head back bit
for bit in either layout (safetensors and PyTorch ``.bin``), the files hold
what those loaders read, and every tensor or config field specjax cannot
honour is refused by name, never skipped."""

import json
import re

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specjax import testing
from specjax.heads.base import HeadConfig
from specjax.heads.interop import (FORMATS, HeadFormatError, export_head,
                                   import_head)
from specjax.heads.vocab import build_draft_vocab
from specjax.models.decoder import Decoder

VD = 12


@pytest.fixture(scope="module")
def head():
  """(target config, HeadConfig, params, draft ids): an untrained EAGLE-3
  head (random weights) on a tiny target, its own RoPE base."""
  from specjax.training.train import init_head
  cfg, params = testing.tiny("llama_gqa_tied", seed=3)
  hcfg = HeadConfig.for_target(cfg, VD, taps=(0, 1, 2), rope_theta=123.0)
  stream = np.random.default_rng(1).zipf(1.5, 400) % cfg.vocab_size
  vocab = build_draft_vocab([stream], cfg.vocab_size, VD)
  hp = init_head(jax.random.key(2), hcfg, Decoder(cfg), params, vocab)
  return cfg, hcfg, jax.device_get(hp), np.asarray(vocab.ids)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_then_import_gives_the_head_back(head, fmt, tmp_path):
  """Invariant: in either layout the imported head is the exported one
  (config, every parameter bit for bit, the draft vocabulary), and the
  only note is the tap convention it read the ids in."""
  cfg, hcfg, params, ids = head
  export_head(tmp_path, hcfg, params, ids, fmt)
  got_cfg, got, got_ids, notes = import_head(tmp_path, cfg)
  assert got_cfg == hcfg
  np.testing.assert_array_equal(got_ids, ids)
  jax.tree.map(np.testing.assert_array_equal, got, params)
  assert len(notes) == 1 and "capture-before" in notes[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_exported_files_hold_what_the_loaders_read(head, fmt, tmp_path):
  """Invariant: the files carry the layout's architecture and keys,
  torch's [out, in] matrices, ``d2t`` as int64 offsets (target id = i +
  d2t[i]) and ``t2d`` as a boolean mask, and write explicitly the fields
  engines default differently: ``rope_theta``, ``norm_before_residual``,
  the capture-before taps (SGLang's value in the README)."""
  cfg, hcfg, params, ids = head
  export_head(tmp_path, hcfg, params, ids, fmt, target_name="tiny")
  conf = json.loads((tmp_path / "config.json").read_text())
  layer = conf["transformer_layer_config"] if fmt == "speculators" else conf
  prefix = "layers.0." if fmt == "speculators" else "midlayer."
  assert conf["architectures"] == [{"specforge": "LlamaForCausalLMEagle3",
                                    "speculators": "Eagle3Speculator"}[fmt]]
  assert layer["rope_theta"] == 123.0 and layer["num_hidden_layers"] == 1
  assert conf["norm_before_residual"] is False
  assert conf["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
  assert conf["draft_vocab_size"] == VD
  assert conf["target_hidden_size"] == cfg.dim
  assert "[-1, 0, 1]" in (tmp_path / "README.md").read_text()
  w = load_file(str(tmp_path / "model.safetensors"))
  assert {k for k in w if k.startswith(prefix)} == {
      prefix + k for k in (
          "input_layernorm.weight", "hidden_norm.weight",
          "self_attn.q_proj.weight", "self_attn.k_proj.weight",
          "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "post_attention_layernorm.weight", "mlp.gate_proj.weight",
          "mlp.up_proj.weight", "mlp.down_proj.weight")}
  assert w["fc.weight"].shape == (cfg.dim, 3 * cfg.dim)
  assert w[prefix + "self_attn.q_proj.weight"].shape == (
      hcfg.num_heads * hcfg.head_dim, 2 * cfg.dim)
  np.testing.assert_array_equal(w["lm_head.weight"],
                                params["lm_head"]["kernel"].T)
  assert w["d2t"].dtype == np.int64 and w["t2d"].dtype == bool
  np.testing.assert_array_equal(np.arange(VD) + w["d2t"], ids)
  assert w["t2d"].sum() == VD and w["t2d"][ids].all()
  if fmt == "speculators":
    assert conf["speculators_config"]["verifier"]["name_or_path"] == "tiny"


def test_pytorch_bin_weights_load_the_same(head, tmp_path):
  """Invariant: the same tensors as a PyTorch ``.bin`` state dict import
  to the same head."""
  torch = pytest.importorskip("torch")
  cfg, hcfg, params, ids = head
  export_head(tmp_path, hcfg, params, ids, "specforge")
  w = load_file(str(tmp_path / "model.safetensors"))
  (tmp_path / "model.safetensors").unlink()
  torch.save({k: torch.from_numpy(v) for k, v in w.items()},
             tmp_path / "pytorch_model.bin")
  _, got, got_ids, _ = import_head(tmp_path, cfg)
  jax.tree.map(np.testing.assert_array_equal, got, params)
  np.testing.assert_array_equal(got_ids, ids)


def test_taps_are_read_in_the_convention_asked_for(head, tmp_path):
  """Invariant: the file's ids are capture-before unless the caller says
  output-of-layer (SGLang's: one more), and without ids the reference's
  default, each said in a note."""
  cfg, hcfg, params, ids = head
  export_head(tmp_path, hcfg, params, ids, "specforge")
  conf = json.loads((tmp_path / "config.json").read_text())
  conf["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
  (tmp_path / "config.json").write_text(json.dumps(conf))
  got, _, _, notes = import_head(tmp_path, cfg,
                                 taps_convention="output-of-layer")
  assert got.taps == (1, 2, 3) and not notes
  del conf["eagle_aux_hidden_state_layer_ids"]
  (tmp_path / "config.json").write_text(json.dumps(conf))
  got, _, _, notes = import_head(tmp_path, cfg)
  assert got.taps == (0, 1, 2) and "default" in notes[0]


def _edit(path, config=None, tensors=None):
  if config:
    conf = json.loads((path / "config.json").read_text())
    config(conf)
    (path / "config.json").write_text(json.dumps(conf))
  if tensors:
    w = load_file(str(path / "model.safetensors"))
    tensors(w)
    save_file(w, str(path / "model.safetensors"))


def _set(**kw):
  return lambda conf: conf.update(kw)


REFUSALS = {  # name: (fmt, config edit, tensor edit, words)
    "an extra tensor": ("specforge", None, lambda w: w.update(
        {"embed_tokens.weight": np.zeros((37, 24), np.float32)}),
        "embed_tokens.weight is not part"),
    "a missing tensor": ("speculators", None,
                         lambda w: w.pop("layers.0.hidden_norm.weight"),
                         "layers.0.hidden_norm.weight is missing"),
    "a misshapen tensor": ("specforge", None, lambda w: w.update(
        {"norm.weight": np.ones(23, np.float32)}), "norm.weight is (23,)"),
    "a second layer": ("specforge", _set(num_hidden_layers=2), None,
                       "num_hidden_layers"),
    "norm_before_residual": ("speculators", _set(norm_before_residual=True),
                             None, "norm_before_residual"),
    "a norm on the taps": ("specforge", _set(fc_norm=True), None, "fc_norm"),
    "no final norm": ("specforge", _set(norm_output=False), None,
                      "norm_output"),
    "recurrent post-norm": ("speculators", _set(norm_output=True), None,
                            "norm_output"),
    "rope scaling": ("specforge", _set(rope_scaling={"rope_type": "llama3"}),
                     None, "rope_scaling"),
    "an unknown field": ("specforge", _set(frobnicate=1), None,
                         "frobnicate unknown"),
    "another target's width": ("specforge", _set(hidden_size=32,
                                                 target_hidden_size=32),
                               None, "hidden size 32"),
    "taps past the target": ("specforge",
                             _set(eagle_aux_hidden_state_layer_ids=[0, 1, 9]),
                             None, "taps layers [0, 1, 9]"),
    "a d2t that is no map": ("specforge", None, lambda w: w.update(
        {"d2t": -np.arange(VD, dtype=np.int64)}), "d2t does not map"),
    "t2d against d2t": ("speculators", None, lambda w: w.update(
        {"t2d": np.ones(37, bool)}), "t2d and d2t disagree"),
    "another architecture": ("specforge", _set(
        architectures=["LlamaForCausalLM"]), None, "neither"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_specjax_cannot_honour_is_refused_by_name(head, case, tmp_path):
  """Invariant: each is one ``HeadFormatError`` naming the tensor or
  field (SGLang would skip an unknown key; specjax never does)."""
  cfg, hcfg, params, ids = head
  fmt, config, tensors, words = REFUSALS[case]
  export_head(tmp_path, hcfg, params, ids, fmt)
  _edit(tmp_path, config, tensors)
  with pytest.raises(HeadFormatError, match=re.escape(words)):
    import_head(tmp_path, cfg)
