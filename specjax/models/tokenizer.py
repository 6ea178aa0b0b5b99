"""Tokenizer for Llama-family models, built with ``tokenizers`` alone.

Two sources: the metadata of a GGUF file (byte-level BPE or SentencePiece,
the way llama.cpp reads them) and a Hugging Face model directory
(``tokenizer.json``). Chat
templates are rendered with jinja2 the way transformers renders them, so
prompts match the reference token for token; transformers itself is only a
test reference, never a dependency.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from typing import Any, Iterable, Optional

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import (decoders, models, normalizers, pre_tokenizers,
                        processors)

from specjax.models.gguf_loader import metadata

# llama.cpp token types (``llama_token_type``).
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6

# Llama-3's split regex, as in Meta's tokenizer.json and llama.cpp's LLAMA3.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
  """Every digit on its own, then the GPT-2 regex (llama.cpp: SMOLLM & co)."""
  return pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
  ])


def _gpt2() -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _llama3() -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(
          tokenizers.Regex(_LLAMA3_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])


# ``tokenizer.ggml.pre`` -> (pre-tokenizer, BPE ignore_merges). The groups
# follow llama.cpp's ``llama_vocab::impl::load``, which shares one regex list
# between these names; llama.cpp also sets ignore_merges for Llama-3 only.
_PRE_TOKENIZERS = {
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"),
        (_digits_then_gpt2, False)),
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais"), (_gpt2, False)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3"), (_llama3, True)),
}
# Files without a ``tokenizer.ggml.pre`` key: SmolLM-style splitting.
_DEFAULT_PRE = "smollm"

# Specials that close a chat turn; a template that writes one expects the
# model to stop there even when the file's eos is a different token.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None,
            sort_keys=False) -> str:
  """transformers' ``tojson``: jinja's own escapes HTML characters."""
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
  """The environment transformers renders chat templates in."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


def _read_json(path: pathlib.Path) -> dict:
  if not path.is_file():
    return {}
  return json.loads(path.read_text(encoding="utf-8"))


def _token_content(token: Any) -> Optional[str]:
  """A tokenizer_config token: a string or a serialized AddedToken dict."""
  if isinstance(token, dict):
    return token.get("content")
  return token


def _as_ids(value: Any) -> list[int]:
  if value is None:
    return []
  return [value] if isinstance(value, int) else list(value)


def _bpe_from_gguf(reader, tokens, types):
  """Byte-level BPE, split the way llama.cpp splits (``tokenizer.ggml.pre``);
  no BOS unless the file asks for one."""
  pre = metadata(reader, "tokenizer.ggml.pre", _DEFAULT_PRE)
  if pre not in _PRE_TOKENIZERS:
    raise ValueError(
        f"unsupported GGUF pre-tokenizer {pre!r}: supported are "
        f"{', '.join(sorted(_PRE_TOKENIZERS))}")
  make_pre, ignore_merges = _PRE_TOKENIZERS[pre]
  merges = metadata(reader, "tokenizer.ggml.merges")
  # No unk_token: SmolLM2's vocab lacks some bytes (0x04, 0xf1, ...), and
  # llama.cpp and the reference tokenizer.json drop those, not map them to
  # tokenizer.ggml.unknown_token_id.
  tok = tokenizers.Tokenizer(models.BPE(
      vocab={t: i for i, t in enumerate(tokens)},
      merges=[tuple(m.split(" ", 1)) for m in merges],
      ignore_merges=ignore_merges))
  tok.pre_tokenizer = make_pre()
  tok.decoder = decoders.ByteLevel()
  return tok, False


