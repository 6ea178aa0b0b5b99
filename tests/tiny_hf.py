"""Random tiny transformers models saved as HF checkpoints (test references).

Dimensions are small and all different so a swapped axis cannot go unnoticed.
"""

from __future__ import annotations

import json
import pathlib
import string

import torch
import transformers

TINY_CONFIGS = {
    # GQA (6 query heads over 2 kv heads), tied embeddings.
    "llama_gqa_tied": lambda: transformers.LlamaConfig(
        vocab_size=37, hidden_size=24, intermediate_size=40,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=64),
    # q/k/v bias, untied LM head (Qwen2 style).
    "qwen2_bias_untied": lambda: transformers.Qwen2Config(
        vocab_size=41, hidden_size=32, intermediate_size=56,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=64),
    # Llama-3 rope scaling, MHA, untied.
    "llama3_rope_scaling": lambda: transformers.LlamaConfig(
        vocab_size=43, hidden_size=40, intermediate_size=28,
        num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=5,
        rope_theta=500000.0, tie_word_embeddings=False,
        max_position_embeddings=64,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0,
                          original_max_position_embeddings=8)),
}

# Sixteen tokens: the exact joint law of four sampled tokens has 16^4 cells
# (tests/test_exactness.py).
SAMPLING_CONFIGS = {
    "llama_v16": lambda: transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        tie_word_embeddings=True, max_position_embeddings=64),
}


# Every other architecture specjax reads, each with what makes it differ
# bound: windows shorter than the tests' sequences, soft-caps below the
# scores, q/k and sandwich norms perturbed away from identity. No EOS (32
# greedy tokens must not stop early). transformers' eager attention: the
# reference formulas (sdpa differs by ~1e-5).
_NO_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None,
               attn_implementation="eager")
ARCH_CONFIGS = {
    # Sliding window on every layer.
    "mistral_window": lambda: transformers.MistralConfig(
        vocab_size=45, hidden_size=36, intermediate_size=52,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
        head_dim=6, sliding_window=5, tie_word_embeddings=False,
        max_position_embeddings=64, **_NO_IDS),
    # q/k norms, head_dim != D / N, sliding top layers (max_window_layers).
    "qwen3_qknorm": lambda: transformers.Qwen3Config(
        vocab_size=47, hidden_size=32, intermediate_size=44,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, use_sliding_window=True, sliding_window=6,
        max_window_layers=1, rope_theta=1000.0, tie_word_embeddings=False,
        max_position_embeddings=64, **_NO_IDS),
    # Soft-capped scores and logits, alternating windows, sandwich norms,
    # (1 + w) norms, scaled embedding, query_pre_attn_scalar != head_dim.
    "gemma2_softcap": lambda: transformers.Gemma2Config(
        vocab_size=53, hidden_size=40, intermediate_size=30,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=14, query_pre_attn_scalar=20, sliding_window=5,
        attn_logit_softcapping=1.5, final_logit_softcapping=3.0,
        max_position_embeddings=64, **_NO_IDS),
    # Local/global RoPE bases (linear scaling on the global), q/k norms,
    # sliding and full layers mixed.
    "gemma3_local_global": lambda: transformers.Gemma3TextConfig(
        vocab_size=51, hidden_size=48, intermediate_size=34,
        num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3,
        head_dim=10, query_pre_attn_scalar=16, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention",
                     "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0,
                               "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": 1000.0}},
        final_logit_softcapping=4.0, max_position_embeddings=64, **_NO_IDS),
    # Fused qkv and gate_up projections, a window on every layer.
    "phi3_fused": lambda: transformers.Phi3Config(
        vocab_size=55, hidden_size=30, intermediate_size=38,
        num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
        sliding_window=6, max_position_embeddings=64,
        original_max_position_embeddings=64, **_NO_IDS),
    # Biases on q/k/v/o and the MLP, erf GELU.
    "llama_bias_gelu": lambda: transformers.LlamaConfig(
        vocab_size=39, hidden_size=20, intermediate_size=26,
        num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=5,
        attention_bias=True, mlp_bias=True, hidden_act="gelu",
        max_position_embeddings=64, **_NO_IDS),
}


def _variant(name: str, drop=(), **changes):
  config = ARCH_CONFIGS[name]()
  fields = {k: v for k, v in config.to_dict().items() if k not in drop}
  return type(config)(**{**fields, **changes, **_NO_IDS})


