"""EAGLE-3 heads in the ecosystem's two layouts: import and export.

``specforge``: SafeAILab's EAGLE, SpecForge and SGLang -- ``config.json``
with ``architectures: ["LlamaForCausalLMEagle3"]``, the draft layer's
Llama fields at the top level, weights ``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``. ``speculators``: vLLM's -- ``architectures:
["Eagle3Speculator"]``, the layer's fields in ``transformer_layer_config``,
weights ``layers.0.*``. Both store torch's ``[out, in]`` matrices; ``d2t``
holds offsets (target id = i + d2t[i]), ``t2d`` which target ids the draft
vocabulary holds.

specjax's EAGLE-3 head is the reference's one layer (``heads.eagle``), so a
head maps tensor for tensor. Import is strict, because the engines that
load these files are not (SGLang skips unknown keys): every tensor must be
there in its shape, none may be left over, and every config field that
changes the math is honoured or refused with its name -- several layers,
``norm_before_residual``, a norm on the taps (``fc_norm``,
``norm_before_fc``), a head without its final norm, its own token
embedding, biases, RoPE scaling.

The transformers layer's tensors (``layer_to_torch``, ``layer_from_torch``,
``layer_shapes``), the strict tensor check and the readers serve the MTP
layouts too (``mtp_interop``).

Taps. specjax, vLLM and tpu-inference number a tap by the decoder layer
whose *input* it is (``capture-before``: 0 = the embedding); SGLang and
SpecForge's trainer by the layer whose *output* it is, one less. A file's
``eagle_aux_hidden_state_layer_ids`` does not say which it means: import
reads them as vLLM does (``capture-before``) unless told
``taps_convention="output-of-layer"``, and says which it assumed; without
ids, the reference's default (2, L // 2, L - 3). Export writes
capture-before ids and, in ``README.md``, SGLang's value.
"""

from __future__ import annotations

import json
import pathlib
from typing import Optional

import numpy as np

from specjax.heads.base import HeadConfig, eagle3_taps
from specjax.models.config import ModelConfig
from specjax.models.decoder import fuse_qkv, split_qkv
from specjax.models.layers import fuse_gate_up, split_gate_up

FORMATS = ("specforge", "speculators")
CONVENTIONS = ("capture-before", "output-of-layer")
_ARCH = {"specforge": "LlamaForCausalLMEagle3",
         "speculators": "Eagle3Speculator"}
_PREFIX = {"specforge": "midlayer.", "speculators": "layers.0."}
# The config fields import knows: those that only describe a checkpoint,
# and those it reads or refuses (``_refuse_math``, ``_head_config``).
_KNOWN = {"architectures", "model_type", "torch_dtype", "dtype",
          "transformers_version", "_name_or_path", "use_cache",
          "initializer_range", "bos_token_id", "eos_token_id",
          "pad_token_id", "max_position_embeddings", "pretraining_tp",
          "speculators_model_type", "speculators_version",
          "speculators_config", "transformer_layer_config", "vocab_size",
          "embed_requires_grad", "_attn_implementation", "attn_implementation",
          "output_hidden_states", "return_dict", "tie_word_embeddings",
          "attention_dropout", "hidden_act", "mlp_bias", "attention_bias",
          "rope_scaling", "rope_theta", "num_hidden_layers", "hidden_size",
          "intermediate_size", "num_attention_heads", "num_key_value_heads",
          "head_dim", "rms_norm_eps", "draft_vocab_size",
          "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
          "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
          "eagle_config", "rope_parameters"}


class HeadFormatError(ValueError):
  """A head directory specjax cannot load exactly (names what and why)."""


def check_export(fmt: str, variant: str) -> None:
  """ValueError unless a ``variant`` head can be written in layout
  ``fmt``."""
  if fmt not in FORMATS:
    raise ValueError(f"head format {fmt!r} is not one of "
                     f"{', '.join(FORMATS)}")
  if variant != "eagle3":
    heads = "EAGLE-3 and MTP" if fmt == "speculators" else "EAGLE-3"
    raise ValueError(f"the {fmt} layout is for {heads} heads, not {variant}")