def _spm_from_gguf(reader, tokens, types):
  """SentencePiece as llama.cpp runs it (``llm_tokenizer_spm``): spaces
  as U+2581, one prepended to each stretch of text between special tokens
  when ``add_space_prefix``, then adjacent pieces merged best score first
  (here: BPE merges ranked by the merged piece's score), bytes the vocab
  lacks as ``<0xXX>`` tokens (without those: the unknown token, id 0
  unless the file names one); BOS added unless the file says not to."""
  scores = metadata(reader, "tokenizer.ggml.scores")
  vocab = {t: i for i, t in enumerate(tokens)}
  normal = {t for t, ty in zip(tokens, types) if ty in (_NORMAL, _USER_DEFINED)}
  ranked = []
  for piece, score in zip(tokens, scores):
    if piece not in normal or len(piece) < 2:
      continue
    ranked += [(-score, vocab[piece[:k]], vocab[piece[k:]], piece[:k],
                piece[k:]) for k in range(1, len(piece))
               if piece[:k] in normal and piece[k:] in normal]
  unk = metadata(reader, "tokenizer.ggml.unknown_token_id", 0)  # llama.cpp's
  tok = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=[(l, r) for *_, l, r in sorted(ranked)],
      unk_token=tokens[unk],
      byte_fallback=_BYTE in types, fuse_unk=True))
  prefix = metadata(reader, "tokenizer.ggml.add_space_prefix", True)
  steps = [normalizers.Prepend("\u2581")] if prefix else []
  tok.normalizer = normalizers.Sequence([*steps,
                                         normalizers.Replace(" ", "\u2581")])
  tok.decoder = decoders.Sequence([
      decoders.Replace("\u2581", " "), decoders.ByteFallback(),
      decoders.Fuse(), *([decoders.Strip(" ", 1, 0)] if prefix else [])])
  return tok, True


