"""Native multi-token-prediction modules (``heads.eagle.MTPHead``,
``heads.mtp_interop``) against references nobody here wrote.

DeepSeek-V3 layout: a torch reference written from vLLM's
``deepseek_mtp.py`` forward (``eh_proj(cat(enorm(embed), hnorm(h)))``, one
decoder layer, ``shared_head``; the next depth fed the layer's output)
around transformers' own ``Qwen3DecoderLayer``. Qwen3.5 and speculators
layouts (long): speculators 0.9.0's own ``MTPDraftModel`` (its Qwen3 MTP
layer, its multi-step forward), saved by its ``save_pretrained`` and, in
Qwen3.5's ``mtp.*`` names, through its converter's own key map. The module
sits inside a tiny transformers Qwen3 target's checkpoint, as DeepSeek and
Qwen ship it; ``--head`` takes that checkpoint.
"""

import json
import re
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from specjax.core import bucketing, engine
from specjax.drafters import methods
from specjax.heads import head_call, with_shared
from specjax.heads.export import HeadNote, load_head
from specjax.heads.interop import HeadFormatError
from specjax.heads.mtp_interop import export_mtp, import_mtp
from specjax.models import layers
from specjax.models.hf_loader import load_hf
from specjax.models.decoder import Decoder
from specjax.models.registry import Model
from tests.tiny_hf import make_tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPECULATORS = ROOT / ".venv" / "speculators"
STEPS = 2  # depths compared: the second is fed the first's output
P = "model.layers.3."  # the DeepSeek layout's module: the tiny target has 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
  """A tiny transformers Qwen3 checkpoint (no windows) and its config."""
  d = tmp_path_factory.mktemp("qwen3")
  make_tiny("gguf_qwen3", d)
  return d, json.loads((d / "config.json").read_text())


def _model(d) -> Model:
  """The checkpoint's target (no tokenizer: the tiny ones have none)."""
  cfg, params = load_hf(d)
  return Model(target=Decoder(cfg), params=params, tokenizer=None)


def _inputs(cfg, seed=0, B=2, T=9):
  rng = np.random.default_rng(seed)
  return (rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int64),
          rng.normal(0, 1, (B, T, cfg.dim)).astype(np.float32))


