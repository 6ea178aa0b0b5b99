"""EAGLE training data: ShareGPT chats rendered with the target's template.

Each conversation becomes ``ids int32[T]`` and ``mask bool[T]`` (right-padded
or truncated to ``max_len``); ``mask`` marks the tokens the head learns to
draft: assistant content and the ``<|im_end|>`` that closes it. Examples with
no assistant token inside ``max_len`` are dropped (they would cost a target
forward and teach nothing).

No grain pipeline: the whole tokenized set is two small in-memory arrays
(4k conversations x 512 tokens = 8 MB), and the batch at step s is a pure
function of (seed, s) -- a per-epoch permutation -- so a resumed run sees
exactly the batches an uninterrupted one would, with no iterator state to
checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import Optional, Sequence

import numpy as np

from specjax.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Examples:
  """``ids``: ``int32[N, T]``; ``mask``: ``bool[N, T]``; ``lengths``: ``int32[N]``."""
  ids: np.ndarray
  mask: np.ndarray
  lengths: np.ndarray

  def __len__(self) -> int:
    return self.ids.shape[0]

  def take(self, idx) -> "Examples":
    return Examples(self.ids[idx], self.mask[idx], self.lengths[idx])


def encode_conversation(tokenizer: Tokenizer,
                        turns: Sequence[tuple[str, str]]
                        ) -> tuple[list[int], list[bool]]:
  """Token ids of the rendered chat and which of them are assistant output.

  The template is rendered for growing prefixes; each new piece is tokenized
  on its own (pieces meet at special tokens, where BPE cannot merge across),
  so the mask lines up with the tokens exactly.
  """
  # A chat starts with a user turn: leading assistant turns (ShareGPT has
  # some) would have no prompt, and templates render them inconsistently.
  while turns and turns[0][0] != "user":
    turns = turns[1:]
  messages = [{"role": r, "content": t} for r, t in turns]
  ids, mask, text = [], [], ""
  for i, m in enumerate(messages):
    pieces = []
    if m["role"] == "assistant":  # the header is context, not output
      pieces.append((tokenizer.render_chat(messages[:i], True), False))
    pieces.append((tokenizer.render_chat(messages[:i + 1], False),
                   m["role"] == "assistant"))
    for full, learn in pieces:
      if not full.startswith(text):
        raise ValueError("chat template is not prefix-stable")
      new = tokenizer.backend.encode(full[len(text):],
                                     add_special_tokens=False).ids
      # Learn the reply up to its end-of-turn token, not the template's
      # newline after it (decoding stops at the EOS).
      cut = next((j + 1 for j, x in enumerate(new)
                  if x in tokenizer.eos_ids), len(new)) if learn else 0
      ids += new
      mask += [True] * cut + [False] * (len(new) - cut)
      text = full
  return ids, mask


def sharegpt_examples(tokenizer: Tokenizer, num_conversations: int,
                      max_len: int, cache_dir: Optional[str] = None,
                      progress: bool = True) -> Examples:
  """The first ``num_conversations`` ShareGPT chats, cached as ``.npz``."""
  from specjax import data
  key = json.dumps(dict(v=2, n=num_conversations, T=max_len,
                        tok=hashlib.sha256(tokenizer.backend.to_str().encode()
                                           ).hexdigest()[:16]))
  digest = hashlib.sha256(key.encode()).hexdigest()[:16]
  cache = pathlib.Path(cache_dir or pathlib.Path.home() / ".cache" / "specjax")
  path = cache / f"eagle-sharegpt-{digest}.npz"
  if path.is_file():
    with np.load(path) as z:
      return Examples(z["ids"], z["mask"], z["lengths"])
  from tqdm.auto import tqdm
  rows_ids, rows_mask = [], []
  for turns in tqdm(data.sharegpt_conversations(num_conversations),
                    total=num_conversations, desc="tokenizing ShareGPT",
                    disable=not progress):
    try:
      ids, mask = encode_conversation(tokenizer, turns)
    except ValueError:  # a template quirk on this chat: skip it, keep going
      continue
    ids, mask = ids[:max_len], mask[:max_len]
    if any(mask):
      rows_ids.append(ids)
      rows_mask.append(mask)
  N = len(rows_ids)
  ex = Examples(np.zeros((N, max_len), np.int32), np.zeros((N, max_len), bool),
                np.array([len(r) for r in rows_ids], np.int32))
  for i, (a, m) in enumerate(zip(rows_ids, rows_mask)):
    ex.ids[i, :len(a)] = a
    ex.mask[i, :len(m)] = m
  cache.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp.npz")
  np.savez(tmp, ids=ex.ids, mask=ex.mask, lengths=ex.lengths)
  tmp.replace(path)
  return ex


def split(ex: Examples, heldout: int, seed: int = 0
          ) -> tuple[Examples, Examples]:
  """A fixed random (train, held-out) split, disjoint."""
  perm = np.random.default_rng(seed).permutation(len(ex))
  return ex.take(perm[heldout:]), ex.take(perm[:heldout])


def batch_indices(step: int, num_examples: int, batch_size: int,
                  seed: int) -> np.ndarray:
  """Rows of the batch at ``step``: epoch e walks permutation(seed, e)."""
  start = step * batch_size
  out = []
  while len(out) < batch_size:
    epoch, offset = divmod(start + len(out), num_examples)
    perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
    out.extend(perm[offset:offset + batch_size - len(out)].tolist())
  return np.asarray(out)
