"""Loading a decoder's weights and config from a GGUF file (llama.cpp's
format): the ``llama`` (also what llama.cpp converts Mistral to), ``qwen2``,
``qwen3``, ``gemma2``, ``gemma3`` and ``phi3`` architectures.

A GGUF file says what llama.cpp computes, so it is read as llama.cpp reads
it: the architecture's metadata becomes the config.json fields transformers
would carry (``hf_fields``) and goes through ``hf_loader.config_from_hf``
(one config path, with its refusals), then what the file format fixes
differently: biases wherever the file has them, Gemma's norms stored as
``1 + w`` (the converter adds the 1), Gemma's attention scale from the head
size (llama.cpp's rule; 27B models: ``D / N``), Gemma 3's sliding-layer RoPE
base defaulting to 10,000. Tensors are found by transformers' names through
gguf's own per-architecture map (``gguf.get_tensor_name_map``); Llama's Q/K
rows are un-permuted (the converter interleaves them). A metadata key of the
architecture or a tensor that nothing here reads is refused by name, as are
quantizations gguf cannot dequantize (the rest are dequantized to the working
dtype: on XLA CPU an int8->f32 convert inside a matmul is not fused, so a
quantized compute path would be slower than f32; docs/DESIGN.md).
"""

from __future__ import annotations

import dataclasses
import pathlib
import struct
from typing import Optional

import gguf
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.hf_loader import config_from_hf
from specjax.models.weights import WeightError, params_from_getter

# GGUF architecture -> transformers' model_type.
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
SUPPORTED_ARCHS = tuple(MODEL_TYPES)

# ``{arch}.`` metadata keys -> the config.json field each carries: every
# architecture's, then each one's own (a key another architecture carries,
# e.g. a sliding window in a Llama file, is refused: llama.cpp ignores it).
_FIELDS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_WINDOW = {"attention.sliding_window": "sliding_window"}
_OWN_FIELDS = {
    "gemma2": {**_WINDOW, "attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping",
               "attention.sliding_window_pattern": None},
    "gemma3": {**_WINDOW, "final_logit_softcapping": "final_logit_softcapping",
               "attention.sliding_window_pattern": None},
    "phi3": _WINDOW,
}
# Read as RoPE settings (``_rope``, ``hf_fields``) or checked against the
# head size.
_ROPE_KEYS = {"rope.freq_base", "rope.scaling.type", "rope.scaling.factor"}
_OWN_ROPE_KEYS = {"gemma2": {"rope.freq_base_swa"},
                  "gemma3": {"rope.freq_base_swa"},
                  "phi3": {"rope.scaling.original_context_length"}}
# Gemma's sliding layers: llama.cpp's default pattern (every n-th layer
# full) and, for Gemma 3, no window at all without the key.
_PATTERN = {"gemma2": 2, "gemma3": 6}
_SIZE_KEYS = ("attention.value_length", "rope.dimension_count")
GEMMA = ("gemma2", "gemma3")
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's size rule

_REQUIRED = object()


def metadata(reader: gguf.GGUFReader, key: str, default=_REQUIRED):
  """A GGUF metadata value; without a default, a missing key is an error."""
  f = reader.fields.get(key)
  if f is not None:
    return f.contents()
  if default is _REQUIRED:
    raise WeightError(f"GGUF file has no {key!r} metadata")
  return default


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's per-head Q/K row permutation (interleaved -> half-split).

  llama.cpp's converter reorders each head's rows from HF's rotate-half layout
  to interleaved pairs. ``num_heads`` is N for Q and **G (kv heads) for K**.
  Works for weights ``(out, in)`` and biases ``(out,)``.
  """
  half = w.shape[0] // num_heads // 2
  return (w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def _arch(reader: gguf.GGUFReader) -> str:
  arch = metadata(reader, "general.architecture")
  if arch not in MODEL_TYPES:
    raise WeightError(f"unsupported GGUF architecture {arch!r} "
                      f"(supported: {', '.join(SUPPORTED_ARCHS)})")
  return arch


def _rope(a, arch: str) -> dict:
  """The ``rope_parameters`` transformers would carry: the file's base and
  linear scaling (other kinds refused), and Gemma 3's sliding-layer base."""
  kind = a("rope.scaling.type", "none")
  if kind not in ("none", "linear"):
    raise WeightError(f"GGUF rope scaling {kind!r} is not supported "
                      f"(supported: none, linear)")
  full = {"rope_theta": float(a("rope.freq_base", 10000.0))}
  if kind == "linear":
    full.update(rope_type="linear", factor=float(a("rope.scaling.factor")))
  if arch != "gemma3":
    return full
  return {"full_attention": full, "sliding_attention": {
      "rope_theta": float(a("rope.freq_base_swa", 10000.0))}}


