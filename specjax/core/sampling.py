"""Logits -> probabilities: the one warping every code path uses.

Draft and target distributions must be warped identically for speculative
sampling to be exact, so every sampling option lives here and nowhere else.
The order: the penalties (repetition over the prompt and the generated
tokens, then presence and frequency over the generated tokens, as vLLM and
the OpenAI API define them), the logit bias, the allowed-token hook
(``AllowedTokens``: a token it forbids gets no mass), then transformers'
warpers:
temperature, top-k, top-p on the top-k-renormalized distribution, min-p;
ties at a cut-off are kept. All math in f32 whatever the model dtype.
Temperature 0 means greedy: the "distribution" is the one-hot of the argmax
(ties -> lowest id, like ``jnp.argmax``).

Static and traced. ``SamplingParams`` is static (hashable; part of
``DecodeConfig``): it decides the program -- greedy or sampled, the top-k
bound (a shape), whether top-p, min-p and the penalties are computed, how
many tokens carry a bias (a shape). Each row's values are data
(``RowSampling``, ``f32[B]``/``int32[B]``), so rows with different
temperatures, top-p or penalties share one batch and one compile as long as
they fit the program (``SamplingParams.program_of``, ``RowSampling.build``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal f32
F32_MAX = float(np.finfo(np.float32).max)


def require_int(name: str, value) -> None:
  """Raises ``TypeError`` unless ``value`` is an integer (numpy's too):
  never 4.0, True or "4"."""
  if isinstance(value, bool) or not hasattr(value, "__index__"):
    raise TypeError(f"{name} must be an int, got {value!r}")


def _finite(name: str, value, low: float = -math.inf,
            high: float = math.inf, low_open: bool = False) -> None:
  if not (isinstance(value, (int, float, np.number))
          and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high):
    if high < math.inf:
      bound = f" in {'(' if low_open else '['}{low:g}, {high:g}]"
    else:
      bound = f" {'>' if low_open else '>='} {low:g}" if low > -math.inf else ""
    raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
  """A logit bias (a dict or pairs) as checked ``(token id, bias)`` pairs."""
  pairs = tuple(bias.items()) if isinstance(bias, dict) else bias
  if not isinstance(pairs, (tuple, list)):
    raise TypeError(f"logit_bias must be a dict or (token id, bias) pairs, "
                    f"got {bias!r}")
  out = []
  for pair in pairs:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
      raise ValueError(f"logit_bias entries must be (token id, bias) pairs, "
                       f"got {pair!r}")
    require_int("a logit_bias token id", pair[0])
    if pair[0] < 0:
      raise ValueError(f"a logit_bias token id must be >= 0, got {pair[0]}")
    _finite(f"the logit bias of token {pair[0]}", pair[1])
    out.append((int(pair[0]), float(pair[1])))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling knobs (static, hashable: changing them recompiles; per-row
  values that fit one program are ``RowSampling``'s, module doc).

  Attributes:
    temperature: 0 for greedy, else a normal f32 (``F32_TINY`` up to
      ``F32_MAX``).
    top_k: keep the k most likely tokens; 0 disables.
    top_p: keep the most likely tokens until their mass reaches top_p, plus
      every token tied with the last one kept; 1 disables. In (0, 1].
    min_p: then keep the tokens whose probability is at least min_p times
      the most likely one's; 0 disables. In [0, 1].
    repetition_penalty: every token in the prompt or generated so far has
      its logit divided by it when positive, multiplied when negative
      (transformers', vLLM's); 1 disables. > 0.
    presence_penalty: subtracted from the logit of every token generated so
      far (not the prompt's); 0 disables.
    frequency_penalty: subtracted once per time a token was generated so
      far; 0 disables.
    logit_bias: ``((token id, bias), ...)`` added to those logits (a dict
      is accepted); a token listed twice gets both.
  The penalties read the context a sequential decoder would have at each
  position: the committed tokens plus, under speculation, the drafted
  tokens before the position on its chain or tree path.
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: tuple[tuple[int, float], ...] = ()

  def __post_init__(self):
    require_int("top_k", self.top_k)
    _finite("temperature", self.temperature, 0.0)
    # Acceptance math is f32: a temperature f32 cannot hold as a normal
    # number (XLA flushes subnormals to 0) would divide 0 by 0.
    if not (self.temperature == 0 or F32_TINY <= self.temperature <= F32_MAX):
      raise ValueError(f"temperature {self.temperature} is outside f32's "
                       f"range [{F32_TINY:.3g}, {F32_MAX:.3g}]; 0 is greedy")
    _finite("top_p", self.top_p, 0.0, 1.0, low_open=True)
    _finite("min_p", self.min_p, 0.0, 1.0)
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    _finite("repetition_penalty", self.repetition_penalty, 0.0,
            low_open=True)
    _finite("presence_penalty", self.presence_penalty)
    _finite("frequency_penalty", self.frequency_penalty)
    object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def check_vocab(self, vocab_size: int) -> None:
    """Raises ``ValueError`` when the bias names a token outside the
    vocabulary (a scatter there would be dropped without a word)."""
    for t, _ in self.logit_bias:
      if t >= vocab_size:
        raise ValueError(f"logit_bias names token {t}, outside the "
                         f"vocabulary [0, {vocab_size})")

  def for_vocab(self, vocab_size: int) -> "SamplingParams":
    """These settings checked against the vocabulary (``check_vocab``),
    with a top-k that keeps every token written as off (0): the same
    distribution without a top-k over the whole vocabulary."""
    self.check_vocab(vocab_size)
    return (dataclasses.replace(self, top_k=0) if self.top_k >= vocab_size
            else self)

  def record(self) -> dict:
    """The settings as a result row records them (JSON: the bias as
    ``[[id, bias], ...]``)."""
    fields = dataclasses.asdict(self)
    fields["logit_bias"] = [list(pair) for pair in self.logit_bias]
    return fields

  @property
  def penalized(self) -> bool:
    """Whether the program computes the penalties (and their history)."""
    return (self.repetition_penalty != 1 or self.presence_penalty != 0
            or self.frequency_penalty != 0)

  def program(self) -> "SamplingParams":
    """The canonical program of these settings (``program_of``)."""
    return SamplingParams.program_of([self])

  @staticmethod
  def program_of(settings: Sequence["SamplingParams"]) -> "SamplingParams":
    """The one program every row of ``settings`` runs in as its values
    (module doc), each value replaced by a canonical one: sampled if any
    row samples; the sampled rows' widest top-k as the bound; top-p and
    min-p on if a sampled row uses them (a greedy row's cuts never change
    its argmax); the penalties on if any row has one; room for the most
    biased tokens. Settings with one program compile to one program when
    their values are passed as ``RowSampling`` (``runner.generate_ids``
    does)."""
    sampled = [sp for sp in settings if not sp.greedy]
    uses = lambda on: any(map(on, sampled))
    return SamplingParams(
        temperature=1.0 if sampled else 0.0,
        top_k=max((sp.top_k for sp in sampled), default=0),
        top_p=0.5 if uses(lambda sp: sp.top_p < 1) else 1.0,
        min_p=0.5 if uses(lambda sp: sp.min_p > 0) else 0.0,
        repetition_penalty=2.0 if any(sp.penalized for sp in settings)
        else 1.0,
        logit_bias=((0, 0.0),) * max((len(sp.logit_bias) for sp in settings),
                                     default=0))

  def _cuts_misfit(self, program: "SamplingParams") -> Optional[str]:
    """What of top-k, top-p and min-p ``program`` cannot run, or None."""
    if program.top_k == 0 and self.top_k:
      return f"top_k {self.top_k} needs a program with a top-k bound"
    if self.top_k > program.top_k:
      return (f"top_k must be at most {program.top_k} (the program's "
              f"bound) or 0 (off), got {self.top_k}")
    if self.top_p < 1 and program.top_p == 1:
      return f"top_p {self.top_p} needs a program with top-p"
    if self.min_p > 0 and program.min_p == 0:
      return f"min_p {self.min_p} needs a program with min-p"
    return None

  def fits(self, program: "SamplingParams") -> Optional[str]:
    """None when these values can run in ``program``'s compiled program
    (module doc), else what does not fit. A greedy row's top-k, top-p and
    min-p never matter (the argmax survives them)."""
    if program.greedy and not self.greedy:
      return (f"temperature {self.temperature} needs a sampled program; "
              f"this one is greedy")
    why = None if self.greedy else self._cuts_misfit(program)
    if why:
      return why
    if self.penalized and not program.penalized:
      return "penalties need a program with penalties"
    if len(self.logit_bias) > len(program.logit_bias):
      return (f"{len(self.logit_bias)} biased tokens; the program has room "
              f"for {len(program.logit_bias)}")
    return None


@struct.dataclass
class RowSampling:
  """Each row's sampling values as data (``f32[B]``, ``int32[B]``; the
  bias ``[B, NB]``): what ``DecodeState.sampling`` carries. They are taken
  as given inside a jit; ``build`` checks them against the program (inside
  a jit, ``build(...).replace(temperature=t_B)`` gives traced values)."""
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array
  repetition_penalty: jax.Array
  presence_penalty: jax.Array
  frequency_penalty: jax.Array
  bias_ids: jax.Array
  bias_values: jax.Array

  @classmethod
  def build(cls, program: SamplingParams,
            rows: Sequence[SamplingParams]) -> "RowSampling":
    """One row per ``SamplingParams``, each checked to fit ``program``
    (``ValueError`` naming the row and what does not fit); biases padded
    with zeros to the program's count."""
    for b, sp in enumerate(rows):
      why = sp.fits(program)
      if why:
        raise ValueError(f"row {b}'s sampling does not fit the compiled "
                         f"program: {why}")
    # A greedy row's cuts are off (its argmax is the same under any).
    rows = [dataclasses.replace(sp, top_k=0, top_p=1.0, min_p=0.0)
            if sp.greedy else sp for sp in rows]
    nb = len(program.logit_bias)
    pad = lambda sp: sp.logit_bias + ((0, 0.0),) * (nb - len(sp.logit_bias))
    col = lambda f, dt: np.asarray([getattr(sp, f) for sp in rows], dt)
    f32 = np.float32
    return cls(
        temperature=col("temperature", f32), top_k=col("top_k", np.int32),
        top_p=col("top_p", f32), min_p=col("min_p", f32),
        repetition_penalty=col("repetition_penalty", f32),
        presence_penalty=col("presence_penalty", f32),
        frequency_penalty=col("frequency_penalty", f32),
        bias_ids=np.asarray([[t for t, _ in pad(sp)] for sp in rows],
                            np.int32).reshape(len(rows), nb),
        bias_values=np.asarray([[v for _, v in pad(sp)] for sp in rows],
                               f32).reshape(len(rows), nb))


