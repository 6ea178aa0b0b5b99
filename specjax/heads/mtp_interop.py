"""Native multi-token-prediction (MTP) modules in the ecosystem's layouts:
import and export of ``heads.eagle.MTPHead``.

``deepseek``: DeepSeek-V3/R1's, inside the target's checkpoint as decoder
layer L = ``num_hidden_layers`` (``num_nextn_predict_layers: 1``):
``model.layers.{L}.enorm``, ``hnorm``, ``eh_proj``, the decoder layer's own
tensors, ``shared_head.norm``, ``shared_head.head`` (optional: else the
target's LM head) and a copy of the target's ``embed_tokens`` (not read:
specjax drafts with the target's). Its next step is fed the layer's
output, as vLLM's ``deepseek_mtp`` feeds it. ``qwen3.5``: Qwen3.5's and
Qwen3-Next's (``mtp_num_hidden_layers: 1``): ``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.layers.0.*``, ``mtp.norm``, the target's embedding and LM head, fed
its normed output (vLLM's ``qwen3_next_mtp``). ``speculators``: vLLM
speculators' (``speculators_model_type: mtp``): the same module as
``mtp_layers.0.input_proj``, ``token_layernorm``, ``hidden_layernorm``,
``final_layernorm`` and the layer, the verifier's config in
``transformer_layer_config``.

All three concatenate the embedding first. The feature is the target's last
hidden state after its final norm. Import is strict, as ``interop``'s: the
module's tensors all there in their shapes, none left over, one module,
a layer specjax's layer library computes (Llama's, Mistral's without a
window, Qwen3's with its q/k norms) and every field that would change its
math honoured or refused by name. DeepSeek-V3's own module (MLA attention,
a mixture of experts) and Qwen3.5's (gated attention, zero-centred norms,
partial RoPE) are refused so, as their targets are.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from specjax.heads.base import HeadConfig
from specjax.heads.interop import (HeadFormatError, check_tensors, field,
                                   layer_fields, layer_from_torch,
                                   layer_shapes, layer_to_torch, read_config,
                                   read_tensors, torch_f32)
from specjax.models.config import ModelConfig

LAYOUTS = ("deepseek", "qwen3.5", "speculators")
# Layers specjax's head layer computes, by model_type: whether it has
# Qwen3's q/k norms.
_LAYERS = {"llama": False, "mistral": False, "qwen3": True}
_NOT_IN_LIBRARY = {
    "deepseek_v3": "MLA attention and a mixture-of-experts MLP",
    "deepseek_v2": "MLA attention and a mixture-of-experts MLP",
    "qwen3_next": "gated attention, zero-centred norms, partial RoPE and a "
                  "mixture-of-experts MLP",
    "qwen3_5_text": "gated attention, zero-centred norms and partial RoPE",
    "qwen3_5_moe_text": "gated attention, zero-centred norms, partial RoPE "
                        "and a mixture-of-experts MLP",
    "glm4_moe": "a mixture-of-experts MLP"}
# How many modules a layout's config says it holds.
_COUNT = {"deepseek": "num_nextn_predict_layers",
          "qwen3.5": "mtp_num_hidden_layers",
          "speculators": "num_nextn_predict_layers"}


def layout_of(conf: dict):
  """The MTP layout a config.json describes, or None (not an MTP module)."""
  if conf.get("speculators_model_type") == "mtp":
    return "speculators"
  if "mtp_num_hidden_layers" in (conf.get("text_config") or conf):
    return "qwen3.5"
  if "num_nextn_predict_layers" in conf:
    return "deepseek"
  return None


def _names(fmt: str, L: int) -> dict:
  """Each parameter of the module (beside its layer's) -> its tensor name;
  ``layer``: the layer's prefix; ``root``: what every tensor it reads
  starts with; ``copy``: a copy of the target's own tensor it carries (not
  read), and what that is."""
  if fmt == "deepseek":
    p = f"model.layers.{L}."
    return dict(root=p, layer=p, fc=p + "eh_proj.weight",
                in_norm=p + "enorm.weight", hidden_norm=p + "hnorm.weight",
                norm=p + "shared_head.norm.weight",
                lm_head=p + "shared_head.head.weight",
                copy=(p + "embed_tokens.weight", "embedding"))
  if fmt == "qwen3.5":
    return dict(root="mtp.", layer="mtp.layers.0.", fc="mtp.fc.weight",
                in_norm="mtp.pre_fc_norm_embedding.weight",
                hidden_norm="mtp.pre_fc_norm_hidden.weight",
                norm="mtp.norm.weight")
  p = "mtp_layers.0."
  return dict(root="", layer=p, fc=p + "input_proj.weight",
              in_norm=p + "token_layernorm.weight",
              hidden_norm=p + "hidden_layernorm.weight",
              norm=p + "final_layernorm.weight",
              copy=("verifier_lm_head.weight", "LM head"))


def import_mtp(path, target: ModelConfig):
  """``(HeadConfig, params (f32 numpy), draft_ids, notes)`` of the MTP
  module in directory ``path`` (any of ``LAYOUTS``: a target's checkpoint
  or the module alone), checked against ``target``. ``params`` lack what
  the module shares with its target (``heads.with_shared`` adds it).
  ``HeadFormatError`` names anything it cannot honour."""
  root = pathlib.Path(path)
  conf = read_config(root)
  fmt = layout_of(conf)
  if fmt is None:
    raise HeadFormatError(f"{root}: config.json describes no MTP module")
  layer = (conf.get("transformer_layer_config") if fmt == "speculators"
           else conf.get("text_config") or conf) or {}
  notes = []
  cfg = _head_config(root, fmt, conf, layer, target, notes)
  names = _names(fmt, cfg.target_layers)
  tensors = read_tensors(root, lambda k: k.startswith(names["root"]))
  copy, what = names.get("copy", (None, None))
  if tensors.pop(copy, None) is not None:
    notes.append(f"{copy} not read: specjax drafts with the target's {what}")
  return cfg, _params(root, cfg, names, tensors), np.arange(
      cfg.draft_vocab, dtype=np.int32), notes


def _head_config(root, fmt, conf, layer, target: ModelConfig, notes
                 ) -> HeadConfig:
  count = (conf.get("text_config") or conf).get(_COUNT[fmt], 1)
  if count != 1:
    raise HeadFormatError(f"{root}: {_COUNT[fmt]} is {count}; specjax drafts "
                          f"with one MTP module, reused at every depth")
  mtype = layer.get("model_type", "llama")
  if mtype not in _LAYERS:
    what = _NOT_IN_LIBRARY.get(mtype, "a layer other than Llama's or "
                               "Qwen3's")
    raise HeadFormatError(f"{root}: the MTP module's layer ({mtype}) has "
                          f"{what}, which specjax's layer library does not "
                          f"compute")
  rope = layer.get("rope_parameters") or {}
  checks = [("hidden_act", layer.get("hidden_act", "silu") == "silu"),
            ("attention_bias", not layer.get("attention_bias", False)),
            ("mlp_bias", not layer.get("mlp_bias", False)),
            ("rope_scaling", not layer.get("rope_scaling")),
            ("rope_parameters.rope_type",
             rope.get("rope_type", "default") == "default"),
            ("partial_rotary_factor",
             layer.get("partial_rotary_factor", 1.0) == 1.0),
            ("use_sliding_window", not layer.get("use_sliding_window")),
            ("sliding_window", mtype != "mistral"
             or not layer.get("sliding_window"))]
  for name, ok in checks:
    if not ok:
      raise HeadFormatError(f"{root}: {name} is set; specjax's MTP layer "
                            f"(plain RoPE, SwiGLU, no biases, full "
                            f"attention) cannot load it exactly")
  need = lambda k: field(root, layer, k)
  D, N = need("hidden_size"), need("num_attention_heads")
  theta = layer.get("rope_theta", rope.get("rope_theta"))
  if theta is None:
    theta = 10000.0
    notes.append("rope_theta not in the file: the Llama default 10000")
  L = need("num_hidden_layers")
  cfg = HeadConfig(
      target_dim=D, target_vocab=need("vocab_size"), target_layers=L,
      taps=(L,), num_heads=N, num_kv_heads=layer.get("num_key_value_heads")
      or N, head_dim=layer.get("head_dim") or D // N,
      ffn_dim=need("intermediate_size"), draft_vocab=need("vocab_size"),
      rope_theta=float(theta), norm_eps=float(layer.get("rms_norm_eps",
                                                        1e-6)),
      variant="mtp", qk_norm=_LAYERS[mtype], feed_normed=fmt != "deepseek")
  try:
    cfg.check_fits(target)
  except ValueError as e:
    raise HeadFormatError(f"{root}: {e}") from None
  return cfg


def _params(root, cfg: HeadConfig, names: dict, tensors: dict) -> dict:
  D = cfg.target_dim
  p = names["layer"]
  want = {names["fc"]: (D, 2 * D), names["in_norm"]: (D,),
          names["hidden_norm"]: (D,), p + "input_layernorm.weight": (D,),
          **layer_shapes(p, cfg, D), names["norm"]: (D,)}
  if "lm_head" in names:
    want[names["lm_head"]] = (cfg.draft_vocab, D)
  check_tensors(root, tensors, want, {names.get("lm_head")},
                "one MTP module")
  t = lambda name: np.asarray(tensors[name], np.float32)
  params = {"fc": {"kernel": t(names["fc"]).T},
            "in_norm": {"scale": t(names["in_norm"])},
            "hidden_norm": {"scale": t(names["hidden_norm"])},
            "layer": {**layer_from_torch(t, p, cfg),
                      "attn_norm": t(p + "input_layernorm.weight")},
            "norm": {"scale": t(names["norm"])}}
  if names.get("lm_head") in tensors:
    params["lm_head"] = {"kernel": t(names["lm_head"]).T}
  return params


def check_export(fmt: str, feed_normed: bool) -> None:
  """ValueError unless an MTP head can be written in ``fmt``: its rule for
  what the next step is fed (``HeadConfig.feed_normed``) must be the
  layout's."""
  if fmt not in LAYOUTS:
    raise ValueError(f"the MTP layouts are {', '.join(LAYOUTS)}, not {fmt!r}")
  if feed_normed != (fmt != "deepseek"):
    fed, other = (("its normed output", "qwen3.5 or speculators")
                  if feed_normed else ("its layer's output", "deepseek"))
    raise ValueError(f"this MTP head feeds {fed} to its next step; the {fmt} "
                     f"layout's modules do not: export it as {other}")