def hf_fields(reader: gguf.GGUFReader) -> dict:
  """The file's metadata as the config.json transformers would read:
  ``model_type`` and the fields of ``_FIELDS``, the RoPE settings, a tied
  LM head when the file has no ``output.weight``, the special ids. Refuses
  an architecture key nothing reads and a head size the keys disagree on
  (partial rotary, other value heads)."""
  arch = _arch(reader)
  prefix = f"{arch}."
  a = lambda key, default=_REQUIRED: metadata(reader, prefix + key, default)
  fields = {**_FIELDS, **_OWN_FIELDS.get(arch, {})}
  known = (set(fields) | _ROPE_KEYS | _OWN_ROPE_KEYS.get(arch, set())
           | set(_SIZE_KEYS))
  unread = sorted(k[len(prefix):] for k in reader.fields
                  if k.startswith(prefix) and k[len(prefix):] not in known)
  if unread:
    raise WeightError(f"GGUF metadata {prefix}{unread[0]} is not supported")
  if arch == "phi3" and a("rope.scaling.original_context_length", None) not in (
      None, a("context_length")):
    raise WeightError("GGUF phi3 with a longer context than it was trained "
                      "for (longrope) is not supported")
  for key in ("embedding_length", "block_count", "feed_forward_length",
              "attention.head_count"):
    if not isinstance(a(key), int) or a(key) < 1:
      raise WeightError(f"GGUF {prefix}{key} is {a(key)!r}, not a size")
  raw = {field: a(key) for key, field in fields.items()
         if field and prefix + key in reader.fields}
  tokens = metadata(reader, "tokenizer.ggml.tokens", None)
  raw.setdefault("vocab_size", len(tokens) if tokens else 0)
  raw["head_dim"] = int(raw.get("head_dim") or raw["hidden_size"]
                        // raw["num_attention_heads"])
  sizes = {k: a(k, None) for k in _SIZE_KEYS}
  if any(v is not None and v != raw["head_dim"] for v in sizes.values()):
    raise WeightError(f"GGUF head sizes disagree ({sizes}, key_length "
                      f"{raw['head_dim']}): partial rotary or other value "
                      "heads are not supported")
  names = {t.name for t in reader.tensors}
  if "rope_freqs.weight" in names:
    raise WeightError("GGUF with rope_freqs (llama3 or long rope scaling) is "
                      "not supported; load the HF checkpoint directory instead")
  raw.update(model_type=MODEL_TYPES[arch], rope_parameters=_rope(a, arch),
             tie_word_embeddings="output.weight" not in names,
             bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id", None),
             eos_token_id=metadata(reader, "tokenizer.ggml.eos_token_id", None))
  if arch in GEMMA:
    big = raw["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    raw["query_pre_attn_scalar"] = (raw["hidden_size"] //
                                    raw["num_attention_heads"] if big
                                    else raw["head_dim"])
    raw.update(_gemma_windows(a, arch, raw))
  return raw


def _gemma_windows(a, arch: str, raw: dict) -> dict:
  """Gemma's ``sliding_window`` and ``layer_types`` as llama.cpp reads
  them: the pattern key (a per-layer list, or n: every n-th layer full;
  default ``_PATTERN``), the window (Gemma 2's default 4096; a Gemma 3 file
  without one has no sliding layers), Gemma 2's sliding-layer RoPE base
  (only the full layers' is supported)."""
  if arch == "gemma2" and a("rope.freq_base_swa", None) not in (
      None, raw["rope_parameters"]["rope_theta"]):
    raise WeightError("GGUF gemma2 with its own rope.freq_base_swa is not "
                      "supported")
  window = raw.get("sliding_window", 4096 if arch == "gemma2" else 0)
  L = raw["num_hidden_layers"]
  pattern = a("attention.sliding_window_pattern", _PATTERN[arch])
  if not window:
    sliding = [False] * L
  elif isinstance(pattern, list):
    sliding = [bool(p) for p in pattern]
  else:
    n = int(pattern)
    sliding = [n == 0 or i % n < n - 1 for i in range(L)]
  names = ["sliding_attention" if s else "full_attention" for s in sliding]
  return dict(sliding_window=window or None, layer_types=names)


def config_from_gguf(reader: gguf.GGUFReader, name: str = "gguf") -> ModelConfig:
  """The ``ModelConfig`` of a GGUF file (see the module doc)."""
  arch = _arch(reader)
  cfg = config_from_hf(hf_fields(reader), name)
  names = {t.name.split(".", 2)[-1] for t in reader.tensors}
  cfg = dataclasses.replace(
      cfg, qkv_bias="attn_q.bias" in names, o_bias="attn_output.bias" in names,
      mlp_bias="ffn_up.bias" in names)
  if arch in GEMMA:  # the file holds 1 + w
    cfg = dataclasses.replace(cfg, norm_offset=0.0)
  return cfg


def load_gguf(path: str | pathlib.Path, dtype=jnp.float32, name: str = ""):
  """Returns ``(config, params, reader)``; the reader also feeds the tokenizer."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    reader = gguf.GGUFReader(str(path))
  except (ValueError, KeyError, IndexError, OverflowError, struct.error) as e:
    raise WeightError(f"cannot read GGUF file {str(path)!r}: truncated or "
                      f"damaged ({type(e).__name__}: {e})") from None
  cfg = config_from_gguf(reader, name or path.stem)
  arch = _arch(reader)
  enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
  names = gguf.get_tensor_name_map(enum, cfg.num_layers)
  tensors = {t.name: t for t in reader.tensors}
  used = set()

  def get(hf_name: str) -> Optional[np.ndarray]:
    g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    t = tensors.get(g)
    if t is None:  # only tensors the config requires are ever asked for
      raise WeightError(f"GGUF file is missing tensor {g or hf_name!r} "
                        f"({hf_name})")
    used.add(g)
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise WeightError(f"tensor {t.name!r} uses quantization "
                        f"{t.tensor_type.name}, which gguf cannot dequantize"
                        ) from None
    w = np.asarray(w, np.float32).reshape([int(n) for n in reversed(t.shape)])
    if arch == "llama" and ".q_proj." in hf_name:
      w = unpermute_rope(w, cfg.num_heads)
    elif arch == "llama" and ".k_proj." in hf_name:
      w = unpermute_rope(w, cfg.num_kv_heads)
    return w

  params = params_from_getter(get, cfg, dtype, fused=arch == "phi3")
  unused = sorted(set(tensors) - used)
  if unused:
    raise WeightError(f"GGUF tensor {unused[0]!r} is not supported")
  return cfg, params, reader
