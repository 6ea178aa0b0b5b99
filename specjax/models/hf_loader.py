"""Loading HF checkpoint directories (config.json + *.safetensors).

Llama, Mistral and Qwen2 share one decoder shape; the differences that matter
here are q/k/v biases (Qwen2, or Llama's ``attention_bias``), tied embeddings,
``rope_theta`` and Llama-3 rope scaling. transformers 5 moved ``rope_theta``
and ``rope_scaling`` into ``rope_parameters``; both spellings are read.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
from safetensors import safe_open

from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.weights import WeightError, params_from_getter

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _rope(cfg: dict) -> tuple[float, RopeScaling | None]:
  rp = dict(cfg.get("rope_parameters") or {})
  scaling = cfg.get("rope_scaling") or rp
  theta = float(cfg.get("rope_theta", rp.get("rope_theta", 10000.0)))
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind in ("default", None):
    return theta, None
  if kind != "llama3":
    raise WeightError(f"unsupported rope scaling {kind!r} (supported: llama3)")
  return theta, RopeScaling(
      factor=float(scaling["factor"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position=int(scaling["original_max_position_embeddings"]))


def config_from_hf(cfg: dict, name: str = "hf") -> ModelConfig:
  if not isinstance(cfg, dict):
    raise WeightError("config.json is not a JSON object")
  missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                         "num_attention_heads", "intermediate_size")
             if k not in cfg]
  mtype = cfg.get("model_type")
  if mtype not in SUPPORTED_MODEL_TYPES:
    raise WeightError(f"unsupported model_type {mtype!r} "
                      f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
  if missing:
    raise WeightError(f"config.json lacks {', '.join(missing)}")
  heads = int(cfg["num_attention_heads"])
  dim = int(cfg["hidden_size"])
  theta, scaling = _rope(cfg)
  eos = cfg.get("eos_token_id")
  eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  return ModelConfig(
      vocab_size=int(cfg["vocab_size"]), dim=dim,
      num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
      num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
      head_dim=int(cfg.get("head_dim") or dim // heads),
      ffn_dim=int(cfg["intermediate_size"]), rope_theta=theta,
      norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      qkv_bias=mtype == "qwen2" or bool(cfg.get("attention_bias", False)),
      rope_scaling=scaling,
      max_position=int(cfg.get("max_position_embeddings", 2048)),
      bos_id=cfg.get("bos_token_id"), eos_ids=tuple(int(e) for e in eos),
      name=name)


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

  return cfg, params_from_getter(get, cfg, dtype)