class Tokenizer:
  """A ``tokenizers.Tokenizer`` plus the model's special ids and chat template.

  Build with ``from_gguf`` or ``from_hf_dir``. ``encode`` adds what the
  model's tokenizer adds to raw text (BOS only when the model asks for it);
  ``encode_chat`` adds nothing beyond what the chat template writes, like
  transformers' ``apply_chat_template``.
  """

  def __init__(self, tok: tokenizers.Tokenizer, *, bos_id: Optional[int],
               eos_ids: Iterable[int], pad_id: Optional[int],
               chat_template: Optional[str]):
    self._tok = tok
    self.bos_id = bos_id
    self.pad_id = pad_id
    self.special_ids = frozenset(
        i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    eos = list(eos_ids)
    if chat_template:
      for content in _TURN_END_TOKENS:
        i = tok.token_to_id(content)
        if content in chat_template and i in self.special_ids:
          eos.append(i)
    self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
    self.chat_template = chat_template
    self._template = (
        _compile_template(chat_template) if chat_template else None)

  @classmethod
  def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
    """The tokenizer of a GGUF file's metadata, tokenizing as llama.cpp
    does: byte-level BPE (``gpt2``) or SentencePiece (``llama``: Llama 2,
    Gemma, Phi-3 files)."""
    model = metadata(reader, "tokenizer.ggml.model")
    builders = {"gpt2": _bpe_from_gguf, "llama": _spm_from_gguf}
    if model not in builders:
      raise ValueError(
          f"unsupported GGUF tokenizer model {model!r} (supported: "
          f"{', '.join(builders)})")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type", [])
    tok, add_bos = builders[model](reader, tokens, types)
    # Both kinds are matched whole in the text, as llama.cpp does; only
    # control tokens are special (dropped by skip_special_tokens).
    tok.add_special_tokens([
        tokenizers.AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([
        tokenizers.AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    bos_id = metadata(reader, "tokenizer.ggml.bos_token_id", None)
    if bos_id is not None and metadata(
        reader, "tokenizer.ggml.add_bos_token", add_bos):
      bos = tokens[bos_id]
      tok.post_processor = processors.TemplateProcessing(
          single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
          special_tokens=[(bos, bos_id)])
    eos_ids = [
        metadata(reader, f"tokenizer.ggml.{k}_token_id", None)
        for k in ("eos", "eot", "eom")]
    return cls(
        tok, bos_id=bos_id, eos_ids=[i for i in eos_ids if i is not None],
        pad_id=metadata(reader, "tokenizer.ggml.padding_token_id", None),
        chat_template=metadata(reader, "tokenizer.chat_template", None))

  @classmethod
  def from_hf_dir(cls, path: str | pathlib.Path) -> Tokenizer:
    """``tokenizer.json`` plus the config files transformers reads beside it.

    As in transformers, ``tokenizer.json``'s post-processor alone decides what
    ``encode`` adds (``add_bos_token`` in the config is ignored), and a
    ``chat_template.jinja`` file wins over the config's ``chat_template``.
    """
    path = pathlib.Path(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
      raise FileNotFoundError(
          f"{tok_file} not found: not a Hugging Face tokenizer directory")
    tok = tokenizers.Tokenizer.from_file(str(tok_file))
    config = _read_json(path / "tokenizer_config.json")
    generation = _read_json(path / "generation_config.json")
    model_config = _read_json(path / "config.json")

    template_file = path / "chat_template.jinja"
    template = config.get("chat_template")
    if template_file.is_file():
      template = template_file.read_text(encoding="utf-8")
    elif isinstance(template, list):  # named templates: use the default one
      template = {t["name"]: t["template"] for t in template}.get("default")

    def token_id(name: str) -> Optional[int]:
      content = _token_content(config.get(name))
      return None if content is None else tok.token_to_id(content)

    bos_id = token_id("bos_token")
    if bos_id is None:
      bos_id = generation.get("bos_token_id", model_config.get("bos_token_id"))
    eos_ids = [
        token_id("eos_token"),
        *_as_ids(generation.get("eos_token_id")),
        *_as_ids(model_config.get("eos_token_id"))]
    return cls(
        tok, bos_id=bos_id, eos_ids=[i for i in eos_ids if i is not None],
        pad_id=token_id("pad_token"), chat_template=template)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped ``tokenizers.Tokenizer`` (e.g. to ``save`` it)."""
    return self._tok

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Raw text to ids; special-token strings in it become special ids.
    ``add_special_tokens=False``: without the BOS (or other tokens) the
    tokenizer puts around a text -- a stop string's ids."""
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False
             ) -> str:
    return self._tok.decode(
        list(ids), skip_special_tokens=skip_special_tokens)

  def token_strings(self) -> list[str]:
    """Every id's token string, in id order (what two models must agree on
    to share ids)."""
    return [self._tok.id_to_token(i) for i in range(self.vocab_size)]

  def _token(self, i: Optional[int]) -> Optional[str]:
    return None if i is None else self._tok.id_to_token(i)

  def render_chat(self, messages: list[dict],
                  add_generation_prompt: bool = True) -> str:
    """The prompt text transformers' ``apply_chat_template`` renders."""
    if self._template is None:
      raise ValueError(
          "model has no chat template; pass raw text (--no-chat-template)")
    return self._template.render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=self._token(self.bos_id),
        eos_token=self._token(self.eos_ids[0] if self.eos_ids else None),
        # transformers always defines these, and templates test for them.
        tools=None,
        documents=None)

  def encode_chat(self, prompt: str | list[dict],
                  add_generation_prompt: bool = True) -> list[int]:
    """Chat prompt to ids; a string is a single user message.

    Nothing is added around the rendered text: templates that want a BOS
    write it themselves, as transformers assumes.
    """
    if isinstance(prompt, str):
      prompt = [{"role": "user", "content": prompt}]
    text = self.render_chat(prompt, add_generation_prompt)
    return self._tok.encode(text, add_special_tokens=False).ids


class StreamDecoder:
  """Incremental detokenization that never emits half a UTF-8 character.

  A character's bytes may be split across tokens; decoding such a prefix
  ends in U+FFFD. Text is only emitted once the window decodes cleanly, and
  is computed as a difference of two decodes that share a left context, so
  decoders that depend on the previous token (leading spaces) stay right.
  The concatenation of every ``push`` and the final ``flush`` equals
  ``tokenizer.decode(all_ids)``.
  """

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
    self._tokenizer = tokenizer
    self._skip = skip_special_tokens
    self._ids: list[int] = []
    self._prefix = 0  # start of the context window
    self._read = 0  # end of what has been emitted

  def _decode(self, start: int, end: Optional[int] = None) -> str:
    return self._tokenizer.decode(self._ids[start:end], self._skip)

  def push(self, ids: Iterable[int]) -> str:
    """Appends ids; returns the text they complete (maybe empty)."""
    self._ids.extend(ids)
    emitted = self._decode(self._prefix, self._read)
    text = self._decode(self._prefix)
    if len(text) <= len(emitted) or text.endswith("\ufffd"):
      return ""
    self._prefix, self._read = self._read, len(self._ids)
    return text[len(emitted):]

  def flush(self) -> str:
    """Whatever is still held back (an incomplete trailing character)."""
    emitted = self._decode(self._prefix, self._read)
    text = self._decode(self._prefix)
    self._prefix = self._read = len(self._ids)
    return text[len(emitted):]
