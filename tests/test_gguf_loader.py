"""GGUF loader on tiny GGUF files from random transformers models.

Independent of the real SmolLM2 file. Llama files are written here with
``gguf.GGUFWriter`` the way llama.cpp's convert_hf_to_gguf.py does it (Q and K
rows permuted per head, K by the kv-head count), to pin metadata -> config,
dequantization, the inverse permutation, tied/untied LM heads and the errors;
every architecture is also converted by llama.cpp's own converter
(``tiny_hf.to_gguf``) and checked against transformers.
"""

import copy
import re
import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QType

from specjax.models import decoder, gguf_loader, layers
from specjax.models.gguf_loader import load_gguf
from specjax.models.hf_loader import config_from_hf, load_hf
from specjax.models.registry import load_model
from specjax.models.weights import WeightError
from tests.tiny_hf import GGUF_CONFIGS, make_tiny, to_gguf

T, S = 11, 16


def _own_config(tied: bool) -> transformers.LlamaConfig:
  """Dims all different and quantizable: every row length (hidden 64, N*H 32,
  ffn 96) is a multiple of the 32-wide Q4/Q8 blocks; head_dim 8 is not
  hidden / heads, so the loader must read it from the metadata."""
  return transformers.LlamaConfig(
      vocab_size=40, hidden_size=64, intermediate_size=96,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
      tie_word_embeddings=tied, max_position_embeddings=64)


def _randomized(config: transformers.LlamaConfig, seed: int = 0):
  """A transformers Llama with every weight (norms too) randomized."""
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """name -> transformers model; each built once per module."""
  return {
      "llama_gqa_tied": make_tiny("llama_gqa_tied",
                                  tmp_path_factory.mktemp("gqa")),
      "own_tied": _randomized(_own_config(tied=True)),
      "own_untied": _randomized(_own_config(tied=False), seed=1),
  }


# --- Writing GGUF the way llama.cpp's converter does. ----------------------

