"""The draft vocabulary: the Vd most frequent target tokens of the training data.

The head scores only these Vd ids (a smaller LM head: most of its FLOPs);
tokens outside can never be drafted, which costs acceptance, never exactness
(verification always uses the full target distribution). Ids are kept sorted
so draft index i maps to target id ``ids[i]`` (the reference stores the same
map as offsets ``d2t[i] = ids[i] - i``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import jax
import numpy as np
from flax import struct


@struct.dataclass
class DraftVocab:
  """Attributes:
    ids: ``int32[Vd]`` target ids of the draft vocabulary, ascending.
    in_vocab: ``bool[V]`` whether a target id is in it.
  """
  ids: jax.Array
  in_vocab: jax.Array

  @property
  def size(self) -> int:
    return self.ids.shape[0]

  @classmethod
  def from_ids(cls, ids, vocab_size: int) -> "DraftVocab":
    ids = np.sort(np.asarray(ids, np.int32))
    in_vocab = np.zeros(vocab_size, bool)
    in_vocab[ids] = True
    return cls(ids=ids, in_vocab=in_vocab)


def build_draft_vocab(token_streams: Iterable[Sequence[int]], vocab_size: int,
                      size: int, always: Sequence[int] = ()) -> DraftVocab:
  """Counts ids over ``token_streams`` (e.g. assistant tokens only) and keeps
  the ``size`` most frequent, plus every id in ``always`` (EOS must stay
  draftable); ties and unseen ids are filled in id order."""
  if not 0 < size <= vocab_size:
    raise ValueError(f"draft vocab size must be in [1, {vocab_size}], got "
                     f"{size}")
  counts = np.zeros(vocab_size, np.int64)
  for s in token_streams:
    np.add.at(counts, np.asarray(s, np.int64), 1)
  forced = np.unique(np.asarray(list(always), np.int64))
  counts[forced] = np.iinfo(np.int64).max  # first in line
  order = np.argsort(-counts, kind="stable")  # stable: ties by id
  return DraftVocab.from_ids(order[:size], vocab_size)


def draft_rows(lm_head_VD: jax.Array, vocab: DraftVocab) -> jax.Array:
  """The target's LM-head rows (``Target.lm_head``) of the draft
  vocabulary, ``[Vd, D]``: the head's LM-head init and the recomputed
  target logits of a feature cache."""
  return jax.numpy.asarray(lm_head_VD)[jax.numpy.asarray(vocab.ids)]


def full_vocab_logits(logits_XVd: jax.Array, draft_ids: jax.Array,
                      vocab_size: int) -> jax.Array:
  """A head's logits over Vd placed in the full vocabulary (f32, -inf at
  every id outside Vd): what drafters hand to sampling, so draft
  probabilities are full-vocabulary distributions."""
  full = jax.numpy.full(logits_XVd.shape[:-1] + (vocab_size,), -jax.numpy.inf,
                        jax.numpy.float32)
  return full.at[..., draft_ids].set(logits_XVd.astype(jax.numpy.float32))
