"""Tokenizer tests on the real SmolLM2-135M-Instruct GGUF.

transformers (loading the same GGUF) is the reference for ids, decoding and
chat templates; it is only imported here, never by specjax.
"""

from __future__ import annotations

import json

import gguf
import pytest

from specjax.assets import smollm2_gguf
from specjax.models.tokenizer import StreamDecoder, Tokenizer

STRINGS = [
    "Hello, world!",
    "café naïve résumé Ångström",
    "combining: e\u0301 a\u0308 n\u0303 o\u0302\u0323",
    "日本語のテキスト、中文字符和标点。",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷!",
    "def f(x):\n    if x:\n\treturn x  # tab\n    return None\n",
    "a   b\n\n\n  c",
    "   leading and trailing   ",
    "12345 3.14159",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
# Bytes missing from SmolLM2's byte alphabet are dropped, not mapped to unk.
LOSSY = ["a\x04b", "bell\x13\x14", "\U00040000x"]

CHATS = {
    "single_user": ([{"role": "user", "content": "What is 2+2?"}], True),
    "multi_turn": ([
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour ! 😀"},
        {"role": "user", "content": "Comment ça va ?"},
    ], True),
    "no_generation_prompt": ([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ], False),
}


class _Field:
  """Stands in for a ``gguf.ReaderField``: only ``contents()`` is read."""

  def __init__(self, value):
    self._value = value

  def contents(self):
    return self._value


class _Reader:
  """A GGUF reader whose metadata is a plain dict (edited copies of real)."""

  def __init__(self, fields):
    self.fields = fields


@pytest.fixture(scope="module")
def reader():
  return gguf.GGUFReader(smollm2_gguf())


@pytest.fixture(scope="module")
def tok(reader):
  return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def hf():
  import transformers  # a dev dependency: missing fails, never skips
  path = smollm2_gguf()
  return transformers.AutoTokenizer.from_pretrained(
      str(path.parent), gguf_file=path.name)


def _edited(reader, **overrides):
  """``reader`` with some metadata keys replaced (None deletes the key)."""
  fields = dict(reader.fields)
  for key, value in overrides.items():
    key = key.replace("__", ".")
    if value is None:
      fields.pop(key, None)
    else:
      fields[key] = _Field(value)
  return _Reader(fields)


def _input_ids(out):
  """transformers 5 returns a BatchEncoding where 4 returned a list."""
  return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("text", STRINGS + LOSSY)
def test_encode_matches_transformers(tok, hf, text):
  """Raw text encodes to transformers' ids; neither adds BOS for SmolLM2."""
  ids = tok.encode(text)
  assert ids == hf(text)["input_ids"]
  assert ids == hf.encode(text, add_special_tokens=False)


def test_bytes_missing_from_vocab_are_dropped(tok):
  """A byte with no vocab entry vanishes, as in llama.cpp; no unk id."""
  assert tok.encode("a\x04b") == tok.encode("a") + tok.encode("b")
  assert 0 not in tok.encode("bell\x13\x14")


def test_special_token_strings_encode_as_specials(tok):
  """Special-token text in the input becomes the single special id."""
  ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
  assert ids[0] == tok.bos_id == 1
  assert ids[-1] == 2
  assert len(ids) == 5  # <|im_start|> user \n hi <|im_end|>


def test_digits_are_split_one_by_one(tok):
  """SmolLM pre-tokenization: every digit is its own token."""
  ids = tok.encode("12345")
  assert [tok.decode([i]) for i in ids] == list("12345")


def test_non_ascii_numerals_split_like_llama_cpp(tok):
  """Any \\p{N} char (², ½, ٣) is its own pre-token, after the space.

  llama.cpp's SMOLLM regex and SmolLM2's tokenizer.json (Digits first) both
  do this; transformers' GGUF loader skips the Digits step (it has no rule
  for pre='smollm') and encodes " ½" as one piece, so it is not the
  reference here.
  """
  space = tok.encode(" ")
  for numeral in ("²", "½", "٣"):
    assert tok.encode(" " + numeral) == space + tok.encode(numeral)


@pytest.mark.parametrize("text", STRINGS)
def test_decode_round_trips_and_matches_transformers(tok, hf, text):
  """decode(encode(s)) == s, and decode agrees with transformers."""
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.decode(ids) == hf.decode(ids)
  assert (tok.decode(ids, skip_special_tokens=True)
          == hf.decode(ids, skip_special_tokens=True))


def test_skip_special_tokens_drops_control_tokens(tok):
  """skip_special_tokens removes exactly the control tokens."""
  ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
  assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_special_ids_and_vocab_match_transformers(tok, hf):
  """Vocab size, special ids, bos and pad agree with transformers."""
  assert tok.vocab_size == len(hf) == 49152
  assert tok.special_ids == {
      i for i, t in hf.added_tokens_decoder.items() if t.special}
  assert tok.bos_id == hf.bos_token_id
  assert tok.pad_id == hf.pad_token_id


def test_eos_ids_include_turn_end(tok, hf):
  """The eos id comes first, and <|im_end|> (ChatML turn end) is included."""
  assert tok.eos_ids[0] == hf.eos_token_id
  assert hf.convert_tokens_to_ids("<|im_end|>") in tok.eos_ids


@pytest.mark.parametrize("name", CHATS)
def test_render_chat_matches_transformers(tok, hf, name):
  """render_chat is transformers' apply_chat_template(tokenize=False)."""
  messages, add_gen = CHATS[name]
  expected = hf.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=add_gen)
  assert tok.render_chat(messages, add_generation_prompt=add_gen) == expected