def _on_paths(block_BW: jax.Array, anc_BWW: jax.Array):
  """Index arrays ``[B, W, W]`` over (row b, block position w, token j):
  ``b``, ``w``, the token ``block[b, j]``, and whether j is a drafted token
  on w's path (``anc[b, w, j]``, j > 0: position 0 is committed)."""
  B, W = block_BW.shape
  return (jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, W, W)),
          jnp.broadcast_to(jnp.arange(W)[None, :, None], (B, W, W)),
          jnp.broadcast_to(block_BW[:, None, :], (B, W, W)),
          anc_BWW & (jnp.arange(W) > 0)[None, None, :])


@struct.dataclass
class History:
  """What the penalties read, per row (and per block position: ``[B, W,
  V]``): ``seen`` the tokens of the prompt and generated so far,
  ``counts`` how often each was generated (f32)."""
  seen: jax.Array
  counts: jax.Array

  @classmethod
  def of(cls, tokens_BS: jax.Array, num_tokens_B: jax.Array,
         prompt_lengths_B: jax.Array, vocab_size: int) -> "History":
    """The committed tokens' history."""
    B, S = tokens_BS.shape
    idx_BS = jnp.arange(S)[None, :]
    b_BS = jnp.broadcast_to(jnp.arange(B)[:, None], (B, S))
    valid_BS = idx_BS < num_tokens_B[:, None]
    generated_BS = valid_BS & (idx_BS >= prompt_lengths_B[:, None])
    seen = jnp.zeros((B, vocab_size), bool).at[b_BS, tokens_BS].max(valid_BS)
    counts = jnp.zeros((B, vocab_size), jnp.float32).at[b_BS, tokens_BS].add(
        generated_BS.astype(jnp.float32))
    return cls(seen=seen, counts=counts)

  def add(self, tokens_B: jax.Array, where_B: jax.Array) -> "History":
    """``[B, V]`` history with each row's token appended where ``where``."""
    b_B = jnp.arange(tokens_B.shape[0])
    return History(seen=self.seen.at[b_B, tokens_B].max(where_B),
                   counts=self.counts.at[b_B, tokens_B].add(
                       where_B.astype(jnp.float32)))

  def along(self, block_BW: jax.Array, anc_BWW: jax.Array) -> "History":
    """``[B, W, V]``: the history at each block position, the committed
    one plus the drafted tokens on the position's path (``anc[b, w, j]``:
    j is w or its ancestor; block position 0, the newest token, is already
    committed)."""
    B, W = block_BW.shape
    b_BWW, w_BWW, tok_BWW, on_BWW = _on_paths(block_BW, anc_BWW)
    added = jnp.zeros((B, W, self.seen.shape[-1]), jnp.float32).at[
        b_BWW, w_BWW, tok_BWW].add(on_BWW.astype(jnp.float32))
    return History(seen=self.seen[:, None] | (added > 0),
                   counts=self.counts[:, None] + added)