def ours(hcfg, params, embed, tokens, hidden, steps=STEPS):
  """Depth k's logits at each position t: token t + k + 1 and the target's
  feature at t (depth 0) or depth k - 1's output there, causal attention
  over the depth's positions, positions 0.. -- the multi-step forward
  speculators trains with, through specjax's head pieces."""
  call = head_call(hcfg, params)
  B, T = tokens.shape
  valid = T - steps - 1
  pos = jnp.broadcast_to(jnp.arange(valid), (B, valid))
  mask = layers.query_mask(jnp.zeros((B,), jnp.int32),
                           layers.causal_mask(B, valid), valid,
                           hcfg.num_heads // hcfg.num_kv_heads)
  h, out = jnp.asarray(hidden[:, :valid]), []
  for k in range(steps):
    tok = jnp.asarray(tokens[:, k + 1:k + 1 + valid], jnp.int32)
    q, kk, v, resid = call("project", tok, h, embed, pos)
    h = call("finish", resid, layers.attention(
        q, kk.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask))
    out.append(np.asarray(call("logits", h)))
  return np.stack(out)


def _deepseek_reference(conf: dict, seed: int):
  """(tensors in the DeepSeek-V3 layout, forward(tokens, hidden, embed) ->
  logits per depth): vLLM's DeepSeekMultiTokenPredictorLayer with
  transformers' Qwen3 layer as its ``mtp_block``, random weights (norms
  away from one)."""
  from transformers import Qwen3Config
  from transformers.models.qwen3 import modeling_qwen3 as q3
  torch.manual_seed(seed)
  c = Qwen3Config(**{k: v for k, v in conf.items()
                     if k not in ("architectures", "num_nextn_predict_layers")})
  c._attn_implementation = "eager"
  D, V, L = c.hidden_size, c.vocab_size, c.num_hidden_layers
  m = torch.nn.ModuleDict(dict(
      enorm=q3.Qwen3RMSNorm(D, c.rms_norm_eps),
      hnorm=q3.Qwen3RMSNorm(D, c.rms_norm_eps),
      eh_proj=torch.nn.Linear(2 * D, D, bias=False),
      block=q3.Qwen3DecoderLayer(c, 0),
      shared_norm=q3.Qwen3RMSNorm(D, c.rms_norm_eps),
      head=torch.nn.Linear(D, V, bias=False)))
  with torch.no_grad():
    for p in m.parameters():
      p.add_(0.2 * torch.randn_like(p))
  rotary = q3.Qwen3RotaryEmbedding(c)
  P = f"model.layers.{L}."
  state = {k: v.numpy().copy() for k, v in m.state_dict().items()}
  rename = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "eh_proj.weight": "eh_proj.weight",
            "shared_norm.weight": "shared_head.norm.weight",
            "head.weight": "shared_head.head.weight"}
  tensors = {P + (rename.get(k) or k[len("block."):]): v
             for k, v in state.items()}

  def forward(tokens, hidden, embed, steps=STEPS):
    B, T = tokens.shape
    valid = T - steps - 1
    pos = torch.arange(valid)[None].expand(B, -1)
    mask = torch.full((valid, valid), -torch.inf).triu(1)[None, None]
    h, out = torch.from_numpy(hidden[:, :valid]), []
    with torch.no_grad():
      for k in range(steps):
        e = torch.tensor(embed)[torch.from_numpy(
            tokens[:, k + 1:k + 1 + valid])]
        x = m["eh_proj"](torch.cat([m["enorm"](e), m["hnorm"](h)], -1))
        y = m["block"](x, attention_mask=mask, position_ids=pos,
                       position_embeddings=rotary(x, pos))
        h = y[0] if isinstance(y, tuple) else y
        out.append(m["head"](m["shared_norm"](h)).numpy())
    return np.stack(out)
  return tensors, forward


@pytest.fixture(scope="module")
def deepseek(target_dir, tmp_path_factory):
  """The target's checkpoint with a DeepSeek-layout MTP module added (a
  shard of its own, ``num_nextn_predict_layers: 1``, the copy of the
  target's embedding DeepSeek ships beside it), and the reference."""
  src, conf = target_dir
  d = tmp_path_factory.mktemp("qwen3_mtp")
  shutil.copytree(src, d, dirs_exist_ok=True)
  conf = {**conf, "num_nextn_predict_layers": 1}
  (d / "config.json").write_text(json.dumps(conf))
  tensors, forward = _deepseek_reference(conf, seed=4)
  tensors[P + "embed_tokens.weight"] = np.asarray(load_hf(src)[1].embed)
  save_file(tensors, str(d / "model-mtp.safetensors"))
  return d, forward


def test_a_deepseek_layout_module_computes_vllms_forward(deepseek):
  """Invariant: the module inside a target checkpoint, loaded by
  ``--head`` from that checkpoint, gives at both depths the logits of the
  reference (f32, 1e-4 of their scale); the embedding is the target's, the
  feature norm its final norm, the LM head the module's own."""
  d, forward = deepseek
  model = _model(d)
  cfg, tparams = model.config, model.params
  with pytest.warns(HeadNote, match="embed_tokens.weight not read"):
    hcfg, params, _ = load_head(str(d), cfg)
  assert (hcfg.variant, hcfg.feed_normed, hcfg.qk_norm) == ("mtp", False,
                                                           True)
  params = with_shared(hcfg, params, model.target, model.params)
  embed = np.asarray(tparams.embed)
  tokens, hidden = _inputs(cfg)
  want = forward(tokens, hidden, embed)
  got = ours(hcfg, params, embed, tokens, hidden)
  scale = float(np.abs(want).max())
  assert scale > 1.0
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
  np.testing.assert_array_equal(params["feature_norm"]["scale"],
                                np.asarray(tparams.final_norm))