def export_head(out_dir, cfg: HeadConfig, params, draft_ids, fmt: str,
                *, target_name: str = "") -> pathlib.Path:
  """Writes the EAGLE-3 head ``(cfg, params, draft_ids)`` to ``out_dir`` in
  layout ``fmt`` (``FORMATS``): ``config.json``, ``model.safetensors``
  (f32, torch layout) and a ``README.md`` with the taps in both
  conventions. ``target_name`` goes into the speculators verifier entry."""
  from safetensors.numpy import save_file
  check_export(fmt, cfg.variant)
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  tensors = _tensors(cfg, params, draft_ids, _PREFIX[fmt])
  save_file(tensors, str(out / "model.safetensors"))
  (out / "config.json").write_text(json.dumps(
      _config(cfg, fmt, target_name), indent=2) + "\n")
  (out / "README.md").write_text(_readme(cfg, fmt))
  return out


def layer_fields(cfg: HeadConfig) -> dict:
  """The head's layer as transformers' Llama config fields."""
  return dict(
      hidden_size=cfg.target_dim, intermediate_size=cfg.ffn_dim,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
      rope_theta=cfg.rope_theta, rope_scaling=None, num_hidden_layers=1,
      hidden_act="silu", attention_bias=False, mlp_bias=False,
      tie_word_embeddings=False, vocab_size=cfg.target_vocab)


def _config(cfg: HeadConfig, fmt: str, target_name: str) -> dict:
  eagle = dict(draft_vocab_size=cfg.draft_vocab,
               target_hidden_size=cfg.target_dim, norm_before_residual=False,
               eagle_aux_hidden_state_layer_ids=list(cfg.taps))
  if fmt == "specforge":
    return dict(architectures=[_ARCH[fmt]], model_type="llama",
                **layer_fields(cfg), **eagle)
  return dict(
      architectures=[_ARCH[fmt]], speculators_model_type="eagle3",
      transformer_layer_config=dict(model_type="llama", **layer_fields(cfg)),
      norm_before_fc=False, fc_norm=False, norm_output=False, **eagle,
      speculators_config=dict(
          algorithm="eagle3", default_proposal_method="greedy",
          proposal_methods=[dict(proposal_type="greedy",
                                 speculative_tokens=3)],
          verifier=dict(name_or_path=target_name,
                        architectures=["LlamaForCausalLM"])))


def _readme(cfg: HeadConfig, fmt: str) -> str:
  return (f"# EAGLE-3 head exported by specjax ({fmt} layout)\n\n"
          f"Taps `eagle_aux_hidden_state_layer_ids` = {list(cfg.taps)}: "
          f"capture-before (the input of each decoder layer; vLLM and "
          f"tpu-inference read them so). SGLang adds one to configured "
          f"ids; give it {[t - 1 for t in cfg.taps]}.\n")


def torch_f32(a) -> np.ndarray:
  """A vector as stored, a ``[in, out]`` kernel as torch's ``[out, in]``."""
  a = np.asarray(a, np.float32)
  return np.ascontiguousarray(a.T if a.ndim == 2 else a)


def layer_to_torch(layer, p: str, cfg: HeadConfig) -> dict:
  """``heads.base.DecoderLayer``'s parameters (its input norm aside) as a
  transformers Llama/Qwen3 layer's tensors under prefix ``p``."""
  wq, wk, wv = split_qkv(np.asarray(layer["wqkv"]), cfg.num_kv_heads,
                         cfg.head_dim)
  gate, up = split_gate_up(np.asarray(layer["w_gate_up"]))
  out = {f"{p}self_attn.{n}_proj.weight": torch_f32(w)
         for n, w in (("q", wq), ("k", wk), ("v", wv), ("o", layer["wo"]))}
  out.update({f"{p}post_attention_layernorm.weight": torch_f32(
      layer["mlp_norm"]), f"{p}mlp.gate_proj.weight": torch_f32(gate),
              f"{p}mlp.up_proj.weight": torch_f32(up),
              f"{p}mlp.down_proj.weight": torch_f32(layer["w_down"])})
  if cfg.qk_norm:
    for n in ("q", "k"):
      out[f"{p}self_attn.{n}_norm.weight"] = torch_f32(layer[f"{n}_norm"])
  return out