# ``allowed(tokens [B, S], num_tokens [B], prompt_lengths [B]) -> bool[B, V]``:
# the tokens each row may generate next, given its context (prompt and
# generated tokens: ``tokens[b, :num_tokens[b]]``). Pure and traceable.
AllowedTokens = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@struct.dataclass
class Allowed:
  """An allowed-token hook (``AllowedTokens``, static) and the context it
  reads: ``tokens`` ``int32[B, S]`` and ``num_tokens`` ``int32[B]``, or a
  context per block position (``[B, W, S]``, ``[B, W]``)."""
  fn: AllowedTokens = struct.field(pytree_node=False)
  tokens: jax.Array
  num_tokens: jax.Array
  prompt_lengths: jax.Array

  def mask(self) -> jax.Array:
    """``bool[B, (W,) V]``."""
    if self.num_tokens.ndim == 1:
      return self.fn(self.tokens, self.num_tokens, self.prompt_lengths)
    return jax.vmap(lambda t, n: self.fn(t, n, self.prompt_lengths),
                    in_axes=1, out_axes=1)(self.tokens, self.num_tokens)

  def add(self, tokens_B: jax.Array, where_B: jax.Array) -> "Allowed":
    """Each row's token appended where ``where``."""
    b_B = jnp.arange(tokens_B.shape[0])
    slot_B = jnp.where(where_B, self.num_tokens, self.tokens.shape[1])
    return self.replace(
        tokens=self.tokens.at[b_B, slot_B].set(tokens_B, mode="drop"),
        num_tokens=jnp.minimum(self.num_tokens + where_B,
                               self.tokens.shape[1]))

  def along(self, block_BW: jax.Array, anc_BWW: jax.Array) -> "Allowed":
    """The context at each block position: the committed tokens, then the
    drafted tokens on the position's path in depth order (``History.along``'s
    positions)."""
    B, W = block_BW.shape
    S = self.tokens.shape[1]
    depth_BW = jnp.sum(anc_BWW, axis=-1) - 1
    b_BWW, w_BWW, tok_BWW, on_BWW = _on_paths(block_BW, anc_BWW)
    slot_BWW = jnp.where(on_BWW, self.num_tokens[:, None, None]
                         + depth_BW[:, None, :] - 1, S)
    tokens_BWS = jnp.broadcast_to(self.tokens[:, None], (B, W, S)).at[
        b_BWW, w_BWW, slot_BWW].set(tok_BWW, mode="drop")
    return self.replace(tokens=tokens_BWS, num_tokens=jnp.minimum(
        self.num_tokens[:, None] + depth_BW, S))