def export_mtp(out_dir, cfg: HeadConfig, params, fmt: str, *,
               target_name: str = "") -> pathlib.Path:
  """Writes the MTP head ``(cfg, params)`` to ``out_dir`` in layout ``fmt``:
  ``config.json``, ``model.safetensors`` (f32, torch layout) and a
  ``README.md``. The deepseek layout carries the head's LM head
  (``shared_head.head``); the others share the target's, as their modules
  do (a head whose LM head is not the target's is then not exported
  exactly: specjax's MTP training keeps it frozen)."""
  from safetensors.numpy import save_file
  check_export(fmt, cfg.feed_normed)
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  names = _names(fmt, cfg.target_layers)
  p = names["layer"]
  tensors = {names["fc"]: torch_f32(params["fc"]["kernel"]),
             names["in_norm"]: torch_f32(params["in_norm"]["scale"]),
             names["hidden_norm"]: torch_f32(params["hidden_norm"]["scale"]),
             p + "input_layernorm.weight": torch_f32(
                 params["layer"]["attn_norm"]),
             **layer_to_torch(params["layer"], p, cfg),
             names["norm"]: torch_f32(params["norm"]["scale"])}
  if "lm_head" in names:
    tensors[names["lm_head"]] = torch_f32(params["lm_head"]["kernel"])
  save_file(tensors, str(out / "model.safetensors"))
  (out / "config.json").write_text(json.dumps(
      _config(cfg, fmt, target_name), indent=2) + "\n")
  (out / "README.md").write_text(_README[fmt])
  return out