def layer_shapes(p: str, cfg: HeadConfig, in_dim: int) -> dict:
  """The shape of each tensor ``layer_to_torch`` writes, for a layer over
  an ``in_dim``-wide input."""
  D, F, H = cfg.target_dim, cfg.ffn_dim, cfg.head_dim
  NH, GH = cfg.num_heads * H, cfg.num_kv_heads * H
  out = {f"{p}self_attn.q_proj.weight": (NH, in_dim),
         f"{p}self_attn.k_proj.weight": (GH, in_dim),
         f"{p}self_attn.v_proj.weight": (GH, in_dim),
         f"{p}self_attn.o_proj.weight": (D, NH),
         f"{p}post_attention_layernorm.weight": (D,),
         f"{p}mlp.gate_proj.weight": (F, D), f"{p}mlp.up_proj.weight": (F, D),
         f"{p}mlp.down_proj.weight": (D, F)}
  if cfg.qk_norm:
    out.update({f"{p}self_attn.q_norm.weight": (H,),
                f"{p}self_attn.k_norm.weight": (H,)})
  return out


def layer_from_torch(t, p: str, cfg: HeadConfig) -> dict:
  """The inverse of ``layer_to_torch``; ``t(name)`` reads a tensor."""
  T = lambda name: t(p + name).T
  layer = {"wqkv": fuse_qkv(T("self_attn.q_proj.weight"),
                            T("self_attn.k_proj.weight"),
                            T("self_attn.v_proj.weight"), cfg.num_kv_heads),
           "wo": T("self_attn.o_proj.weight"),
           "mlp_norm": t(p + "post_attention_layernorm.weight"),
           "w_gate_up": fuse_gate_up(T("mlp.gate_proj.weight"),
                                     T("mlp.up_proj.weight")),
           "w_down": T("mlp.down_proj.weight")}
  if cfg.qk_norm:
    for n in ("q", "k"):
      layer[f"{n}_norm"] = t(f"{p}self_attn.{n}_norm.weight")
  return layer


def _tensors(cfg: HeadConfig, params, draft_ids, prefix: str) -> dict:
  ids = np.asarray(draft_ids, np.int64)
  t2d = np.zeros(cfg.target_vocab, bool)
  t2d[ids] = True
  return {
      "fc.weight": torch_f32(params["fc"]["kernel"]),
      f"{prefix}input_layernorm.weight": torch_f32(params["in_norm"]["scale"]),
      f"{prefix}hidden_norm.weight": torch_f32(params["hidden_norm"]["scale"]),
      **layer_to_torch(params["layer"], prefix, cfg),
      "norm.weight": torch_f32(params["norm"]["scale"]),
      "lm_head.weight": torch_f32(params["lm_head"]["kernel"]),
      "d2t": ids - np.arange(len(ids)), "t2d": t2d}


def import_head(path, target: ModelConfig,
                taps_convention: Optional[str] = None):
  """``(HeadConfig, params (f32 numpy), draft_ids, notes)`` of the EAGLE-3
  head in directory ``path`` (either layout, safetensors or PyTorch
  ``.bin``), checked against ``target``; ``notes``: what the loader
  assumed (the tap convention, a default it filled in), for the caller to
  show. ``HeadFormatError`` names anything it cannot honour."""
  root = pathlib.Path(path)
  conf = read_config(root)
  arch = conf.get("architectures") or []
  fmt = next((f for f, a in _ARCH.items() if a in arch), None)
  if fmt is None:
    raise HeadFormatError(f"{root}: architectures {arch} is neither "
                          f"{_ARCH['specforge']} nor {_ARCH['speculators']}")
  layer = conf.get("transformer_layer_config", {}) if fmt == "speculators" \
      else conf
  notes = []
  cfg = _head_config(root, fmt, conf, layer, target, taps_convention, notes)
  tensors = read_tensors(root)
  params, draft_ids = _params(root, fmt, cfg, tensors)
  return cfg, params, draft_ids, notes


def read_config(root: pathlib.Path) -> dict:
  try:
    conf = json.loads((root / "config.json").read_text())
  except (OSError, ValueError) as e:
    raise HeadFormatError(f"{root}: cannot read config.json: {e}") from None
  if not isinstance(conf, dict):
    raise HeadFormatError(f"{root}/config.json is not a JSON object")
  return conf