@struct.dataclass
class Sampler:
  """What a draw is warped with: the program (static), each row's values
  (None: the program's own, as constants), each row's history when the
  program has penalties, the allowed-token hook with its context when
  there is one, and where the EOS ids may not be drawn yet
  (``closed_eos``, ``bool[B, (W)]``: a row's ``min_new_tokens``).
  ``settled`` computes which tokens each position may draw once, for the
  warp and for the engine's test of a position that allows none."""
  params: SamplingParams = struct.field(pytree_node=False)
  rows: Optional[RowSampling] = None
  history: Optional[History] = None
  allowed: Optional[Allowed] = None
  closed_eos: Optional[jax.Array] = None
  eos_ids: tuple[int, ...] = struct.field(pytree_node=False, default=())
  allowed_mask: Optional[jax.Array] = None

  def advance(self, tokens_B: jax.Array, where_B: jax.Array) -> "Sampler":
    """The sampler after each row generated ``tokens_B`` (where
    ``where_B``): how a chain drafter's next position sees its drafts."""
    return self.replace(
        history=None if self.history is None
        else self.history.add(tokens_B, where_B),
        allowed=None if self.allowed is None
        else self.allowed.add(tokens_B, where_B), allowed_mask=None)

  def along(self, block_BW: jax.Array, anc_BWW: jax.Array) -> "Sampler":
    """The sampler of each position of a verify block (``History.along``,
    ``Allowed.along``)."""
    return self.replace(
        history=None if self.history is None
        else self.history.along(block_BW, anc_BWW),
        allowed=None if self.allowed is None
        else self.allowed.along(block_BW, anc_BWW), allowed_mask=None)

  def closing_eos(self, closed: jax.Array, eos_ids: Sequence[int]
                  ) -> "Sampler":
    """The EOS ids closed where ``closed`` (``bool[B, (W)]``)."""
    return self.replace(closed_eos=closed, eos_ids=tuple(eos_ids),
                        allowed_mask=None)

  def mask(self) -> Optional[jax.Array]:
    """``bool[B, (W,) V]``: the tokens each position may draw, the hook's
    with the closed EOS ids taken out; None without a hook."""
    if self.allowed_mask is not None or self.allowed is None:
      return self.allowed_mask
    mask = self.allowed.mask()
    if self.closed_eos is None or not self.eos_ids:
      return mask
    eos = jnp.asarray(self.eos_ids, jnp.int32)
    return mask.at[..., eos].set(mask[..., eos] & ~_fit(
        self.closed_eos[..., None], mask.ndim))

  def settled(self) -> "Sampler":
    """This sampler with its ``mask`` computed, once for every use."""
    return self.replace(allowed_mask=self.mask())

  def value(self, name: str, ndim: int):
    """The program's constant, or each row's value shaped ``[B, 1, ...,
    1]`` against logits of ``ndim`` dimensions."""
    if self.rows is None:
      return getattr(self.params, name)
    v = getattr(self.rows, name)
    return v.reshape(v.shape[:1] + (1,) * (ndim - 1))


