"""Retrieval drafting: continue the suffix with what a corpus says comes next.

REST / suffix-decoding style, without a suffix array: every context n-gram
(``n_min <= n <= n_max``) of a corpus is hashed into a fixed-size table that
stores its most frequent next token and that token's empirical probability.
Proposing looks up the longest suffix of each row's tokens that is in the
table, takes its next token, appends it to a virtual context and looks up
again, K times: drafts chain through the table. A row stops drafting at the
first miss (ragged ``num_draft``, possibly 0). As a tree drafter it also
follows what the shorter suffixes propose where they disagree with the
longest: a trie of one chain per suffix order. The table is the drafter's
params (``Datastore``, a pytree of three ``[num_slots]`` arrays), so lookups
are a handful of gathers inside the jitted step: no host work, fixed shapes.

The table is direct-mapped: a context lives in slot ``hash1 & (num_slots - 1)``
and a second, independent 32-bit hash (``check``) rejects the other contexts
that map to the same slot. When contexts collide at build time the one whose
stored continuation was seen more often wins. Both hashes are uint32
polynomial-style mixes written with operators only (``^ * >>``), so the numpy
build and the jnp lookup run the very same code and agree bit for bit.

Build with ``build_datastore`` from token streams, or ``sharegpt_datastore``
from ShareGPT assistant turns (cached as ``.npz``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import ClassVar, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters.base import Context, Proposal, TableTrie

# Bump when the hash or the table layout changes: old caches become misses.
_FORMAT_VERSION = 1

_U32 = np.uint32
_MASK32 = 0xFFFFFFFF
# Two chains with unrelated seeds and multipliers give two hashes of the same
# context that collide independently (odd multipliers keep the map a bijection
# per token).
_SEED1, _SEED2 = _U32(0x811C9DC5), _U32(0x243F6A88)
_MUL1, _MUL2 = _U32(0x01000193), _U32(0x9E3779B1)
_SALT1, _SALT2 = 0x7F4A7C15, 0x1B873593

DEFAULT_NUM_CONVERSATIONS = 4000
DEFAULT_NUM_SLOTS = 2**21


def _absorb(h, token, mul):
  """Folds one more (older) token into a chain; the shift feeds the high bits
  back into the low ones, which are the slot index."""
  h = (h ^ token) * mul
  return h ^ (h >> _U32(15))


def _finalize(h, n: int, salt: int):
  """murmur3's fmix32 after mixing in the length, so the n-gram and the
  (n+1)-gram that extends it do not share structure."""
  h = h ^ _U32((n * 0x9E3779B9 + salt) & _MASK32)
  h = h ^ (h >> _U32(16))
  h = h * _U32(0x85EBCA6B)
  h = h ^ (h >> _U32(13))
  h = h * _U32(0xC2B2AE35)
  return h ^ (h >> _U32(16))


def context_hashes(context_BN, n_min: int, n_max: int):
  """Both hashes of the last n tokens of each context, for n_min..n_max.

  Works on numpy and on jax arrays alike (same operators, same wraparound),
  which is what lets a numpy-built table be read from jitted code.

  Args:
    context_BN: ``uint32[..., N]`` (N >= n_max) contexts, newest token last.
    n_min, n_max: the n-gram orders to hash.

  Returns:
    ``{n: (hash1 uint32[...], hash2 uint32[...])}`` for each n; slot =
    ``hash1 & (num_slots - 1)``, ``hash2`` is the stored check.
  """
  N = context_BN.shape[-1]
  if not 1 <= n_min <= n_max <= N:
    raise ValueError(f"need 1 <= n_min <= n_max <= {N}, got {n_min}, {n_max}")
  zeros = context_BN[..., 0] * _U32(0)
  h1, h2 = zeros + _SEED1, zeros + _SEED2
  out = {}
  # Newest first: the chain after n tokens hashes exactly the length-n suffix,
  # so one pass yields every order.
  for n in range(1, n_max + 1):
    token = context_BN[..., N - n]
    h1, h2 = _absorb(h1, token, _MUL1), _absorb(h2, token, _MUL2)
    if n >= n_min:
      out[n] = (_finalize(h1, n, _SALT1), _finalize(h2, n, _SALT2))
  return out


@struct.dataclass
class Datastore:
  """The retrieval table: the drafter's params.

  Attributes:
    check: ``uint32[num_slots]`` second hash of the context stored in a slot.
    next_token: ``int32[num_slots]`` its most frequent next token; -1 = empty.
    confidence: ``f32[num_slots]`` count(context, next) / count(context).
  """
  check: jax.Array
  next_token: jax.Array
  confidence: jax.Array

  @property
  def num_slots(self) -> int:
    return self.next_token.shape[0]

  @property
  def fill(self) -> float:
    """Fraction of slots in use (host-side; for reporting)."""
    return float(np.mean(np.asarray(self.next_token) >= 0))


def build_datastore(token_streams: Sequence[Sequence[int] | np.ndarray], *,
                    n_min: int = 1, n_max: int = 4,
                    num_slots: int = DEFAULT_NUM_SLOTS,
                    min_count: int = 1) -> Datastore:
  """Counts every (context n-gram, next token) pair and fills the table.

  N-grams never span two streams. Vectorized numpy: one sort to name the
  distinct contexts, one to count (context, next) pairs, one to settle slot
  collisions.

  Args:
    token_streams: token id sequences (e.g. one per assistant turn).
    n_min, n_max: context lengths to store.
    num_slots: table size, a power of two.
    min_count: contexts whose best continuation was seen fewer times are left
      out (1 keeps everything).

  Returns:
    A numpy-backed ``Datastore`` (pass it to jit as is, or ``jax.device_put``).
  """
  if num_slots < 1 or num_slots & (num_slots - 1):
    raise ValueError(f"num_slots must be a power of two, got {num_slots}")
  if not 1 <= n_min <= n_max:
    raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
  streams = [np.asarray(s, np.int64).reshape(-1) for s in token_streams]
  lengths = np.array([len(s) for s in streams], np.int64)
  tokens_N = (np.concatenate(streams) if streams
              else np.zeros((0,), np.int64))
  if tokens_N.size and (tokens_N.min() < 0 or tokens_N.max() > 2**31 - 1):
    raise ValueError("token ids must be in [0, 2**31)")
  # Position of each token inside its own stream: a context of n tokens
  # exists iff at least n tokens precede it there.
  starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
  offset_N = np.arange(tokens_N.size, dtype=np.int64) - starts

  # Row i of the window holds the n_max tokens before token i, newest last
  # (garbage where the stream has fewer; masked by offset below).
  window_NW = np.zeros((tokens_N.size, n_max), np.uint32)
  for j in range(1, n_max + 1):
    window_NW[j:, n_max - j] = tokens_N[:-j] if j < tokens_N.size else []
  hashes = context_hashes(window_NW, n_min, n_max)
  keys, nexts = [], []
  for n, (h1, h2) in hashes.items():
    valid = offset_N >= n
    keys.append((h1[valid].astype(np.uint64) << np.uint64(32))
                | h2[valid].astype(np.uint64))
    nexts.append(tokens_N[valid])
  del window_NW, hashes
  key_M = np.concatenate(keys)
  next_M = np.concatenate(nexts)
  del keys, nexts

  check = np.zeros((num_slots,), np.uint32)
  next_token = np.full((num_slots,), -1, np.int32)
  confidence = np.zeros((num_slots,), np.float32)
  if key_M.size == 0:
    return Datastore(check, next_token, confidence)

  ctx_keys_C, ctx_M = np.unique(key_M, return_inverse=True)
  V = int(next_M.max()) + 1
  pairs_P, pair_counts_P = np.unique(ctx_M.astype(np.int64) * V + next_M,
                                     return_counts=True)
  del key_M, next_M, ctx_M
  pair_ctx_P, pair_next_P = pairs_P // V, pairs_P % V
  # Pairs come sorted by context then token: contexts are contiguous groups
  # and, within a group, the first maximal count has the smallest token id
  # (a deterministic tie break).
  group_starts_C = np.flatnonzero(np.diff(pair_ctx_P, prepend=-1))
  best_count_C = np.maximum.reduceat(pair_counts_P, group_starts_C)
  total_C = np.add.reduceat(pair_counts_P, group_starts_C)
  is_best_P = pair_counts_P == best_count_C[pair_ctx_P]
  best_P = np.flatnonzero(is_best_P)
  first_P = best_P[np.diff(pair_ctx_P[best_P], prepend=-1) != 0]
  best_next_C = pair_next_P[first_P]

  keep_C = np.flatnonzero(best_count_C >= min_count)
  slot_C = (ctx_keys_C[keep_C] >> np.uint64(32)) & np.uint64(num_slots - 1)
  # One stable sort on (slot, descending count): the first of each slot wins.
  # Counts are below 2**32, so both fit one uint64 key; ties keep key order.
  count_C = best_count_C[keep_C].astype(np.uint64)
  order = np.argsort((slot_C << np.uint64(32)) | (np.uint64(_MASK32) - count_C),
                     kind="stable")
  slot_sorted = slot_C[order]
  winners = order[np.diff(slot_sorted.astype(np.int64), prepend=-1) != 0]
  won_C = keep_C[winners]
  slots = slot_C[winners].astype(np.int64)
  check[slots] = (ctx_keys_C[won_C] & np.uint64(_MASK32)).astype(np.uint32)
  next_token[slots] = best_next_C[won_C]
  confidence[slots] = best_count_C[won_C] / total_C[won_C]
  return Datastore(check, next_token, confidence)


def save_datastore(ds: Datastore, path: str | os.PathLike) -> None:
  """Writes the table as an uncompressed ``.npz`` (atomically: a concurrent
  reader sees either nothing or the whole file)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
  try:
    with open(tmp, "wb") as f:
      np.savez(f, check=np.asarray(ds.check),
               next_token=np.asarray(ds.next_token),
               confidence=np.asarray(ds.confidence))
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def load_datastore(path: str | os.PathLike) -> Datastore:
  """Reads a table written by ``save_datastore``."""
  with np.load(path) as z:
    return Datastore(check=z["check"], next_token=z["next_token"],
                     confidence=z["confidence"])