def _refuse_math(root, fmt: str, conf: dict, layer: dict) -> None:
  """HeadFormatError for any field whose value changes the math in a way
  specjax's head does not compute."""
  eagle = conf.get("eagle_config") or {}
  unknown = sorted(set(conf) - _KNOWN) + sorted(
      f"transformer_layer_config.{k}" for k in set(layer) - _KNOWN
      if layer is not conf)
  checks = [
      ("num_hidden_layers", layer.get("num_hidden_layers", 1) == 1,
       "one draft layer"),
      ("norm_before_residual", not conf.get("norm_before_residual", False),
       "the raw feature as the residual"),
      ("fc_norm", not conf.get("fc_norm", False), "no norm on the taps"),
      ("norm_before_fc", not conf.get("norm_before_fc", False),
       "no norm on the taps"),
      ("norm_output", conf.get("norm_output", fmt == "specforge")
       == (fmt == "specforge"),
       "the final norm before the LM head only" if fmt == "specforge"
       else "the pre-norm output fed back"),
      ("eagle_config.use_aux_hidden_state",
       eagle.get("use_aux_hidden_state", True), "fused taps"),
      ("attention_bias", not layer.get("attention_bias", False), "no biases"),
      ("mlp_bias", not layer.get("mlp_bias", False), "no biases"),
      ("hidden_act", layer.get("hidden_act", "silu") == "silu", "SwiGLU"),
      ("rope_scaling", not layer.get("rope_scaling"), "plain RoPE"),
      ("rope_parameters.rope_type", (layer.get("rope_parameters") or {}).get(
          "rope_type", "default") == "default", "plain RoPE"),
      ("tie_word_embeddings", not layer.get("tie_word_embeddings", False),
       "its own LM head"),
  ]
  for name, ok, what in checks:
    if not ok:
      raise HeadFormatError(f"{root}: {name} is set; specjax's EAGLE-3 head "
                            f"computes {what} and cannot load it exactly")
  if unknown:
    raise HeadFormatError(f"{root}: config field(s) {', '.join(unknown)} "
                          f"unknown to specjax; refusing rather than ignoring "
                          f"what may change the head's math")