def as_sampler(sampling: SamplingParams | Sampler) -> Sampler:
  return sampling if isinstance(sampling, Sampler) else Sampler(sampling)


def _fit(a: jax.Array, ndim: int) -> jax.Array:
  """A row's ``[B, ..., V]`` array against logits of ``ndim`` dimensions:
  ones inserted after the row axis (``[B, V]`` against ``[B, 1, V]``)."""
  return a.reshape(a.shape[:1] + (1,) * (ndim - a.ndim) + a.shape[1:])


def _penalize(logits_XV: jax.Array, s: Sampler) -> jax.Array:
  """Repetition, then presence and frequency penalties."""
  if s.history is None:
    raise ValueError("penalties need each row's history: warp with a "
                     "Sampler that carries one (the engine builds it)")
  h, nd = s.history, logits_XV.ndim
  seen, counts = _fit(h.seen, nd), _fit(h.counts, nd)
  r = s.value("repetition_penalty", nd)
  logits = jnp.where(seen, jnp.where(logits_XV > 0, logits_XV / r,
                                     logits_XV * r), logits_XV)
  return (logits - s.value("frequency_penalty", nd) * counts
          - s.value("presence_penalty", nd) * (counts > 0))


def _bias(logits_XV: jax.Array, s: Sampler) -> jax.Array:
  if s.rows is None:
    ids, values = zip(*s.params.logit_bias)
    return logits_XV.at[..., np.asarray(ids)].add(
        jnp.asarray(values, jnp.float32))
  B, V = s.rows.bias_ids.shape[0], logits_XV.shape[-1]
  bias_BV = jnp.zeros((B, V), jnp.float32).at[
      jnp.arange(B)[:, None], s.rows.bias_ids].add(s.rows.bias_values)
  return logits_XV + bias_BV.reshape((B,) + (1,) * (logits_XV.ndim - 2)
                                     + (V,))