def _tokenizer_fingerprint(tokenizer) -> str:
  """Digest of the full tokenizer (vocab, merges, pre-tokenizer): a change to
  any of them changes the ids, so the cached table must not be reused."""
  digest = hashlib.sha256(tokenizer.backend.to_str().encode("utf-8"))
  digest.update(repr(tuple(tokenizer.eos_ids)).encode())
  return digest.hexdigest()[:16]


def sharegpt_datastore(tokenizer, *,
                       num_conversations: Optional[int] =
                       DEFAULT_NUM_CONVERSATIONS,
                       n_min: int = 1, n_max: int = 4,
                       num_slots: int = DEFAULT_NUM_SLOTS, min_count: int = 1,
                       cache_dir: str | os.PathLike | None = None,
                       progress: bool = True) -> Datastore:
  """A table from the assistant turns of the first ShareGPT conversations.

  Each assistant turn is its own stream (no n-gram crosses a turn boundary),
  followed by the tokenizer's first EOS id so the table can also propose the
  end of a turn. The result is cached under ``cache_dir`` (default
  ``~/.cache/specjax``) keyed by every argument that changes it and a
  fingerprint of the tokenizer; a later call with the same key just loads it.

  Args:
    tokenizer: a ``specjax.models.tokenizer.Tokenizer``.
    num_conversations: how many conversations to read (None = all ~17.5k).
    n_min, n_max, num_slots, min_count: as in ``build_datastore``.
    cache_dir: where the ``.npz`` lives.
    progress: show a tqdm bar while tokenizing.
  """
  from specjax import data  # only needed here; keeps the drafter import light
  key = json.dumps(dict(
      version=_FORMAT_VERSION, source="sharegpt-assistant",
      num_conversations=num_conversations, n_min=n_min, n_max=n_max,
      num_slots=num_slots, min_count=min_count,
      tokenizer=_tokenizer_fingerprint(tokenizer)), sort_keys=True)
  digest = hashlib.sha256(key.encode()).hexdigest()[:16]
  cache_dir = pathlib.Path(cache_dir if cache_dir is not None else
                           pathlib.Path.home() / ".cache" / "specjax")
  path = cache_dir / f"retrieval-sharegpt-{digest}.npz"
  if path.is_file():
    return load_datastore(path)

  from tqdm.auto import tqdm
  texts = [text for conv in data.sharegpt_conversations(num_conversations)
           for role, text in conv if role == "assistant"]
  end = list(tokenizer.eos_ids[:1])
  streams = []
  chunk = 256  # encode_batch parallelizes inside a chunk; chunks feed the bar
  with tqdm(total=len(texts), unit="turn", desc="tokenizing ShareGPT",
            disable=not progress) as bar:
    for i in range(0, len(texts), chunk):
      batch = tokenizer.backend.encode_batch(texts[i:i + chunk],
                                             add_special_tokens=False)
      streams.extend(np.array(e.ids + end, np.int32) for e in batch)
      bar.update(len(batch))
  ds = build_datastore(streams, n_min=n_min, n_max=n_max, num_slots=num_slots,
                       min_count=min_count)
  save_datastore(ds, path)
  return ds


