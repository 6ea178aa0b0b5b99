"""Loading Llama-family weights and config from a GGUF file (llama.cpp format).

Quantized tensors are dequantized to the working dtype with the ``gguf``
package (on XLA CPU an int8->f32 convert inside a matmul is not fused, so a
quantized compute path would be slower than f32: see docs/DESIGN.md).
"""

from __future__ import annotations

import pathlib
from typing import Optional

import gguf
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.weights import WeightError, params_from_getter

SUPPORTED_ARCHS = ("llama", "qwen2")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str) -> Optional[str]:
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  parts = gguf_name.split(".", 2)
  if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
  return None


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's per-head Q/K row permutation (interleaved -> half-split).

  llama.cpp's converter reorders each head's rows from HF's rotate-half layout
  to interleaved pairs. ``num_heads`` is N for Q and **G (kv heads) for K**.
  Works for weights ``(out, in)`` and biases ``(out,)``.
  """
  half = w.shape[0] // num_heads // 2
  return (w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def _gguf_names(num_layers: int):
  yield from _GLOBAL_NAMES
  for i in range(num_layers):
    for suffix in _LAYER_NAMES:
      yield f"blk.{i}.{suffix}"


_REQUIRED = object()


def metadata(reader: gguf.GGUFReader, key: str, default=_REQUIRED):
  """A GGUF metadata value; without a default, a missing key is an error."""
  f = reader.fields.get(key)
  if f is not None:
    return f.contents()
  if default is _REQUIRED:
    raise WeightError(f"GGUF file has no {key!r} metadata")
  return default


# The architecture's metadata keys this loader reads; any other (a sliding
# window, rope scaling, experts, soft-caps) would change the math: refused.
_READ_KEYS = frozenset("""
  context_length embedding_length block_count feed_forward_length
  attention.head_count attention.head_count_kv attention.key_length
  attention.value_length rope.dimension_count rope.freq_base
  attention.layer_norm_rms_epsilon vocab_size
""".split())


def _refuse_unread(reader: gguf.GGUFReader, arch: str) -> None:
  """WeightError naming the first architecture key or tensor that nothing
  here would honour; also a head size the keys disagree on (partial
  rotary, other value heads)."""
  prefix = f"{arch}."
  unread = sorted(k[len(prefix):] for k in reader.fields
                  if k.startswith(prefix) and k[len(prefix):] not in _READ_KEYS)
  if unread:
    raise WeightError(f"GGUF metadata {prefix}{unread[0]} is not supported")
  unknown = sorted(t.name for t in reader.tensors if _hf_name(t.name) is None)
  if unknown:
    raise WeightError(f"GGUF tensor {unknown[0]!r} is not supported")
  sizes = {k: metadata(reader, prefix + k, None) for k in (
      "attention.key_length", "attention.value_length", "rope.dimension_count")}
  if len({v for v in sizes.values() if v is not None}) > 1:
    raise WeightError(f"GGUF head sizes disagree ({sizes}): partial rotary "
                      "or other value heads are not supported")


def config_from_gguf(reader: gguf.GGUFReader, name: str = "gguf") -> ModelConfig:
  arch = metadata(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise WeightError(f"unsupported GGUF architecture {arch!r} "
                      f"(supported: {', '.join(SUPPORTED_ARCHS)})")
  if any(t.name == "rope_freqs.weight" for t in reader.tensors):
    raise WeightError("GGUF with rope_freqs (llama3 rope scaling) is not "
                      "supported; load the HF checkpoint directory instead")

  def a(key, default=_REQUIRED):
    return metadata(reader, f"{arch}.{key}", default)

  _refuse_unread(reader, arch)

  dim, heads = a("embedding_length"), a("attention.head_count")
  tokens = metadata(reader, "tokenizer.ggml.tokens", None)
  has_output = any(t.name == "output.weight" for t in reader.tensors)
  has_bias = any(t.name.endswith("attn_q.bias") for t in reader.tensors)
  eos = metadata(reader, "tokenizer.ggml.eos_token_id", None)
  return ModelConfig(
      vocab_size=int(a("vocab_size", len(tokens) if tokens else 0)),
      dim=int(dim),
      num_layers=int(a("block_count")),
      num_heads=int(heads),
      num_kv_heads=int(a("attention.head_count_kv", heads)),
      head_dim=int(a("attention.key_length", a("rope.dimension_count",
                                               dim // heads))),
      ffn_dim=int(a("feed_forward_length")),
      rope_theta=float(a("rope.freq_base", 10000.0)),
      norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
      tie_embeddings=not has_output,
      qkv_bias=has_bias,
      max_position=int(a("context_length", 2048)),
      bos_id=metadata(reader, "tokenizer.ggml.bos_token_id", None),
      eos_ids=() if eos is None else (int(eos),),
      name=name)


def load_gguf(path: str | pathlib.Path, dtype=jnp.float32, name: str = ""):
  """Returns ``(config, params, reader)``; the reader also feeds the tokenizer."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {path}")
  reader = gguf.GGUFReader(str(path))
  cfg = config_from_gguf(reader, name or path.stem)
  arch = metadata(reader, "general.architecture")
  gguf_names = {_hf_name(g): g for g in _gguf_names(cfg.num_layers)}
  by_name = {}
  for t in reader.tensors:
    hf = _hf_name(t.name)
    if hf is not None:
      by_name[hf] = t

  def get(hf_name: str) -> Optional[np.ndarray]:
    t = by_name.get(hf_name)
    if t is None:  # only tensors the config requires are ever asked for
      raise WeightError(f"GGUF file is missing tensor "
                        f"{gguf_names.get(hf_name, hf_name)!r} ({hf_name})")
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

  return cfg, params_from_getter(get, cfg, dtype), reader