def _top_k(logits, s: Sampler, V: int):
  """``(logits outside each row's top k at -inf, the bound or 0)``; a
  row's k of 0 keeps every token."""
  sp = s.params
  bound = (min(sp.top_k, V) if s.rows is not None
           else (sp.top_k if sp.top_k < V else 0))
  if not bound:
    return logits, 0
  top_vals = jax.lax.top_k(logits, bound)[0]
  k = jnp.broadcast_to(jnp.asarray(s.value("top_k", logits.ndim)),
                       logits.shape[:-1] + (1,))
  kth = jnp.take_along_axis(top_vals, jnp.clip(k, 1, bound) - 1, axis=-1)
  kth = jnp.where(k == 0, -jnp.inf, kth)
  return jnp.where(logits < kth, -jnp.inf, logits), bound


# Without a top-k bound, top-p looks for its cut among this many most
# likely tokens, and searches the whole vocabulary only when they hold less
# than p (``_mass_cut``): on a CPU a sort of 49,152 probabilities costs ~9
# ms a position, a top 64 ~0.1 ms.
TOP_P_CANDIDATES = 64


def _mass_cut(probs, p):
  """The smallest probability x at which the tokens more likely than x
  hold less than p of the mass, by bisection over f32 bit patterns (31
  passes over the vocabulary, no sort): top-p keeps exactly the tokens at
  or above it (the sorted rule's set; sums in another order)."""
  below = lambda x: jnp.sum(jnp.where(probs > x, probs, 0.0), axis=-1,
                            keepdims=True) < p
  as_f32 = lambda b: jax.lax.bitcast_convert_type(b, jnp.float32)
  hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1, keepdims=True),
                                    jnp.int32)
  lo = jnp.zeros_like(hi)  # below(0) is False: all the mass is above 0

  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = below(as_f32(mid))
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  _, hi = jax.lax.fori_loop(0, 31, halve, (lo, hi))
  return as_f32(hi)


def _top_p(probs, s: Sampler, bound: int):
  """Probabilities after each row's top-p (``bound``: the top-k bound, the
  survivors' count; 0: the whole vocabulary), renormalized."""
  p = s.value("top_p", probs.ndim)

  def threshold(sorted_p):  # the smallest probability kept
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep = mass_before < p  # the top token always survives
    return jnp.min(jnp.where(keep, sorted_p, jnp.inf), axis=-1,
                   keepdims=True)

  if bound and s.rows is None:  # every row's top-k survivors, sorted
    cut_at = threshold(jax.lax.top_k(probs, bound)[0])
  else:
    # The cut lies among the candidates (the bound's survivors, else the
    # most likely ``TOP_P_CANDIDATES``) when they hold p of the mass: every
    # token after them has at least that much before it. A row without
    # top-k in a program with a bound may hold less there.
    top = jax.lax.top_k(probs, bound or min(TOP_P_CANDIDATES,
                                            probs.shape[-1]))[0]
    inside = (jnp.sum(top, axis=-1, keepdims=True) >= p) | (p >= 1)
    cut_at = jax.lax.cond(jnp.all(inside), lambda: threshold(top),
                          lambda: _mass_cut(probs, p))
  cut = jnp.where(probs >= cut_at, probs, 0.0)
  return _renormalized(cut, probs, s, p >= 1)


def _min_p(probs, s: Sampler):
  top = jnp.max(probs, axis=-1, keepdims=True)  # always survives
  min_p = s.value("min_p", probs.ndim)
  cut = jnp.where(probs >= min_p * top, probs, 0.0)
  return _renormalized(cut, probs, s, min_p <= 0)


def _renormalized(cut, probs, s: Sampler, off):
  """The cut distribution renormalized; with each row's values, a row
  whose value turns the option ``off`` keeps ``probs`` bit for bit (as in
  a program without the option)."""
  cut = cut / jnp.sum(cut, axis=-1, keepdims=True)
  return cut if s.rows is None else jnp.where(off, probs, cut)


def _restrict(logits_XV: jax.Array, s: Sampler) -> jax.Array:
  """-inf where a position may not draw the token: outside the hook's
  mask, or an EOS id where it is closed."""
  mask = s.mask()
  if mask is not None:
    return jnp.where(_fit(mask, logits_XV.ndim), logits_XV, -jnp.inf)
  if s.closed_eos is None or not s.eos_ids:
    return logits_XV
  eos = jnp.asarray(s.eos_ids, jnp.int32)
  closed = _fit(s.closed_eos[..., None], logits_XV.ndim)
  return logits_XV.at[..., eos].set(
      jnp.where(closed, -jnp.inf, logits_XV[..., eos]))


