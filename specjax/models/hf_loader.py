"""Loading HF checkpoint directories (config.json + *.safetensors).

Llama 1/2/3, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text) and Phi-3 are
one decoder (``specjax.models.decoder``) whose differences are
``ModelConfig`` fields. ``config_from_hf`` reads every config.json field
that changes the math and honours it or refuses the checkpoint naming it; a
field it neither reads nor knows to be inert (dropout, generation defaults,
bookkeeping: ``INERT``) is refused too, so a checkpoint is never loaded and
decoded differently from transformers. docs/DESIGN.md lists each
architecture's fields and their outcome. transformers 5 keeps RoPE settings
in ``rope_parameters`` (Gemma 3: one entry per layer type); the older
``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` are read too.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Optional

import jax.numpy as jnp
from safetensors import safe_open

from specjax.models.config import FULL, SLIDING, ModelConfig, RopeScaling
from specjax.models.weights import WeightError, params_from_getter

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2",
                         "gemma3_text", "phi3")
# Fields with no effect on an inference forward (dropout is off, generation
# defaults are not ours: sampling is explicit, ids only label tokens).
INERT = frozenset("""
  architectures transformers_version torch_dtype dtype _name_or_path use_cache
  pad_token_id initializer_range attention_dropout embd_pdrop resid_pdrop
  hidden_dropout mlp_dropout output_attentions output_hidden_states
  return_dict use_return_dict torchscript pretraining_tp tokenizer_class
  id2label label2id problem_type is_decoder is_encoder_decoder
  add_cross_attention tie_encoder_decoder chunk_size_feed_forward prefix
  sep_token_id decoder_start_token_id task_specific_params finetuning_task
  cross_attention_hidden_size max_length min_length do_sample early_stopping
  num_beams num_beam_groups diversity_penalty temperature top_k top_p
  typical_p repetition_penalty length_penalty no_repeat_ngram_size
  encoder_no_repeat_ngram_size bad_words_ids num_return_sequences
  output_scores return_dict_in_generate forced_bos_token_id
  forced_eos_token_id remove_invalid_values exponential_decay_length_penalty
  suppress_tokens begin_suppress_tokens tf_legacy_loss use_bfloat16
  pruned_heads