def test_render_chat_injects_default_system_prompt(tok):
  """SmolLM2's template adds its system prompt when none is given."""
  text = tok.render_chat([{"role": "user", "content": "hi"}])
  assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
  assert text.endswith("<|im_start|>user\nhi<|im_end|>\n"
                       "<|im_start|>assistant\n")


@pytest.mark.parametrize("name", CHATS)
def test_encode_chat_matches_transformers(tok, hf, name):
  """encode_chat ids are transformers' apply_chat_template(tokenize=True)."""
  messages, add_gen = CHATS[name]
  expected = _input_ids(hf.apply_chat_template(
      messages, tokenize=True, add_generation_prompt=add_gen))
  assert tok.encode_chat(messages, add_generation_prompt=add_gen) == expected


def test_encode_chat_string_is_one_user_message(tok):
  """A plain string prompt is a single user turn."""
  assert tok.encode_chat("hi") == tok.encode_chat(
      [{"role": "user", "content": "hi"}])


def test_template_helpers_behave_like_transformers(tok, hf):
  """tojson keeps non-ASCII, raise_exception raises TemplateError."""
  import jinja2
  source = ("{{ messages | tojson }}{{ messages | tojson(indent=2) }}"
            "{% if messages[0]['role'] == 'bad' %}"
            "{{ raise_exception('bad role') }}{% endif %}")
  messages = [{"role": "user", "content": "café <b>"}]
  ours = Tokenizer(tok.backend, bos_id=None, eos_ids=(), pad_id=None,
                   chat_template=source)
  expected = hf.apply_chat_template(messages, chat_template=source,
                                    tokenize=False)
  assert ours.render_chat(messages, add_generation_prompt=False) == expected
  assert '"café <b>"' in expected
  with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
    ours.render_chat([{"role": "bad", "content": ""}])


def test_stream_decoder_never_emits_partial_characters(tok):
  """One token at a time: no U+FFFD ever, and the pieces sum to decode()."""
  text = "Emoji 😀👍🏽 and 日本語、中文 with é\u0301 🇫🇷 done"
  ids = tok.encode(text)
  # The test is only meaningful if some character spans several tokens.
  assert any("\ufffd" in tok.decode([i]) for i in ids)
  stream = StreamDecoder(tok)
  pieces = [stream.push([i]) for i in ids]
  pieces.append(stream.flush())
  assert not any("\ufffd" in p for p in pieces)
  assert "".join(pieces) == tok.decode(ids) == text


def test_stream_decoder_flush_releases_incomplete_tail(tok):
  """A cut-off character is held back, then flushed exactly as decode()."""
  ids = tok.encode("ok 😀")
  cut = ids[:-1]
  stream = StreamDecoder(tok)
  streamed = stream.push(cut)
  assert "\ufffd" not in streamed
  assert streamed + stream.flush() == tok.decode(cut)
  assert tok.decode(cut).endswith("\ufffd")


def test_stream_decoder_skips_special_tokens(tok):
  """With skip_special_tokens the stream equals decode(..., skip=True)."""
  ids = tok.encode_chat("héllo 😀")
  stream = StreamDecoder(tok, skip_special_tokens=True)
  out = "".join(stream.push([i]) for i in ids) + stream.flush()
  assert out == tok.decode(ids, skip_special_tokens=True)
  assert "<|im_start|>" not in out and "héllo 😀" in out


def _write_hf_dir(path, tok, config):
  tok.backend.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_from_hf_dir_matches_from_gguf(tok, tmp_path):
  """A saved tokenizer.json + config encodes and renders like the GGUF."""
  _write_hf_dir(tmp_path, tok, {
      "chat_template": tok.chat_template,
      "bos_token": "<|im_start|>",
      "eos_token": {"content": "<|im_end|>", "special": True},
      "pad_token": "<|im_end|>",
      "add_bos_token": True,  # ignored beside tokenizer.json, as in HF
  })
  hf_tok = Tokenizer.from_hf_dir(tmp_path)
  for text in STRINGS:
    assert hf_tok.encode(text) == tok.encode(text)
  for messages, add_gen in CHATS.values():
    assert (hf_tok.encode_chat(messages, add_gen)
            == tok.encode_chat(messages, add_gen))
  assert (hf_tok.bos_id, hf_tok.eos_ids, hf_tok.pad_id) == (
      tok.bos_id, tok.eos_ids, tok.pad_id)
  assert hf_tok.special_ids == tok.special_ids
  assert hf_tok.vocab_size == tok.vocab_size