# Each architecture as a GGUF file can carry it (llama.cpp's converter drops
# what llama.cpp does not compute: Mistral's and Qwen3's windows, GELU in a
# Llama, a query scale other than the head size's, Gemma 3 layer patterns
# other than five sliding to one full): what a GGUF reader is checked on.
GGUF_CONFIGS = {
    "gguf_mistral": lambda: _variant("mistral_window", sliding_window=None),
    "gguf_qwen3": lambda: _variant("qwen3_qknorm", drop=("layer_types",),
                                   use_sliding_window=False),
    "gguf_gemma2": lambda: _variant("gemma2_softcap", query_pre_attn_scalar=14),
    "gguf_gemma3": lambda: _variant("gemma3_local_global", drop=("layer_types",),
                                    num_hidden_layers=7,
                                    query_pre_attn_scalar=10),
    # 46 layers: llama.cpp scales a Gemma 2 27B's queries by D / N, not
    # the head size (the 27B's query_pre_attn_scalar).
    "gguf_gemma2_27b": lambda: _variant("gemma2_softcap", drop=("layer_types",),
                                        num_hidden_layers=46,
                                        query_pre_attn_scalar=10),
    "gguf_phi3": lambda: _variant("phi3_fused"),
    "gguf_llama_bias": lambda: _variant("llama_bias_gelu", hidden_act="silu"),
}


def make_tiny(name: str, directory: pathlib.Path, seed: int = 0):
  """Builds, randomizes and saves a tiny model; returns the torch model."""
  torch.manual_seed(seed)
  config = {**TINY_CONFIGS, **SAMPLING_CONFIGS, **ARCH_CONFIGS,
            **GGUF_CONFIGS}[name]()
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():  # default init leaves norms at 1 and biases at 0
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  model.save_pretrained(directory, safe_serialization=True)
  return model


def make_chat_model(d: pathlib.Path, seed: int = 4):
  """The tiny Llama of ``make_tiny("llama_gqa_tied", seed)`` (vocab 37)
  with a character-level tokenizer: ``<unk>``, ``<|im_start|>``,
  ``<|im_end|>`` (the EOS) and 34 characters, lower-cased. Its template
  keeps six characters of each turn: a ShareGPT chat is ~11 tokens a turn,
  and the template stays prefix-stable (``encode_conversation``)."""
  import tokenizers
  from tokenizers import decoders, models, normalizers, pre_tokenizers
  make_tiny("llama_gqa_tied", d, seed=seed)
  special = ["<unk>", "<|im_start|>", "<|im_end|>"]
  chars = [*string.ascii_lowercase, " ", "\n", ".", ",", "?", "'", "-", ":"]
  vocab = {t: i for i, t in enumerate(special + chars)}
  assert len(vocab) == 37
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.normalizer = normalizers.Lowercase()
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"),
                                           behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True,
                                                normalized=False)
                          for t in special])
  tok.save(str(d / "tokenizer.json"))
  template = ("{% for m in messages %}<|im_start|>{{ m['role'][0] }}\n"
              "{{ m['content'][:6] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>a\n{% endif %}")
  (d / "tokenizer_config.json").write_text(json.dumps(dict(
      chat_template=template, eos_token="<|im_end|>", pad_token="<unk>")))


CONVERTER = (pathlib.Path(__file__).parents[1] / ".venv" / "llama.cpp"
             / "convert_hf_to_gguf.py")


SPM_TEXT = ["the cat sat on the mat", "a dog ran far away, said the old man.",
            "Hello World 123 4567", "naïve café — déjà vu"] * 30


def train_spm(vocab_size: int, byte_fallback: bool = False,
              text=SPM_TEXT) -> bytes:
  """A SentencePiece BPE model (``tokenizer.model`` bytes) trained on
  ``text`` with Llama's and Gemma's settings: no normalization, spaces
  kept, a dummy prefix."""
  import io
  import sentencepiece
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(text), model_writer=model,
      vocab_size=vocab_size, model_type="bpe", hard_vocab_limit=False,
      byte_fallback=byte_fallback, normalization_rule_name="identity",
      remove_extra_whitespaces=False, minloglevel=2)
  return model.getvalue()


def to_gguf(directory: pathlib.Path, spm: bytes | None = None
            ) -> pathlib.Path:
  """``directory``'s checkpoint as an f32 GGUF written by llama.cpp's own
  converter (``make install`` puts it in .venv/llama.cpp), with ``spm`` as
  its tokenizer (default: a 24-piece one, smaller than any test model's
  vocabulary, which the converter pads to the model's)."""
  import subprocess
  import sys
  assert CONVERTER.is_file(), f"{CONVERTER} is missing: run make install"
  (directory / "tokenizer.model").write_bytes(
      spm or train_spm(24, text=["the cat sat on the mat"] * 20))
  out = directory / "model.gguf"
  run = subprocess.run([sys.executable, str(CONVERTER), str(directory),
                        "--outfile", str(out), "--outtype", "f32"],
                       capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-2000:]
  return out