def _config(cfg: HeadConfig, fmt: str, target_name: str) -> dict:
  mtype = "qwen3" if cfg.qk_norm else "llama"
  arch = ["Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"]
  layer = dict(layer_fields(cfg), model_type=mtype,
               num_hidden_layers=cfg.target_layers)
  if fmt != "speculators":
    return dict(architectures=arch, **layer, **{_COUNT[fmt]: 1})
  return dict(
      architectures=["MTPDraftModel"], speculators_model_type="mtp",
      num_nextn_predict_layers=1, transformer_layer_config=layer,
      speculators_config=dict(
          algorithm="mtp", default_proposal_method="greedy",
          proposal_methods=[dict(proposal_type="greedy",
                                 speculative_tokens=3)],
          verifier=dict(name_or_path=target_name or None,
                        architectures=arch)))


_README = {
    "deepseek": "# MTP module exported by specjax (DeepSeek-V3 layout)\n\n"
                "`model.layers.{L}.*` with L the target's layer count, as "
                "DeepSeek-V3 stores its module inside its checkpoint: put "
                "`model.safetensors` beside the target's shards (renamed) "
                "and add `num_nextn_predict_layers: 1` to its config.json. "
                "The next draft step is fed the layer's output (vLLM's "
                "`deepseek_mtp`).\n",
    "qwen3.5": "# MTP module exported by specjax (Qwen3.5 layout)\n\n"
               "`mtp.*`, embedding and LM head the target's; the next draft "
               "step is fed the module's normed output.\n",
    "speculators": "# MTP module exported by specjax (vLLM speculators "
                   "layout)\n\nspeculators' `MTPDraftModel`; embedding and "
                   "LM head the verifier's.\n"}