def warp(logits_XV: jax.Array, sampling: SamplingParams | Sampler
         ) -> jax.Array:
  """Probabilities ``f32[..., V]`` after the penalties, the logit bias,
  the allowed tokens, temperature, top-k, top-p and min-p (module doc). ``sampling``: the
  static settings, or a ``Sampler`` with each row's values and history
  (rows on the first axis)."""
  s = as_sampler(sampling)
  sp = s.params
  logits = logits_XV.astype(jnp.float32)
  V = logits.shape[-1]
  if sp.penalized:
    logits = _penalize(logits, s)
  if sp.logit_bias:
    logits = _bias(logits, s)
  logits = _restrict(logits, s)
  if sp.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
  temperature = s.value("temperature", logits.ndim)
  if s.rows is not None:  # a greedy row inside a sampled program
    greedy_row = temperature == 0
    argmax_X = jnp.argmax(logits, axis=-1)
    temperature = jnp.where(greedy_row, 1.0, temperature)
  # Shift first: the max becomes 0, so even a tiny temperature gives -inf,
  # never NaN, for the other tokens.
  logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
  logits, bound = _top_k(logits, s, V)
  probs = jax.nn.softmax(logits, axis=-1)
  if sp.top_p < 1:
    probs = _top_p(probs, s, bound)
  if sp.min_p > 0:
    probs = _min_p(probs, s)
  if s.rows is not None:
    probs = jnp.where(greedy_row, jax.nn.one_hot(argmax_X, V,
                                                 dtype=jnp.float32), probs)
  return probs


def seed_key(seed: int) -> jax.Array:
  """The PRNG key of an integer seed, every bit of it counted. Without
  x64, ``jax.random.key`` keeps a seed's low 32 bits only (2**32 and 0
  give one key); here the bits above fold in, so seeds below 2**32 keep
  the keys they always had and larger ones get their own. Taken modulo
  2**63 (a CLI's seed plus a prompt's index may pass it)."""
  require_int("seed", seed)
  seed = int(seed) % 2**63
  key = jax.random.key(seed & 0xFFFFFFFF)
  return jax.random.fold_in(key, seed >> 32) if seed >> 32 else key


def split(key: jax.Array, num: int = 2) -> jax.Array:
  """``jax.random.split`` of one key (``[num]``) or of a key per row
  (``key[B]`` -> ``[num, B]``, row b's from key[b] alone): index the first
  axis either way."""
  if jnp.ndim(key) == 0:
    return jax.random.split(key, num)
  return jax.vmap(lambda k: jax.random.split(k, num), out_axes=1)(key)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """U[0, 1) draws of ``shape``: from one key, or row b's (the first axis)
  from ``key[b]`` alone."""
  if jnp.ndim(key) == 0:
    return jax.random.uniform(key, shape)
  return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(key)


def sample(probs_XV: jax.Array, key: jax.Array) -> jax.Array:
  """One token per leading index from probabilities (zeros are never
  drawn); with a key per row (``key[B]``), row b's from ``key[b]`` alone."""
  pick = lambda p, k: jax.random.categorical(k, jnp.log(p), axis=-1)
  if jnp.ndim(key) == 0:
    return pick(probs_XV, key).astype(jnp.int32)
  return jax.vmap(pick)(probs_XV, key).astype(jnp.int32)


def draw(probs_XV: jax.Array, sampling: SamplingParams | Sampler,
         key: jax.Array) -> jax.Array:
  """``int32[...]`` tokens from ``warp``-ed probabilities: the argmax when
  the program is greedy (no random draw), else a sample (a greedy row's
  one-hot gives its argmax)."""
  if as_sampler(sampling).params.greedy:
    return jnp.argmax(probs_XV, axis=-1).astype(jnp.int32)
  return sample(probs_XV, key)


def sample_logits(logits_XV: jax.Array, sampling: SamplingParams | Sampler,
                  key: jax.Array) -> jax.Array:
  """``int32[...]`` next tokens from logits (``draw`` of ``warp``)."""
  return draw(warp(logits_XV, sampling), sampling, key)
