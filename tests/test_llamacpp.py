"""specjax against llama.cpp (llama-cpp-python, compiled by ``make test-long``)
on the real SmolLM2 file: the same token ids for the same text, and the same
greedy continuation on the same f32 weights. llama.cpp is a reference nobody
here wrote: its tokenizer is its own C++ port of the GGUF vocabulary, its
forward its own kernels. Required, never skipped: the long stage installs it.
"""

import pytest

from benchmarks import bench_peers
from specjax import assets, data
from specjax.core import runner
from specjax.models.registry import load_model

pytestmark = pytest.mark.long

# Text a tokenizer port gets wrong first: accents and combining marks, CJK,
# emoji (4-byte UTF-8), right-to-left and Devanagari scripts, digit runs,
# code whitespace, the chat template's special tokens.
TEXTS = (
    "Hello, world!", "naïve café — déjà vu", "e\u0301te\u0301 (combining)",
    "日本語のテキストと中文", "emoji 🤖🚀 and 👩‍💻", "مرحبا بالعالم",
    "नमस्ते दुनिया", "1234567890 3.14159 -42", "def f(x):\n\tif x:\n    return  x\n",
    "  leading and trailing spaces  ", "<|im_start|>user\nhi<|im_end|>\n",
    "mixed Ελληνικά, русский, and ASCII")
GREEDY_PROMPTS = ("Write a Python function that reverses a string.",
                  "What is the capital of France?",
                  "Explain speculative decoding in one paragraph.",
                  "List three prime numbers.")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model():
  return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def llama_cpp():
  """The module, imported when a test runs (the fast stage collects this
  file without it); missing, the test fails."""
  import llama_cpp
  return llama_cpp


def test_llamacpp_tokenizes_as_specjax(model, llama_cpp):
  """Invariant: for every text (the table and MT-bench's first 40 prompts,
  rendered through the chat template), llama.cpp's token ids from the GGUF
  vocabulary equal specjax's, and each decodes back to the same bytes."""
  llm = llama_cpp.Llama(str(assets.smollm2_gguf()), vocab_only=True,
                        verbose=False)
  tok = model.tokenizer
  texts = list(TEXTS) + [tok.render_chat([{"role": "user", "content": p}])
                         for p in data.mtbench_prompts()[:40]]
  for text in texts:
    ours = tok.encode(text)
    theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
    assert ours == theirs, text
    assert llm.detokenize(ours, special=True) == tok.decode(ours).encode(), text


def test_llamacpp_greedy_equals_specjax_on_f32_weights(model, llama_cpp,
                                                      tmp_path):
  """Invariant: 32 greedy tokens from llama.cpp on an f32 copy of the file
  (its own quantizer dequantizes Q4_1, as specjax's loader does) and an f32
  KV cache equal specjax's AR tokens on four chat prompts, one batch. (With
  llama.cpp's default f16 cache the third prompt's third token flips: its
  top two logits are 0.003 apart.)"""
  f32 = bench_peers.dequantized_copy(assets.smollm2_gguf(), tmp_path)
  llm = llama_cpp.Llama(str(f32), n_ctx=512, type_k=llama_cpp.GGML_TYPE_F32,
                        type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
  eos = set(model.config.eos_ids)
  prompts = [model.tokenizer.encode_chat(p) for p in GREEDY_PROMPTS]
  ours = runner.generate_ids(model, prompts, max_new_tokens=NEW_TOKENS)
  for ids, row in zip(prompts, ours.rows):
    theirs = []
    for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                          repeat_penalty=1.0, reset=True):
      theirs.append(int(t))
      if t in eos or len(theirs) == NEW_TOKENS:
        break
    assert row.output_ids == theirs, model.tokenizer.decode(ids)
    assert len(theirs) == NEW_TOKENS or theirs[-1] in eos