def _head_config(root, fmt, conf, layer, target: ModelConfig,
                 taps_convention, notes) -> HeadConfig:
  _refuse_math(root, fmt, conf, layer)
  need = lambda k: field(root, layer, k)
  D = need("hidden_size")
  target_dim = conf.get("target_hidden_size") or D  # null: as wide
  if target_dim != D:
    raise HeadFormatError(f"{root}: draft width {D} differs from the "
                          f"target's {target_dim}; specjax's head is as wide "
                          f"as its target")
  N = need("num_attention_heads")
  head_dim = layer.get("head_dim") or D // N
  theta = layer.get("rope_theta",
                    (layer.get("rope_parameters") or {}).get("rope_theta"))
  if theta is None:
    theta = 10000.0
    notes.append("rope_theta not in the file: the Llama default 10000, as "
                 "vLLM and SGLang read it")
  taps = conf.get("eagle_aux_hidden_state_layer_ids") or (
      conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
  if taps is None:
    taps = eagle3_taps(target.num_layers)
    notes.append(f"no tap ids in the file: the reference's default "
                 f"{list(taps)} (capture-before)")
  else:
    taps = _taps(root, taps, taps_convention, notes)
  cfg = HeadConfig(
      target_dim=target_dim, target_vocab=layer.get(
          "vocab_size", target.vocab_size), target_layers=target.num_layers,
      taps=tuple(taps), num_heads=N,
      num_kv_heads=layer.get("num_key_value_heads", N), head_dim=head_dim,
      ffn_dim=need("intermediate_size"),
      draft_vocab=conf.get("draft_vocab_size", layer.get(
          "vocab_size", target.vocab_size)),
      rope_theta=float(theta),
      norm_eps=float(layer.get("rms_norm_eps", 1e-6)))
  try:
    cfg.check_fits(target)
  except ValueError as e:
    raise HeadFormatError(f"{root}: {e}") from None
  return cfg


def _taps(root, ids, convention, notes) -> tuple[int, ...]:
  if convention not in (None, *CONVENTIONS):
    raise ValueError(f"taps_convention must be one of "
                     f"{', '.join(CONVENTIONS)}, got {convention!r}")
  if not (isinstance(ids, list) and len(ids) == 3
          and all(isinstance(i, int) for i in ids)):
    raise HeadFormatError(f"{root}: eagle_aux_hidden_state_layer_ids must be "
                          f"three layer ids, got {ids!r}")
  shift = 1 if convention == "output-of-layer" else 0
  if convention is None:
    notes.append(f"taps {ids} read as capture-before (vLLM's reading; "
                 f"SGLang's would be {[i + 1 for i in ids]}); pass "
                 f"taps_convention='output-of-layer' for SGLang's")
  return tuple(i + shift for i in ids)


def field(root, conf: dict, key: str):
  if key not in conf:
    raise HeadFormatError(f"{root}: config.json lacks {key}")
  return conf[key]


def read_tensors(root: pathlib.Path, keep=lambda name: True) -> dict:
  """Every tensor of the directory's weight files whose name ``keep``
  accepts (a target checkpoint's MTP module: only its own are read)."""
  files = sorted(root.glob("*.safetensors"))
  if files:
    from safetensors import safe_open
    out = {}
    for f in files:
      with safe_open(str(f), framework="numpy") as h:
        out.update({k: h.get_tensor(k) for k in h.keys() if keep(k)})
    return out
  bins = sorted(root.glob("*.bin"))
  if not bins:
    raise HeadFormatError(f"{root}: no *.safetensors or *.bin weights")
  try:
    import torch
  except ImportError:
    raise HeadFormatError(f"{root}: PyTorch .bin weights need torch, which "
                          f"is not installed") from None
  out = {}
  for f in bins:
    state = torch.load(f, map_location="cpu", weights_only=True)
    out.update({k: v.float().numpy() if v.is_floating_point() else v.numpy()
                for k, v in state.items() if keep(k)})
  return out


def check_tensors(root, tensors: dict, want: dict, optional, what: str
                  ) -> None:
  """HeadFormatError for a tensor that is not in ``want`` (named by what
  the file should hold, ``what``), one that is missing (unless
  ``optional``) or one of another shape than ``want`` says."""
  for name in sorted(set(tensors) - set(want)):
    why = (" (specjax drafts with the target's embedding)"
           if name.endswith("embed_tokens.weight") else "")
    raise HeadFormatError(f"{root}: tensor {name} is not part of {what}"
                          f"{why}; refusing to skip it")
  for name, shape in want.items():
    if name not in tensors:
      if name in optional:
        continue
      raise HeadFormatError(f"{root}: tensor {name} is missing")
    if tuple(tensors[name].shape) != shape:
      raise HeadFormatError(f"{root}: tensor {name} is "
                            f"{tuple(tensors[name].shape)}, the config says "
                            f"{shape}")


def _params(root, fmt: str, cfg: HeadConfig, tensors: dict):
  """``(params, draft_ids)``; HeadFormatError for a missing, extra or
  misshapen tensor or a vocabulary map that is not one."""
  D, Vd, V = cfg.target_dim, cfg.draft_vocab, cfg.target_vocab
  p = _PREFIX[fmt]
  want = {"fc.weight": (D, len(cfg.taps) * D),
          f"{p}input_layernorm.weight": (D,), f"{p}hidden_norm.weight": (D,),
          **layer_shapes(p, cfg, 2 * D), "norm.weight": (D,),
          "lm_head.weight": (Vd, D), "d2t": (Vd,), "t2d": (V,)}
  optional = {"d2t", "t2d"} if Vd == V else set()
  check_tensors(root, tensors, want, optional, "a one-layer EAGLE-3 head")
  t = lambda name: np.asarray(tensors[name], np.float32)
  draft_ids = (np.arange(Vd) + np.asarray(tensors["d2t"], np.int64)
               if "d2t" in tensors else np.arange(Vd))
  if (draft_ids.min() < 0 or draft_ids.max() >= V
      or len(np.unique(draft_ids)) != Vd):
    raise HeadFormatError(f"{root}: d2t does not map the draft vocabulary "
                          f"to {Vd} distinct target ids below {V}")
  if "t2d" in tensors:
    t2d = np.asarray(tensors["t2d"], bool)
    if t2d.sum() != Vd or not t2d[draft_ids].all():
      raise HeadFormatError(f"{root}: t2d and d2t disagree on the draft "
                            f"vocabulary")
  params = {
      "fc": {"kernel": t("fc.weight").T},
      "in_norm": {"scale": t(f"{p}input_layernorm.weight")},
      "hidden_norm": {"scale": t(f"{p}hidden_norm.weight")},
      "layer": layer_from_torch(t, p, cfg),
      "norm": {"scale": t("norm.weight")},
      "lm_head": {"kernel": t("lm_head.weight").T}}
  return params, draft_ids.astype(np.int32)