@pytest.fixture(scope="module")
def qwen35(deepseek, tmp_path_factory):
  """The checkpoint's module alone in Qwen3.5's ``mtp.*`` layout: the
  next depth fed the normed output, the target's LM head."""
  d, _ = deepseek
  hcfg, params, _, _ = import_mtp(d, load_hf(d)[0])
  hcfg = hcfg.__class__(**{**hcfg.__dict__, "feed_normed": True})
  out = tmp_path_factory.mktemp("qwen35_mtp")
  export_mtp(out, hcfg, {k: v for k, v in params.items() if k != "lm_head"},
             "qwen3.5")
  return out


@pytest.mark.parametrize("layout", ["deepseek", "qwen3.5"])
def test_the_checkpoints_module_drafts_greedy_exactly(deepseek, qwen35,
                                                      layout):
  """Invariant: ``--method mtp --head DIR`` drafts chains and dynamic trees
  whose greedy output is AR's token for token on a ragged batch, with
  drafts accepted and rejected, for DIR the target's checkpoint with a
  DeepSeek-layout module inside (the target loads from it as before: the
  module is not part of its forward) and a Qwen3.5-layout module alone.
  The random module drafts through the target's own LM head in the
  Qwen3.5 layout and is then never right on this tiny target, so only
  its rejections are counted; its logits at both depths are checked
  against speculators' forward in the long stage."""
  d, _ = deepseek
  model = _model(d)
  head = str(d if layout == "deepseek" else qwen35)
  prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9, 1, 9, 1, 2]]
  prompt_BT, lengths = bucketing.pad_prompts(prompts)

  def run(method):
    kw = dict(drafter=method.drafter, num_draft=method.num_draft,
              tree_nodes=method.tree_nodes) if method.drafter else {}
    st = engine.generate_jit(
        model.params, prompt_BT, lengths, jax.random.key(0), np.int32(24),
        target=model.target, dcfg=engine.DecodeConfig(capacity=48, **kw),
        drafter_params=method.params)
    return [st.tokens[b, lengths[b]:st.num_tokens[b]].tolist()
            for b in range(2)], st
  want, _ = run(methods.build(model, methods.MethodSpec(name="ar")))
  for spec in (methods.MethodSpec(name="mtp", head=head, num_draft=3),
               methods.MethodSpec(name="mtp", head=head, num_draft=3,
                                  tree_nodes=6, tree_width=2)):
    got, st = run(methods.build(model, spec))
    assert got == want, spec
    drafted, accepted = int(st.num_drafted.sum()), int(st.accepted_at.sum())
    assert 0 < drafted and accepted < drafted, spec
    assert accepted > 0 or layout == "qwen3.5", spec


def test_training_goes_on_from_the_checkpoints_module(deepseek, tmp_path):
  """Invariant: ``head.init_head=<target checkpoint>`` trains the module
  the checkpoint ships, from its weights (the first loss is that module's,
  not a fresh head's), with the target's final norm and the module's LM
  head frozen, and the result is exported in the module's layout."""
  from tests.test_eagle_train import CFG, _examples
  from specjax.training import train as etrain
  d, _ = deepseek
  model = _model(d)
  cfg = CFG.updated({"head.variant": "mtp", "head.init_head": str(d),
                     "steps": 2, "export": "deepseek"})
  run = etrain.train(cfg, tmp_path / "go_on", model=model,
                     examples=_examples(), progress=False)
  fresh = etrain.train(cfg.updated({"head.init_head": ""}), tmp_path / "new",
                       model=model, examples=_examples(), progress=False)
  shipped = with_shared(*load_head(str(d), model.config)[:2], model.target,
                        model.params)
  for name in ("lm_head", "feature_norm"):
    jax.tree.map(np.testing.assert_array_equal, run.params[name],
                 shipped[name])
  assert run.losses[1] != fresh.losses[1]
  hcfg, params, _, _ = import_mtp(tmp_path / "go_on" / "head-deepseek",
                                  model.config)
  assert hcfg.variant == "mtp" and not hcfg.feed_normed
  np.testing.assert_allclose(params["fc"]["kernel"],
                             np.asarray(run.params["fc"]["kernel"]))