@dataclasses.dataclass(frozen=True)
class RetrievalDrafter(TableTrie):
  """Drafts by chained longest-suffix lookups in a ``Datastore``.

  Attributes:
    n_min, n_max: suffix lengths tried, longest first; use the range the
      table was built with (other lengths simply miss).
    min_confidence: a row also stops at a looked-up token whose stored
      probability is below this (0 = draft whatever matches).
  """
  n_min: int = 1
  n_max: int = 4
  min_confidence: float = 0.0
  needs_params: ClassVar[bool] = True  # the Datastore

  def __post_init__(self):
    if not 1 <= self.n_min <= self.n_max:
      raise ValueError(f"need 1 <= n_min <= n_max, got {self.n_min}, "
                       f"{self.n_max}")

  def _table(self, params: Datastore):
    """The table's arrays as jax arrays (H: table slots). A numpy-backed
    table (straight from the builder) cannot be indexed by tracers; under
    jit this is a no-op."""
    return tuple(jnp.asarray(a) for a in (params.check, params.next_token,
                                          params.confidence))

  def _window(self, tokens_BS, num_tokens_B):
    """``[B, n_max]``: the last n_max committed tokens; positions before the
    row start are never read because an n-gram needs length >= n."""
    S, N = tokens_BS.shape[1], self.n_max
    idx_BN = num_tokens_B[:, None] - N + jnp.arange(N)[None, :]
    return jnp.take_along_axis(tokens_BS, jnp.clip(idx_BN, 0, S - 1), axis=1)

  def _lookup(self, table, window_RN, length_R):
    """Per suffix order, shortest first (``[R, O]``, O = n_max - n_min + 1):
    the stored next token, its confidence, and whether the order hit."""
    check_H, next_H, conf_H = table
    mask = jnp.uint32(next_H.shape[0] - 1)
    hashes = context_hashes(window_RN.astype(jnp.uint32), self.n_min,
                            self.n_max)
    tokens, confs, hits = [], [], []
    for n in range(self.n_min, self.n_max + 1):
      h1_R, h2_R = hashes[n]
      slot_R = (h1_R & mask).astype(jnp.int32)
      next_R = next_H[slot_R]
      hits.append((check_H[slot_R] == h2_R) & (next_R >= 0) & (length_R >= n))
      tokens.append(next_R)
      confs.append(conf_H[slot_R])
    return (jnp.stack(tokens, 1), jnp.stack(confs, 1), jnp.stack(hits, 1))

  def _chain(self, table, window_RN, length_R, num_draft: int):
    """``(drafts [R, K], num_draft [R])``: K chained longest-suffix lookups,
    each row stopping at its first miss (or low-confidence token)."""
    R = window_RN.shape[0]

    def body(k, carry):
      window_RN, length_R, alive_R, num_R, drafts_RK = carry
      token_RO, conf_RO, hit_RO = self._lookup(table, window_RN, length_R)
      # The longest order that hit (if none did, hit_R is False below).
      longest_R1 = (hit_RO.shape[1] - 1
                    - jnp.argmax(hit_RO[:, ::-1], axis=1))[:, None]
      token_R, conf_R, hit_R = (jnp.take_along_axis(a_RO, longest_R1, 1)[:, 0]
                                for a_RO in (token_RO, conf_RO, hit_RO))
      alive_R &= hit_R & (conf_R >= self.min_confidence)
      token_R = jnp.where(alive_R, token_R, 0)
      drafts_RK = drafts_RK.at[:, k].set(token_R)
      # Drafts extend the context the next lookup sees (a stopped row's
      # window no longer matters).
      window_RN = jnp.concatenate([window_RN[:, 1:], token_R[:, None]], axis=1)
      return (window_RN, length_R + 1, alive_R,
              num_R + alive_R.astype(jnp.int32), drafts_RK)

    carry = (window_RN, length_R, jnp.ones((R,), bool),
             jnp.zeros((R,), jnp.int32), jnp.zeros((R, num_draft), jnp.int32))
    *_, num_R, drafts_RK = jax.lax.fori_loop(0, num_draft, body, carry)
    return drafts_RK, num_R

  def propose(self, params: Datastore, state, ctx: Context, key, num_draft,
              sampling) -> Proposal:
    del key, sampling
    drafts_BK, num_B = self._chain(self._table(params),
                                   self._window(ctx.tokens, ctx.num_tokens),
                                   ctx.num_tokens, num_draft)
    return Proposal(tokens=drafts_BK, probs=None, num_drafted=num_B,
                    state=state)

  def paths(self, params: Datastore, ctx: Context, num_draft):
    """``(tokens [B, P, K], lengths [B, P])``: path p starts with the token
    stored for the (p+1)-th longest suffix (the chain's first draft for p =
    0, then the shorter contexts' alternatives) and continues as the chain
    does, up to ``num_draft`` deep; an order that missed gives an empty
    path. Their trie is ``propose_tree`` (``TableTrie``): orders that agree
    share one path."""
    tokens_BS, num_tokens_B = ctx.tokens, ctx.num_tokens
    B, K = tokens_BS.shape[0], num_draft
    table = self._table(params)
    window_BN = self._window(tokens_BS, num_tokens_B)
    token_BO, conf_BO, hit_BO = self._lookup(table, window_BN, num_tokens_B)
    # Longest first; an order that missed gives an empty path.
    first_BP, ok_BP = token_BO[:, ::-1], (hit_BO & (
        conf_BO >= self.min_confidence))[:, ::-1]
    P = first_BP.shape[1]
    window_RN = jnp.concatenate([
        jnp.repeat(window_BN[:, None, 1:], P, axis=1), first_BP[..., None]],
                                axis=2).reshape(B * P, self.n_max)
    rest_RK, num_R = self._chain(table, window_RN,
                                 jnp.repeat(num_tokens_B, P) + 1, K - 1)
    paths_BPK = jnp.concatenate([first_BP[..., None],
                                 rest_RK.reshape(B, P, K - 1)], axis=2)
    lengths_BP = jnp.where(ok_BP, 1 + num_R.reshape(B, P), 0)
    return paths_BPK, lengths_BP