def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """convert_hf_to_gguf.py ``LlamaModel.permute``: HF rotate-half rows ->
  llama.cpp interleaved rows, per head (the reference the loader inverts)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _gguf_name(hf: str) -> str:
  glob = {"model.embed_tokens.weight": "token_embd.weight",
          "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
  if hf in glob:
    return glob[hf]
  layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output",
           "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
           "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  _, _, i, rest = hf.split(".", 3)
  return f"blk.{i}.{layer[rest.removesuffix('.weight')]}.weight"


def _rows_moved(hf: str, config) -> int | None:
  """The head count whose permutation llama.cpp applies to this tensor."""
  if ".q_proj." in hf:
    return config.num_attention_heads
  if ".k_proj." in hf:
    return config.num_key_value_heads
  return None


def _gguf_tensors(model) -> dict[str, np.ndarray]:
  """llama.cpp-named f32 tensors in torch ``(out, in)`` layout, Q/K permuted;
  ``output.weight`` only when the embeddings are untied."""
  config = model.config
  out = {}
  for hf, t in model.state_dict().items():
    if hf == "lm_head.weight" and config.tie_word_embeddings:
      continue
    w = t.numpy().astype(np.float32)
    n = _rows_moved(hf, config)
    out[_gguf_name(hf)] = w if n is None else _permute(w, n)
  return out


def _stored(w: np.ndarray, qtype: QType):
  """What the writer gets for ``w``: norms (1-D) stay F32 as in llama.cpp."""
  if w.ndim == 1 or qtype == QType.F32:
    return w.astype(np.float32), None
  if qtype == QType.F16:
    return w.astype(np.float16), None
  return gguf.quants.quantize(w, qtype), qtype


def _write_gguf(path, config, tensors, qtype=QType.F32, arch="llama",
                extra=None):
  writer = gguf.GGUFWriter(str(path), arch)
  for key, value in (extra or {}).items():  # e.g. {"llama.x": 1}
    (writer.add_string if isinstance(value, str) else writer.add_uint32)(
        key, value)
  writer.add_block_count(config.num_hidden_layers)
  writer.add_embedding_length(config.hidden_size)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_attention_heads)
  writer.add_head_count_kv(config.num_key_value_heads)
  writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_context_length(config.max_position_embeddings)
  writer.add_vocab_size(config.vocab_size)
  writer.add_rope_dimension_count(config.head_dim)
  writer.add_key_length(config.head_dim)
  writer.add_value_length(config.head_dim)
  writer.add_bos_token_id(config.bos_token_id)
  writer.add_eos_token_id(config.eos_token_id)
  for name, w in tensors.items():
    data, raw_dtype = _stored(w, qtype)
    writer.add_tensor(name, data, raw_dtype=raw_dtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def _dequantized(w: np.ndarray, qtype: QType) -> np.ndarray:
  data, raw_dtype = _stored(w, qtype)
  if raw_dtype is None:
    return data.astype(np.float32)
  return gguf.quants.dequantize(data, raw_dtype).astype(np.float32)


def _expected_hf_weights(model, qtype: QType) -> dict[str, np.ndarray]:
  """HF-named weights the loader must return: each stored (permuted) tensor
  quantized, dequantized, then its rows put back in HF order by inverting
  ``_permute``'s row order (computed here, not with the loader's code)."""
  config = model.config
  gg = _gguf_tensors(model)
  out = {}
  for hf in model.state_dict():
    if hf == "lm_head.weight" and config.tie_word_embeddings:
      continue
    w = _dequantized(gg[_gguf_name(hf)], qtype)
    n = _rows_moved(hf, config)
    if n is not None:
      order = _permute(np.arange(w.shape[0]), n)  # stored r = HF order[r]
      w = w[np.argsort(order)]
    out[hf] = w
  return out


def _params_as_hf(params, cfg) -> dict[str, np.ndarray]:
  """Splits loaded (fused, transposed) params back into HF tensors."""
  out = {"model.embed_tokens.weight": np.asarray(params.embed),
         "model.norm.weight": np.asarray(params.final_norm)}
  if params.lm_head is not None:
    out["lm_head.weight"] = np.asarray(params.lm_head)
  for i, lp in enumerate(jax.tree_util.tree_map(np.asarray, params.layers)):
    p = f"model.layers.{i}."
    q, k, v = decoder.split_qkv(lp.wqkv, cfg.num_kv_heads, cfg.head_dim)
    gate, up = layers.split_gate_up(lp.w_gate_up)
    out.update({
        p + "input_layernorm.weight": lp.attn_norm,
        p + "self_attn.q_proj.weight": q.T,
        p + "self_attn.k_proj.weight": k.T,
        p + "self_attn.v_proj.weight": v.T,
        p + "self_attn.o_proj.weight": lp.wo.T,
        p + "post_attention_layernorm.weight": lp.mlp_norm,
        p + "mlp.gate_proj.weight": gate.T,
        p + "mlp.up_proj.weight": up.T,
        p + "mlp.down_proj.weight": lp.w_down.T,
    })
  return out


def _tokens(vocab: int) -> np.ndarray:
  return np.asarray(jax.random.randint(jax.random.key(7), (2, T), 0, vocab))


def _logits(params, cfg, tokens) -> np.ndarray:
  return np.asarray(decoder.forward(params, cfg, tokens,
                                  decoder.init_cache(cfg, 2, S)).logits)


def _torch_logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def _max_err(a, b) -> float:
  return float(np.abs(np.asarray(a) - np.asarray(b)).max())


# --- Tests. ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama_gqa_tied", "own_tied", "own_untied"])
def test_f32_gguf_matches_transformers(models, name, tmp_path):
  """Invariant: an F32 GGUF written like llama.cpp (Q/K permuted, K by the
  kv-head count) loads to the config the HF loader derives from the same
  model (heads, kv heads, head_dim, tie, ...; norm eps up to GGUF's f32), to
  the exact HF weights, and to logits equal to transformers' (|Δ| < 1e-4)."""
  model = models[name]
  path = _write_gguf(tmp_path / "m.gguf", model.config, _gguf_tensors(model))
  cfg, params, _ = load_gguf(path)

  hf_cfg = config_from_hf(model.config.to_dict())
  assert cfg.norm_eps == pytest.approx(hf_cfg.norm_eps, rel=1e-6)
  assert cfg == dataclasses.replace(hf_cfg, norm_eps=cfg.norm_eps,
                                    name=cfg.name)
  assert cfg.tie_embeddings == model.config.tie_word_embeddings
  assert (cfg.num_heads, cfg.num_kv_heads) == (
      model.config.num_attention_heads, model.config.num_key_value_heads)

  loaded = _params_as_hf(params, cfg)
  expected = _expected_hf_weights(model, QType.F32)
  assert loaded.keys() == expected.keys()
  for k, w in model.state_dict().items():
    if k in expected:
      np.testing.assert_array_equal(loaded[k], w.numpy(), err_msg=k)

  tokens = _tokens(cfg.vocab_size)
  assert _max_err(_logits(params, cfg, tokens),
                  _torch_logits(model, tokens)) < 1e-4


# Relative RMS error of the logits vs the f32 transformers model, measured on
# "own_tied" with these tokens (logit std ~1.6): F16 9e-4, Q8_0 0.028, Q4_0
# 0.41, Q4_1 0.34 (max |Δ|: 0.0055, 0.17, 2.7, 2.4). This random tiny model
# amplifies weight noise ~5x (Q4's 32-blocks of 4 bits: ~9% per weight), so
# Q4 is far off; the tolerances are ~2-3x the measurement. The exactness of
# the loader is pinned by the weight and dequantized-model checks instead.
QUANT_REL_TOL = {QType.F16: 3e-3, QType.Q8_0: 0.08, QType.Q4_0: 0.8,
                 QType.Q4_1: 0.7}


@pytest.mark.parametrize("qtype", list(QUANT_REL_TOL), ids=lambda q: q.name)
def test_quantized_gguf_dequantizes_exactly(models, qtype, tmp_path):
  """Invariant: for F16/Q8_0/Q4_0/Q4_1 files every loaded weight equals
  ``dequantize(quantize(permuted w))`` with rows un-permuted, exactly (the
  permutation moves whole rows and quantization blocks lie within a row, so
  this is also ``dequantize(quantize(w))``); the logits equal transformers'
  run on those dequantized weights (|Δ| < 1e-4) and stay within the measured
  relative RMS error QUANT_REL_TOL of the f32 model's."""
  model = models["own_tied"]
  path = _write_gguf(tmp_path / "q.gguf", model.config, _gguf_tensors(model),
                     qtype)
  cfg, params, reader = load_gguf(path)
  stored = {t.name: t.tensor_type for t in reader.tensors}
  assert stored["blk.0.attn_k.weight"] == qtype
  assert stored["token_embd.weight"] == qtype
  assert stored["blk.0.attn_norm.weight"] == QType.F32

  loaded = _params_as_hf(params, cfg)
  expected = _expected_hf_weights(model, qtype)
  assert loaded.keys() == expected.keys()
  for k, w in expected.items():
    np.testing.assert_array_equal(loaded[k], w, err_msg=k)
    if w.ndim == 2:  # quantizing before or after the row permutation agrees
      np.testing.assert_array_equal(
          w, _dequantized(model.state_dict()[k].numpy(), qtype), err_msg=k)

  dequantized_model = copy.deepcopy(model)  # tied: lm_head stays the embedding
  result = dequantized_model.load_state_dict(
      {k: torch.from_numpy(w) for k, w in expected.items()}, strict=False)
  assert not result.unexpected_keys
  assert set(result.missing_keys) <= {"lm_head.weight"}
  assert dequantized_model.lm_head.weight is (
      dequantized_model.model.embed_tokens.weight)
  tokens = _tokens(cfg.vocab_size)
  ours = _logits(params, cfg, tokens)
  assert _max_err(ours, _torch_logits(dequantized_model, tokens)) < 1e-4
  f32 = _torch_logits(model, tokens)
  rel_rms = float(np.sqrt(np.mean((ours - f32) ** 2)) / f32.std())
  assert rel_rms < QUANT_REL_TOL[qtype], rel_rms


def _k_with_query_heads(monkeypatch, cfg):
  real = gguf_loader.unpermute_rope
  monkeypatch.setattr(
      gguf_loader, "unpermute_rope",
      lambda w, n: real(w, cfg.num_heads if n == cfg.num_kv_heads else n))


def _no_unpermute(monkeypatch, cfg):
  del cfg
  monkeypatch.setattr(gguf_loader, "unpermute_rope", lambda w, n: w)


@pytest.mark.parametrize("mutate", [_k_with_query_heads, _no_unpermute])
def test_wrong_unpermute_is_detected(models, mutate, monkeypatch, tmp_path):
  """Invariant (mutation check): un-permuting K with the query head count
  instead of the kv-head count (or skipping the un-permutation) makes the
  logits differ from transformers' by > 1 (measured 6.7 and 5.4; the correct
  loader: < 1e-4), so the parity tests are sensitive to the K head count.
  Uses the 4/2-head model: with llama_gqa_tied (6/2 heads, head_dim 4) K's 8
  rows cannot even be split into 6 heads."""
  model = models["own_tied"]
  path = _write_gguf(tmp_path / "m.gguf", model.config, _gguf_tensors(model))
  cfg = load_gguf(path)[0]
  assert cfg.num_heads != cfg.num_kv_heads
  mutate(monkeypatch, cfg)
  cfg, params, _ = load_gguf(path)
  tokens = _tokens(cfg.vocab_size)
  err = _max_err(_logits(params, cfg, tokens), _torch_logits(model, tokens))
  assert err > 1.0, err


def test_untied_output_weight(models, tmp_path):
  """Invariant: a GGUF with ``output.weight`` loads untied: ``lm_head`` is
  that tensor (transposed), not the embedding, and the logits match
  transformers' (|Δ| < 1e-4); the same model written without it is tied."""
  model = models["own_untied"]
  tensors = _gguf_tensors(model)
  assert "output.weight" in tensors
  cfg, params, _ = load_gguf(_write_gguf(tmp_path / "u.gguf", model.config,
                                         tensors))
  assert not cfg.tie_embeddings
  np.testing.assert_array_equal(np.asarray(params.lm_head),
                                tensors["output.weight"])
  assert _max_err(params.lm_head, params.embed) > 0.1
  tokens = _tokens(cfg.vocab_size)
  assert _max_err(_logits(params, cfg, tokens),
                  _torch_logits(model, tokens)) < 1e-4

  del tensors["output.weight"]
  cfg, params, _ = load_gguf(_write_gguf(tmp_path / "t.gguf", model.config,
                                         tensors))
  assert cfg.tie_embeddings and params.lm_head is None


def test_unsupported_architecture(models, tmp_path):
  """Invariant: a GGUF whose ``general.architecture`` is not one the
  loader reads raises WeightError naming the architecture."""
  model = models["own_tied"]
  path = _write_gguf(tmp_path / "g.gguf", model.config, _gguf_tensors(model),
                     arch="gpt2")
  with pytest.raises(WeightError, match="unsupported GGUF architecture 'gpt2'"):
    load_gguf(path)


@pytest.mark.parametrize("key,tensor,words", [
    ("llama.attention.sliding_window", None,
     "llama.attention.sliding_window is not supported"),
    ("llama.expert_count", None, "llama.expert_count is not supported"),
    (None, "blk.0.post_attention_norm.weight",
     "'blk.0.post_attention_norm.weight' is not supported"),
])
def test_unread_metadata_or_tensor_refused(models, key, tensor, words,
                                           tmp_path):
  """Invariant: an architecture key or a tensor the loader would not honour
  (a sliding window, experts, Gemma's post-norms) is refused naming it,
  never loaded and decoded differently."""
  model = models["own_tied"]
  tensors = _gguf_tensors(model)
  if tensor:
    tensors[tensor] = np.ones(model.config.hidden_size, np.float32)
  path = _write_gguf(tmp_path / "x.gguf", model.config, tensors,
                     extra={key: 4} if key else None)
  with pytest.raises(WeightError, match=re.escape(words)):
    load_gguf(path)


@pytest.mark.parametrize("arch,key,value,words", [
    ("qwen3", "qwen3.attention.sliding_window", 4,
     "qwen3.attention.sliding_window is not supported"),
    ("gemma2", "gemma2.rope.freq_base_swa", 5000,
     "gemma2 with its own rope.freq_base_swa"),
    ("phi3", "phi3.rope.scaling.original_context_length", 16, "longrope"),
    ("llama", "llama.rope.scaling.type", "yarn", "rope scaling 'yarn'"),
])
def test_what_an_architecture_cannot_carry_is_refused(models, arch, key,
                                                      value, words, tmp_path):
  """Invariant: keys llama.cpp would read differently from what specjax
  runs (a window Qwen3 files never carry, Gemma 2's own sliding-layer RoPE
  base, Phi-3's long-context scaling, RoPE scalings other than linear) are
  refused naming them, before any tensor is read."""
  model = models["own_tied"]
  path = _write_gguf(tmp_path / "x.gguf", model.config, _gguf_tensors(model),
                     arch=arch, extra={key: value})
  with pytest.raises(WeightError, match=re.escape(words)):
    load_gguf(path)


def test_zero_heads_refused(models, tmp_path):
  """Invariant: a file whose head count is 0 is refused naming the key (no
  division by zero)."""
  model = models["own_tied"]
  config = copy.deepcopy(model.config)
  config.num_attention_heads = 0
  path = _write_gguf(tmp_path / "z.gguf", config, _gguf_tensors(model))
  with pytest.raises(WeightError, match="attention.head_count is 0, not a "
                     "size"):
    load_gguf(path)


@pytest.mark.parametrize("missing,named", [
    ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
    ("token_embd.weight", "model.embed_tokens.weight"),
])
def test_missing_tensor(models, missing, named, tmp_path):
  """Invariant: a GGUF lacking a required tensor raises WeightError naming it
  by its GGUF name, with transformers' name alongside."""
  model = models["own_tied"]
  tensors = _gguf_tensors(model)
  del tensors[missing]
  path = _write_gguf(tmp_path / "m.gguf", model.config, tensors)
  with pytest.raises(WeightError,
                     match=re.escape(f"missing tensor '{missing}' ({named})")):
    load_gguf(path)


# --- Every architecture, as llama.cpp's own converter writes it. -------------

@pytest.fixture(scope="module", params=[
    pytest.param(n, marks=() if n == "gguf_gemma2" else pytest.mark.long)
    for n in sorted(GGUF_CONFIGS)])
def converted(request, tmp_path_factory):
  d = tmp_path_factory.mktemp(request.param)
  model = make_tiny(request.param, d)
  return model, to_gguf(d), d


def test_llamacpp_converted_gguf_matches_transformers(converted):
  """Invariant: each architecture (``tiny_hf.GGUF_CONFIGS``: Mistral, Qwen3,
  Gemma 2 and 3, Phi-3, Llama with biases), converted by llama.cpp's own
  ``convert_hf_to_gguf.py``, loads to logits equal to transformers' on the
  original checkpoint (|Δ| < 1e-4) over a batch of 20-token rows, past
  every window, and to the config the HF loader reads from its directory,
  up to what the file stores differently (norm eps in f32; Gemma's norms
  as 1 + w, run with no offset; the tokenizer's special ids)."""
  model, path, d = converted
  cfg, params, _ = load_gguf(path)
  hf_cfg, _ = load_hf(d)
  same = dict(name=hf_cfg.name, norm_eps=hf_cfg.norm_eps,
              bos_id=hf_cfg.bos_id, eos_ids=hf_cfg.eos_ids)
  assert cfg.norm_eps == pytest.approx(hf_cfg.norm_eps, rel=1e-6)
  assert cfg.norm_offset == 0.0
  assert dataclasses.replace(cfg, **same, norm_offset=hf_cfg.norm_offset
                             ) == hf_cfg
  tokens = np.asarray(jax.random.randint(jax.random.key(3), (2, 20), 0,
                                         cfg.vocab_size))
  assert hf_cfg.sliding_window is None or 20 > 3 * hf_cfg.sliding_window
  got = decoder.forward(params, cfg, jnp.asarray(tokens),
                        decoder.init_cache(cfg, 2, 24)).logits
  assert _max_err(got, _torch_logits(model, tokens)) < 1e-4
  # The whole path a user takes: these weights and the file's tokenizer.
  m = load_model(str(path), native=False)
  for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  assert m.tokenizer.decode(m.tokenizer.encode("the cat sat"),
                            skip_special_tokens=True) == "the cat sat"


def test_truncated_or_damaged_files_are_named(models, tmp_path):
  """Invariant: a GGUF cut short anywhere (in the header, in the tensor
  data, one byte short) or with its metadata overwritten raises one
  WeightError naming the file, never numpy's unpack or reshape error."""
  model = models["own_tied"]
  data = _write_gguf(tmp_path / "m.gguf", model.config,
                     _gguf_tensors(model)).read_bytes()
  cases = {"16 bytes": data[:16], "half": data[:len(data) // 2],
           "one byte short": data[:-1],
           "scrambled header": data[:24] + bytes(64) + data[88:]}
  for name, content in cases.items():
    path = tmp_path / f"{name.replace(' ', '_')}.gguf"
    path.write_bytes(content)
    with pytest.raises(WeightError, match=re.escape(repr(str(path)))):
      load_gguf(path)