@pytest.mark.parametrize("fmt", ["deepseek", "qwen3.5", "speculators"])
def test_export_then_import_gives_the_module_back(deepseek, fmt, tmp_path):
  """Invariant: a module exported in a layout imports as itself (config
  and every parameter bit for bit); one whose next-step rule is not the
  layout's is refused by name."""
  d, _ = deepseek
  cfg, _ = load_hf(d)
  hcfg, params, _, _ = import_mtp(d, cfg)
  if fmt != "deepseek":
    with pytest.raises(ValueError, match="export it as deepseek"):
      export_mtp(tmp_path, hcfg, params, fmt)
    hcfg = hcfg.__class__(**{**hcfg.__dict__, "feed_normed": True})
    params = {k: v for k, v in params.items() if k != "lm_head"}
  export_mtp(tmp_path, hcfg, params, fmt)
  got_cfg, got, _, _ = import_mtp(tmp_path, cfg)
  assert got_cfg == hcfg
  jax.tree.map(np.testing.assert_array_equal, got, params)


REFUSED = [  # (change to the checkpoint, words in the error)
    ("extra", {P + "mlp.experts.0.gate_proj.weight": (44, 32)},
     "not part of one MTP module"),
    ("missing", {P + "eh_proj.weight": None}, "eh_proj.weight is missing"),
    ("transposed", {P + "eh_proj.weight": (64, 32)},
     "is (64, 32), the config says (32, 64)"),
    ("another target", {"hidden_size": 48}, "hidden size 48"),
    ("MLA", {"model_type": "deepseek_v3"}, "MLA attention"),
    ("Qwen3.5 layer", {"model_type": "qwen3_5_text"}, "gated attention"),
    ("two modules", {"num_nextn_predict_layers": 2}, "one MTP module"),
    ("rope scaling", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_scaling is set"),
    ("bias", {"attention_bias": True}, "attention_bias is set"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_what_specjax_cannot_honour_is_refused_by_name(deepseek, case,
                                                        tmp_path):
  """Invariant: each is one ``HeadFormatError`` naming the tensor or field,
  never a skipped tensor or a silently different module."""
  d, _ = deepseek
  cfg, _ = load_hf(d)
  shutil.copytree(d, tmp_path, dirs_exist_ok=True)
  _, change, words = case
  conf = json.loads((tmp_path / "config.json").read_text())
  shard = tmp_path / "model-mtp.safetensors"
  tensors = load_file(str(shard))
  for key, value in change.items():
    if key.startswith(P):
      tensors.pop(key, None)
      if value is not None:
        tensors[key] = np.zeros(value, np.float32)
    else:
      conf[key] = value
  save_file(tensors, str(shard))
  (tmp_path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(HeadFormatError, match=re.escape(words)):
    import_mtp(tmp_path, cfg)


# The child: speculators' MTPDraftModel over the target's config (its Qwen3
# MTP layer), random weights (norms away from one), the target's embedding
# and LM head as its verifier's, two depths of its own forward; saved by
# its save_pretrained, and in Qwen3.5's mtp.* names by inverting its
# converter's key map (into a copy of the target's checkpoint).
_CHILD = r"""
import json, shutil, sys
import numpy as np, torch
from safetensors.torch import save_file
from transformers import Qwen3Config
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.convert.mtp.converter import MTP_EXACT_REMAP, MTP_PREFIX_REMAP
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
target_dir, inputs, out = sys.argv[1:]
conf = json.load(open(f"{target_dir}/config.json"))
tc = Qwen3Config(**{k: v for k, v in conf.items() if k != "architectures"})
tc._attn_implementation = "eager"
cfg = MTPSpeculatorConfig(transformer_layer_config=tc, speculators_config=
    SpeculatorsConfig(algorithm="mtp", proposal_methods=[
        GreedyTokenProposalConfig(speculative_tokens=%d)],
        default_proposal_method="greedy", verifier=VerifierConfig(
            name_or_path=None, architectures=["Qwen3ForCausalLM"])))
torch.manual_seed(7)
model = MTPDraftModel(cfg).eval()
x = np.load(inputs)
with torch.no_grad():
  for p in model.mtp_layers.parameters():
    p.add_(0.2 * torch.randn_like(p))
  model.embed_tokens.weight.copy_(torch.from_numpy(x["embed"]))
  model.lm_head.weight.copy_(torch.from_numpy(x["lm_head"]))
  logits, _, _ = model(torch.from_numpy(x["tokens"]),
                       torch.from_numpy(x["hidden"]))
np.save(f"{out}/theirs.npy", torch.stack(logits).numpy())
model.save_pretrained(f"{out}/speculators")
inverse = {v: k for k, v in MTP_EXACT_REMAP.items()}
prefixes = [(dst, src) for src, dst in MTP_PREFIX_REMAP]
def native(key):
  if key in inverse:
    return inverse[key]
  for dst, src in prefixes:
    if key.startswith(dst):
      return src + key[len(dst):]
  raise KeyError(key)
state = {native(k): v.contiguous() for k, v in model.state_dict().items()
         if k.startswith("mtp_layers.")}
shutil.copytree(target_dir, f"{out}/qwen3.5")
save_file(state, f"{out}/qwen3.5/model-mtp.safetensors")
json.dump({**conf, "mtp_num_hidden_layers": 1},
          open(f"{out}/qwen3.5/config.json", "w"))
""" % STEPS


@pytest.mark.long
def test_speculators_mtp_model_computes_what_specjax_computes(target_dir,
                                                              tmp_path):
  """Invariant: speculators' own MTPDraftModel and specjax, on the same
  tokens and target features, give the same logits at both depths (f32,
  1e-4 of their scale), specjax reading the module from speculators'
  ``save_pretrained`` directory and from a target checkpoint in Qwen3.5's
  ``mtp.*`` names; each notes nothing but what it takes from the target."""
  assert (SPECULATORS / "speculators").is_dir(), (
      f"{SPECULATORS} is missing: `make test-long` installs speculators")
  d, _ = target_dir
  model = _model(d)
  cfg, tparams = model.config, model.params
  tokens, hidden = _inputs(cfg, seed=1, B=1, T=10)
  embed = np.asarray(tparams.embed, np.float32)
  lm_head = np.asarray(model.target.lm_head(model.params), np.float32)
  np.savez(tmp_path / "inputs.npz", tokens=tokens, hidden=hidden,
           embed=embed, lm_head=lm_head)
  child = subprocess.run(
      [sys.executable, "-c", _CHILD, str(d), str(tmp_path / "inputs.npz"),
       str(tmp_path)], capture_output=True, text=True,
      env={"PYTHONPATH": str(SPECULATORS), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}, timeout=600)
  assert child.returncode == 0, child.stderr[-3000:]
  want = np.load(tmp_path / "theirs.npy")
  scale = float(np.abs(want).max())
  assert scale > 1.0
  for layout in ("speculators", "qwen3.5"):
    hcfg, params, _, notes = import_mtp(tmp_path / layout, cfg)
    assert hcfg.feed_normed and hcfg.qk_norm, layout
    assert all("verifier_lm_head" in n for n in notes), notes
    params = with_shared(hcfg, params, model.target, model.params)
    got = ours(hcfg, params, embed, tokens, hidden)
    assert got.shape == want.shape, layout
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale,
                               err_msg=layout)