""".split()) | {
    # A multi-token-prediction module beside the decoder (DeepSeek-V3's,
    # Qwen3.5's): not part of its forward; ``--method mtp --head DIR`` reads
    # it (``heads.mtp_interop``).
    "num_nextn_predict_layers", "mtp_num_hidden_layers"}

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu",
               "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}

# Per architecture: transformers' class defaults for the fields whose
# absence from config.json matters, and the fields its modeling code never
# reads (Mistral has no biases whatever ``attention_bias`` says; Gemma 3
# stores ``attn_logit_softcapping`` but never applies it).
_COMMON = dict(rms_norm_eps=1e-6, max_position_embeddings=2048,
               tie_word_embeddings=False, sliding_window=None)
DEFAULTS = {
    "llama": _COMMON,
    "mistral": {**_COMMON, "sliding_window": 4096, "num_key_value_heads": 8},
    "qwen2": {**_COMMON, "num_key_value_heads": 32, "sliding_window": 4096,
              "max_window_layers": 28},
    "qwen3": {**_COMMON, "num_key_value_heads": 32, "sliding_window": 4096,
              "max_window_layers": 28, "head_dim": 128},
    "gemma2": {**_COMMON, "num_key_value_heads": 4, "head_dim": 256,
               "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
               "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {**_COMMON, "num_key_value_heads": 4, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "tie_word_embeddings": True,
                    "hidden_activation": "gelu_pytorch_tanh"},
    "phi3": {**_COMMON, "rms_norm_eps": 1e-5},
}
IGNORED = {
    "llama": {"sliding_window"},
    "mistral": {"attention_bias", "mlp_bias", "layer_types"},
    "qwen2": {"attention_bias", "mlp_bias"},
    "qwen3": {"mlp_bias"},
    "gemma2": {"mlp_bias", "hidden_act", "use_bidirectional_attention"},
    "gemma3_text": {"mlp_bias", "hidden_act", "attn_logit_softcapping"},
    "phi3": {"attention_bias", "mlp_bias", "layer_types"},
}
GEMMA = ("gemma2", "gemma3_text")


class _Fields:
  """config.json as read, over the architecture's defaults: remembers which
  fields were looked at, so ``unread`` names the ones nothing honoured."""

  def __init__(self, raw: dict, defaults: dict):
    self.raw, self.defaults, self.read = raw, defaults, set()

  def get(self, key: str, default: Any = None) -> Any:
    """The field's value: config.json's (null included), else the class
    default, else ``default``."""
    self.read.add(key)
    if key in self.raw:
      return self.raw[key]
    return self.defaults.get(key, default)

  def mark(self, *keys: str) -> None:
    """Counts ``keys`` as read: fields whose every value is honoured."""
    self.read.update(keys)

  def unread(self) -> list[str]:
    return sorted(set(self.raw) - self.read - INERT)


def _refuse(mtype: str, what: str):
  raise WeightError(f"{mtype}: {what} is not supported")


def _rope_entry(mtype: str, rp: dict, where: str) -> tuple[float,
                                                           Optional[RopeScaling]]:
  """One RoPE settings dict -> ``(theta, scaling)``; refuses what it cannot
  honour (another rope type, partial rotary, unknown keys)."""
  rp = dict(rp)
  theta = float(rp.pop("rope_theta", 10000.0))
  kind = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
  rp.pop("type", None)
  partial = rp.pop("partial_rotary_factor", 1.0)
  if partial not in (1, 1.0, None):
    _refuse(mtype, f"{where} partial_rotary_factor={partial}")
  if kind == "default":
    scaling = None
    rp.pop("original_max_position_embeddings", None)  # read by none
  elif kind == "linear":
    scaling = RopeScaling(factor=float(rp.pop("factor")), kind="linear")
  elif kind == "llama3":
    scaling = RopeScaling(
        factor=float(rp.pop("factor")),
        low_freq_factor=float(rp.pop("low_freq_factor")),
        high_freq_factor=float(rp.pop("high_freq_factor")),
        original_max_position=int(rp.pop("original_max_position_embeddings")))
  else:
    raise WeightError(f"{mtype}: unsupported rope scaling {kind!r} in {where} "
                      f"(supported: default, linear, llama3)")
  if rp:
    _refuse(mtype, f"{where} field(s) {', '.join(sorted(rp))}")
  return theta, scaling


def _legacy_rope(f: _Fields) -> dict:
  """transformers 4's spelling (top-level ``rope_theta``, ``rope_scaling``,
  ``partial_rotary_factor``) as one settings dict."""
  rp = dict(f.get("rope_scaling") or {})
  for key in ("rope_theta", "partial_rotary_factor"):
    if f.get(key) is not None:
      rp.setdefault(key, f.get(key))
  return rp


def _rope(f: _Fields, mtype: str):
  """``(theta, scaling, local_theta)`` of the full (and Gemma 3's sliding)
  layers."""
  rp, legacy = dict(f.get("rope_parameters") or {}), _legacy_rope(f)
  if mtype == "gemma3_text":
    full = rp.get("full_attention") or {"rope_theta": 1e6, **legacy}
    local = rp.get("sliding_attention") or {
        "rope_theta": f.get("rope_local_base_freq") or 1e4}
    theta, scaling = _rope_entry(mtype, full, "full-attention rope")
    local_theta, local_scaling = _rope_entry(mtype, local, "sliding rope")
    if local_scaling is not None:
      _refuse(mtype, "a scaled rope on the sliding layers")
    return theta, scaling, local_theta
  theta, scaling = _rope_entry(mtype, {**rp, **legacy}, "rope")
  return theta, scaling, None


def _layer_types(f: _Fields, mtype: str, num_layers: int,
                 window: Optional[int]) -> tuple[str, ...]:
  """``FULL``/``SLIDING`` per layer: config.json's ``layer_types`` where
  the architecture reads them, else its own rule."""
  names = {"full_attention": FULL, "sliding_attention": SLIDING,
           "attention": FULL}
  given = None if mtype in ("mistral", "phi3") else f.get("layer_types")
  if mtype == "gemma3_text":  # what layer_types were made from
    f.mark("sliding_window_pattern", "_sliding_window_pattern")
  if mtype in ("qwen2", "qwen3"):
    f.mark("max_window_layers")
  if given is not None:
    unknown = sorted(set(given) - set(names))
    if unknown:
      _refuse(mtype, f"layer type {unknown[0]!r}")
    if len(given) != num_layers:
      _refuse(mtype, f"layer_types of {len(given)} entries for "
                     f"{num_layers} layers")
    types = tuple(names[t] for t in given)
  elif mtype == "gemma2":
    types = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
  elif mtype == "gemma3_text":
    every = int(f.get("sliding_window_pattern")
                or f.get("_sliding_window_pattern") or 6)
    types = tuple(SLIDING if (i + 1) % every else FULL
                  for i in range(num_layers))
  elif mtype in ("qwen2", "qwen3"):
    start = int(f.get("max_window_layers"))
    types = tuple(SLIDING if window and i >= start else FULL
                  for i in range(num_layers))
  elif mtype in ("mistral", "phi3"):  # every layer, when there is a window
    types = (SLIDING if window else FULL,) * num_layers
  else:
    types = ()
  if SLIDING in types and not window:
    _refuse(mtype, "sliding layers without a sliding_window")
  return types if SLIDING in types else ()


def _window(f: _Fields, mtype: str) -> Optional[int]:
  if mtype == "llama":
    return None
  window = f.get("sliding_window")
  if mtype in ("qwen2", "qwen3") and not f.get("use_sliding_window", False):
    window = None
  if window is not None and (not isinstance(window, int) or window < 1):
    _refuse(mtype, f"sliding_window={window}")
  return window


def _activation(f: _Fields, mtype: str) -> str:
  key = "hidden_activation" if mtype in GEMMA else "hidden_act"
  act = f.get(key, "silu")
  if act not in ACTIVATIONS:
    raise WeightError(f"{mtype}: unsupported {key} {act!r} "
                      f"(supported: {', '.join(ACTIVATIONS)})")
  return ACTIVATIONS[act]


def config_from_hf(cfg: dict, name: str = "hf") -> ModelConfig:
  """The ``ModelConfig`` of a config.json; ``WeightError`` naming the first
  field it cannot honour."""
  if not isinstance(cfg, dict):
    raise WeightError("config.json is not a JSON object")
  mtype = cfg.get("model_type")
  if mtype not in SUPPORTED_MODEL_TYPES:
    raise WeightError(f"unsupported model_type {mtype!r} "
                      f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
  f = _Fields(cfg, DEFAULTS[mtype])
  f.mark("model_type", *IGNORED[mtype])
  missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                         "num_attention_heads", "intermediate_size")
             if f.get(k) is None]
  if missing:
    raise WeightError(f"config.json lacks {', '.join(missing)}")
  if mtype == "gemma3_text" and f.get("use_bidirectional_attention"):
    _refuse(mtype, "use_bidirectional_attention=true")
  heads, dim = int(f.get("num_attention_heads")), int(f.get("hidden_size"))
  layers = int(f.get("num_hidden_layers"))
  head_dim = int(f.get("head_dim") or dim // heads)
  theta, scaling, local_theta = _rope(f, mtype)
  window = _window(f, mtype)
  types = _layer_types(f, mtype, layers, window)
  gemma = mtype in GEMMA
  bias = mtype not in ("mistral", "qwen2", "phi3") and bool(
      f.get("attention_bias", False))
  eos = f.get("eos_token_id")
  eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  out = ModelConfig(
      vocab_size=int(f.get("vocab_size")), dim=dim, num_layers=layers,
      num_heads=heads,
      num_kv_heads=int(f.get("num_key_value_heads") or heads),
      head_dim=head_dim, ffn_dim=int(f.get("intermediate_size")),
      rope_theta=theta, norm_eps=float(f.get("rms_norm_eps")),
      tie_embeddings=bool(f.get("tie_word_embeddings")),
      qkv_bias=mtype == "qwen2" or bias, o_bias=bias,
      mlp_bias=mtype == "llama" and bool(f.get("mlp_bias", False)),
      rope_scaling=scaling,
      max_position=int(f.get("max_position_embeddings")),
      bos_id=f.get("bos_token_id"), eos_ids=tuple(int(e) for e in eos),
      name=name, activation=_activation(f, mtype),
      norm_offset=1.0 if gemma else 0.0,
      qk_norm=mtype in ("qwen3", "gemma3_text"), sandwich_norms=gemma,
      query_scale=(float(f.get("query_pre_attn_scalar")) ** -0.5
                   if gemma else None),
      attn_logit_cap=(_cap(f.get("attn_logit_softcapping"))
                      if mtype == "gemma2" else None),
      final_logit_cap=(_cap(f.get("final_logit_softcapping"))
                       if gemma else None),
      embed_scale=math.sqrt(dim) if gemma else None,
      sliding_window=window if types else None, layer_types=types,
      local_rope_theta=local_theta)
  if mtype == "phi3":
    f.mark("original_max_position_embeddings")  # only longrope reads it
  unread = f.unread()
  if unread:
    raise WeightError(f"{mtype}: config field(s) {', '.join(unread)} not "
                      f"supported (specjax cannot tell they leave the "
                      f"forward unchanged)")
  return out


def _cap(value) -> Optional[float]:
  return None if value is None else float(value)


def load_hf(path: str | pathlib.Path, dtype=jnp.float32):
  """Returns ``(config, params)`` from a checkpoint directory."""
  path = pathlib.Path(path)
  cfg_file = path / "config.json"
  if not cfg_file.is_file():
    raise FileNotFoundError(f"no config.json in {path}")
  try:
    raw = json.loads(cfg_file.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise WeightError(f"{cfg_file} is not valid JSON: {e}") from None
  cfg = config_from_hf(raw, path.name)
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  handles = [safe_open(str(f), framework="numpy") for f in files]
  where = {name: h for h in handles for name in h.keys()}

  def get(name: str):
    h = where.get(name)
    return None if h is None else h.get_tensor(name)

  return cfg, params_from_getter(get, cfg, dtype,
                                 fused=raw.get("model_type") == "phi3")