def test_from_hf_dir_reads_template_file_and_eos_lists(tok, tmp_path):
  """chat_template.jinja wins over the config; eos lists are merged."""
  _write_hf_dir(tmp_path, tok, {"chat_template": "ignored",
                                "eos_token": "<|endoftext|>"})
  (tmp_path / "chat_template.jinja").write_text(tok.chat_template)
  (tmp_path / "generation_config.json").write_text(
      json.dumps({"eos_token_id": [0, 2]}))
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
  hf_tok = Tokenizer.from_hf_dir(tmp_path)
  assert hf_tok.render_chat([{"role": "user", "content": "x"}]) == (
      tok.render_chat([{"role": "user", "content": "x"}]))
  assert hf_tok.eos_ids == (0, 2, 5)


def test_from_hf_dir_without_template_refuses_chat(tok, tmp_path):
  """No chat template: render_chat raises, raw encoding still works."""
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  hf_tok = Tokenizer.from_hf_dir(tmp_path)
  assert hf_tok.encode("hi there") == tok.encode("hi there")
  with pytest.raises(ValueError, match="no chat template"):
    hf_tok.encode_chat("hi")


def test_from_hf_dir_missing_tokenizer_json(tmp_path):
  """A directory without tokenizer.json fails with a clear error."""
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    Tokenizer.from_hf_dir(tmp_path)


def test_add_bos_token_prepends_bos_to_raw_text_only(tok, reader):
  """add_bos_token: encode adds BOS once; encode_chat adds nothing."""
  bos_tok = Tokenizer.from_gguf(
      _edited(reader, tokenizer__ggml__add_bos_token=True))
  assert bos_tok.encode("hi there") == [tok.bos_id] + tok.encode("hi there")
  assert bos_tok.encode_chat("hi") == tok.encode_chat("hi")


def test_from_gguf_rejects_unsupported_model(reader):
  """A GGUF tokenizer model other than gpt2 and llama is refused, naming
  it."""
  with pytest.raises(ValueError, match="'bert'"):
    Tokenizer.from_gguf(_edited(reader, tokenizer__ggml__model="bert"))


SPM_STRINGS = ["the cat sat", " leading space", "double  space", "trailing ",
               "new\nline", "Hello World 123", "unseen: 漢字 and ÿ",
               "naïve café", "", "  ", "mat.dog"]


@pytest.mark.parametrize("byte_fallback", [True, False])
def test_sentencepiece_gguf_tokenizes_as_sentencepiece(tmp_path,
                                                       byte_fallback):
  """Invariant: a SentencePiece tokenizer (Llama 2's, Gemma's and Phi-3's
  kind) that llama.cpp's converter wrote into a GGUF encodes raw text to
  the ids sentencepiece itself gives -- spaces, newlines, characters it
  never saw (as bytes, or as unk without byte fallback) -- decodes them
  back, and puts BOS first; special-token strings in the text become
  their ids, as llama.cpp parses them."""
  import sentencepiece
  import transformers
  from tests.tiny_hf import to_gguf, train_spm
  model = train_spm(400 if byte_fallback else 80, byte_fallback)
  sp = sentencepiece.SentencePieceProcessor(model_proto=model)
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=sp.vocab_size(), hidden_size=8, intermediate_size=8,
      num_hidden_layers=1, num_attention_heads=2)).save_pretrained(tmp_path)
  tok = Tokenizer.from_gguf(gguf.GGUFReader(str(to_gguf(tmp_path, model))))
  for text in SPM_STRINGS:
    ids = tok.backend.encode(text, add_special_tokens=False).ids
    assert ids == sp.encode(text), text
    if byte_fallback:
      assert tok.decode(ids) == sp.decode(ids) == text
  assert tok.encode("the cat") == [sp.bos_id()] + sp.encode("the cat")
  assert tok.backend.encode("a</s>b", add_special_tokens=False).ids == (
      sp.encode("a") + [sp.eos_id()] + sp.encode("b"))


def test_from_gguf_rejects_unknown_pre_tokenizer(reader):
  """An unknown pre-tokenizer is refused rather than tokenized wrong."""
  with pytest.raises(ValueError, match="'deepseek-coder'"):
    Tokenizer.from_gguf(
        _edited(reader, tokenizer__ggml__pre="deepseek-coder"))


@pytest.mark.parametrize("pre, pieces", [
    ("smollm", ["1", "2", "3", "4", "5", "Ġ", "6", "Ġabc"]),
    (None, ["1", "2", "3", "4", "5", "Ġ", "6", "Ġabc"]),
    ("gpt2", ["12345", "Ġ6", "Ġabc"]),
    ("llama-bpe", ["123", "45", "Ġ", "6", "Ġabc"]),
])
def test_pre_tokenizer_follows_gguf_pre(reader, pre, pieces):
  """Each tokenizer.ggml.pre splits numbers the way llama.cpp's regex does."""
  split = Tokenizer.from_gguf(_edited(reader, tokenizer__ggml__pre=pre))
  got = split.backend.pre_tokenizer.pre_tokenize_str("12345 6 abc")
  assert [p for p, _ in got] == pieces
