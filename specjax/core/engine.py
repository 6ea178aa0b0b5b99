"""The decode engine: ``prefill``, ``step`` and ``generate`` over a ``DecodeState``.

One engine for autoregressive and speculative decoding. A step proposes up to
K drafts per row (``DecodeConfig.drafter``; none = AR, K = 0), runs one target
forward over ``[newest token, drafts]``, verifies them exactly
(``verify.verify_chain``), writes each row's emitted tokens at its own offset
and rolls the target cache back by setting its lengths.

Everything here is a pure function: ``generate`` is one ``lax.while_loop`` of
``step`` and can be traced inside a caller's own ``jax.jit`` (no host
callbacks, no Python branching on traced values, no hidden state). The
``*_jit`` variants are the public jitted boundary; ``step_jit`` donates the
state so the cache is updated in place, and ``stream`` drives it from Python
for notebooks.

Token bookkeeping: ``tokens[b, :num_tokens[b]]`` is row b's prompt plus what
it generated; the last of these has been sampled but not yet fed to the model,
so the target cache always holds ``num_tokens - 1`` entries while a row runs.
A step writes K + 1 cache entries from slot ``num_tokens - 1`` on; only the
accepted ones stay below the new length, the rest are masked and overwritten.

Non-finite logits (a NaN or inf from broken weights or an overflow), and a
position where the allowed-token hook allows nothing, are never sampled
from: a chain verifies its drafts up to the first such position (each
draft is tested at the position before it), and a row whose accepted
drafts reach it stops there with ``STOP_NONFINITE``, keeping them, as AR
would stop after the same tokens; a tree's nodes whose own or an
ancestor's position is such are cut (the target's draw at the parent is
emitted instead). A row whose newest token's position is such emits
nothing and stops.

A prompt length outside ``[1, Tp]`` (nothing to condition on, or more
tokens than the padded prompt holds) is never decoded from: the row emits
nothing and stops with ``STOP_BAD_PROMPT`` (``runner.generate_ids`` refuses
such prompts before anything runs; this is the jitted API's answer, where a
length is a traced value and cannot raise).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.core import sharding, tree as trees
from specjax.core.cache import KVCache
from specjax.core.rows import at_rows, set_at_rows
from specjax.core.sampling import (Allowed, AllowedTokens, History,
                                   RowSampling, Sampler, SamplingParams, draw,
                                   require_int, split, warp)
from specjax.core.verify import verify_chain
from specjax.drafters.base import (Context, Drafter, Riders, RidingDrafter,
                                   TreeDrafter)
from specjax.models.target import ForwardOutput, Target, missing_members

# Per-row stop reasons (``DecodeState.stop_reason``).
(RUNNING, STOP_EOS, STOP_BUDGET, STOP_CAPACITY, STOP_NONFINITE,
 STOP_BAD_PROMPT, STOP_SEQUENCE) = range(7)
STOP_NAMES = {RUNNING: "running", STOP_EOS: "eos", STOP_BUDGET: "length",
              STOP_CAPACITY: "capacity", STOP_NONFINITE: "nonfinite",
              STOP_BAD_PROMPT: "bad_prompt", STOP_SEQUENCE: "stop"}


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Static decode settings (hashable; a jit static argument).

  Attributes:
    capacity: S, slots of the KV cache and of the token buffer. Pick it from
      ``bucketing.capacity_for`` (with ``extra = num_draft + 1``) so nearby
      request sizes share one compile.
    sampling: the sampling program (``core.sampling``: greedy or not, the
      top-k bound, which options), shared by drafter and target; its values
      are every row's unless ``prefill`` gets a ``RowSampling``.
    eos_ids: tokens that end a row (the EOS itself is kept in the output).
    stop_sequences: token sequences that end a row where one is generated
      (kept in the output, like an EOS; the whole sequence among the
      generated tokens), checked at every position of an accepted block.
    drafter: a ``drafters.base.Drafter`` or None for plain AR decoding.
    num_draft: K, drafts per step (ignored without a drafter): the one place
      K is set; the drafter gets it from the engine. For trees, the deepest
      path.
    tree_nodes: 0 for chains; else a tree step with up to this many drafted
      nodes per row (the drafter must be a ``TreeDrafter``).
    mesh: a ``jax.sharding.Mesh`` (``sharding.make_mesh``) the state is laid
      out on (``sharding.state_specs``: rows over ``data``, the cache's kv
      heads over ``model``), with the parameters placed by
      ``sharding.shard_params``; None: wherever XLA puts it (one device).
    prefill_chunk: a prompt longer than this is scored in chunks of this
      many tokens (``prefill``), so the prefill's attention scores are
      ``[B, N, chunk, S]``, never ``[B, N, Tp, S]``: memory linear in the
      prompt. Chunks past every row's prompt are skipped, so the chunk also
      bounds the bucket padding that is computed (128: at most 127 pad
      tokens; chunks of 128 cost no more per token than chunks of 512 on
      the CPU, docs/RESULTS.md "Long prompts").
    allowed_tokens: a hook (``sampling.AllowedTokens``, hashable: a
      function) saying which tokens each row may generate next from its
      context; applied to the target and to sampled drafts at every
      position, along each drafted prefix and tree path. A position where
      it allows nothing ends the row (``STOP_NONFINITE``).
    pearl: draft while verifying (``core.pearl``): each step the drafter
      drafts K tokens behind the drafts the target scores in the same step;
      a chain drafter that reads only tokens, or a P-EAGLE head. On a mesh
      with a ``role`` axis (``pearl.make_mesh``) the two halves run on
      disjoint device groups at once.
  """
  capacity: int
  sampling: SamplingParams = SamplingParams()
  eos_ids: tuple[int, ...] = ()
  stop_sequences: tuple[tuple[int, ...], ...] = ()
  drafter: Optional[Drafter] = None
  num_draft: int = 0
  tree_nodes: int = 0
  mesh: Optional[jax.sharding.Mesh] = None
  prefill_chunk: int = 128
  allowed_tokens: Optional[AllowedTokens] = None
  pearl: bool = False

  def __post_init__(self):
    for name in ("capacity", "num_draft", "tree_nodes", "prefill_chunk"):
      require_int(name, getattr(self, name))
    if self.prefill_chunk < 1:
      raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
    if self.allowed_tokens is not None and not callable(self.allowed_tokens):
      raise TypeError(f"allowed_tokens must be a function (tokens, "
                      f"num_tokens, prompt_lengths) -> bool[B, V], got "
                      f"{self.allowed_tokens!r}")
    for seq in self.stop_sequences:
      if not (isinstance(seq, tuple) and seq and all(
          isinstance(t, int) and not isinstance(t, bool) and t >= 0
          for t in seq)):
        raise ValueError(f"each stop sequence must be a non-empty tuple of "
                         f"token ids, got {seq!r}")
    if self.capacity < 1 or self.num_draft < 0 or self.tree_nodes < 0:
      raise ValueError(f"capacity must be >= 1, num_draft and tree_nodes >= "
                       f"0; got {self.capacity}, {self.num_draft}, "
                       f"{self.tree_nodes}")
    if self.drafter is not None and not isinstance(self.drafter, Drafter):
      missing = [m for m in ("feature_taps", "needs_params", "init",
                             "propose", "commit")
                 if not hasattr(self.drafter, m)]
      raise TypeError(f"drafter must implement specjax.drafters.Drafter; "
                      f"{type(self.drafter).__name__} lacks "
                      f"{', '.join(missing)}")
    if self.drafter is not None and self.num_draft < 1:
      raise ValueError(f"a drafter needs num_draft >= 1, got "
                       f"{self.num_draft}")
    if self.tree_nodes and not isinstance(self.drafter, TreeDrafter):
      raise ValueError(f"tree_nodes={self.tree_nodes} needs a drafter that "
                       f"proposes trees, not {type(self.drafter).__name__}")
    if isinstance(self.drafter, RidingDrafter) and not self.tree_nodes:
      raise ValueError(f"{type(self.drafter).__name__} drafts trees only "
                       "(its riders are scored beside one): give tree_nodes")
    if isinstance(self.drafter, RidingDrafter):
      self.drafter.num_riders(self.k)  # refuses a K it cannot ride beside
    if self.tree_nodes > trees.MAX_NODES:
      raise ValueError(f"tree_nodes={self.tree_nodes} is more than "
                       f"{trees.MAX_NODES}, the largest tree specjax builds")
    if self.block > self.capacity:
      raise ValueError(f"a step scores {self.block} tokens per row, more "
                       f"than the capacity {self.capacity}")
    if not isinstance(self.pearl, bool):
      raise TypeError(f"pearl must be True or False, got {self.pearl!r}")
    if self.pearl:
      from specjax.core import pearl
      pearl.check_config(self)

  @property
  def k(self) -> int:
    return self.num_draft if self.drafter is not None else 0

  @property
  def block(self) -> int:
    """Tokens a verify forward verifies per row: the newest plus the
    drafts."""
    return block_width(self.k, self.tree_nodes)

  @property
  def width(self) -> int:
    """Tokens a verify forward scores per row: the block and a
    ``RidingDrafter``'s riders; PEARL's ``[newest, pending]``, K."""
    if self.pearl:
      return self.k
    if isinstance(self.drafter, RidingDrafter):
      return self.block + self.drafter.num_riders(self.k)
    return self.block


def block_width(num_draft: int, tree_nodes: int = 0) -> int:
  """``DecodeConfig.block`` of K drafts (a chain) or of a tree's nodes."""
  return 1 + (tree_nodes or num_draft)


@struct.dataclass
class DecodeState:
  """Everything a decode loop carries.

  Attributes:
    tokens: ``int32[B, S]`` prompt + generated tokens, left-aligned.
    num_tokens: ``int32[B]`` valid entries of ``tokens``.
    logprobs: ``f32[B, S]`` aligned with ``tokens``: each generated token's
      log-probability under the distribution it was sampled from (the
      target's after every sampling option, ``sampling.warp``: 0 for
      greedy's argmax);
      0 at prompt positions. A speculative token's is the target's at its
      position, read from the verify forward that scored it.
    raw_logprobs: ``f32[B, S]`` the same tokens under the target's own
      distribution (log-softmax of its logits, T = 1).
    sampling: each row's sampling values (``RowSampling``) in
      ``DecodeConfig.sampling``'s program, or None: that program's own
      values for every row (constants of the compiled program).
    prompt_lengths: ``int32[B]``.
    max_new_tokens: ``int32[B]`` each row's budget of generated tokens.
    min_new_tokens: ``int32[B]`` generated tokens before which a row can
      neither sample an EOS (its logits are masked, as transformers'
      ``min_new_tokens``) nor end on a stop sequence.
    stop_reason: ``int32[B]``: RUNNING, STOP_EOS, STOP_SEQUENCE,
      STOP_BUDGET, STOP_CAPACITY, STOP_NONFINITE or STOP_BAD_PROMPT.
    cache: target KV cache, ``lengths == num_tokens - 1`` while running.
    drafter_state: the drafter's own state (e.g. its cache), or None.
    key: PRNG key for the next step: one for the batch, or one per row
      (``key[B]``: then a row's draws come from its own key alone, so its
      output does not depend on the other rows).
    num_steps: ``int32[]`` target forwards after the prefill (batch-wide).
    num_wide: ``int32[]`` of those, the ones over all K + 1 tokens (the rest
      scored the newest token alone: no live row had drafted).
    num_forwards: ``int32[B]`` target forwards each row took part in while
      running (after the prefill).
    num_drafted: ``int32[B]`` drafts proposed to the row.
    accepted_at: ``int32[B, K]`` how often draft position i was accepted.
    accepted_nodes: ``int32[B, N]`` tree steps: how often drafted node
      m + 1 was on the accepted path (N = ``tree_nodes``; none for chains).
      For a static tree a node is always the same (depth, rank).
  """
  tokens: jax.Array
  num_tokens: jax.Array
  logprobs: jax.Array
  raw_logprobs: jax.Array
  sampling: Optional[RowSampling]
  prompt_lengths: jax.Array
  max_new_tokens: jax.Array
  min_new_tokens: jax.Array
  stop_reason: jax.Array
  cache: KVCache
  drafter_state: Any
  key: jax.Array
  num_steps: jax.Array
  num_wide: jax.Array
  num_forwards: jax.Array
  num_drafted: jax.Array
  accepted_at: jax.Array
  accepted_nodes: jax.Array

  @property
  def done(self) -> jax.Array:
    return self.stop_reason != RUNNING

  @property
  def num_new_tokens(self) -> jax.Array:
    return self.num_tokens - self.prompt_lengths

  @property
  def context(self) -> Context:
    """The committed tokens, as drafters see them."""
    return Context(tokens=self.tokens, num_tokens=self.num_tokens)

  def sampler(self, dcfg: DecodeConfig, vocab_size: int) -> Sampler:
    """What the next position is warped with: the program, each row's
    values, with penalties each row's committed history, and the
    allowed-token hook with each row's context."""
    history = allowed = None
    if dcfg.sampling.penalized:
      history = History.of(self.tokens, self.num_tokens, self.prompt_lengths,
                           vocab_size)
    if dcfg.allowed_tokens is not None:
      allowed = Allowed(dcfg.allowed_tokens, self.tokens, self.num_tokens,
                        self.prompt_lengths)
    return Sampler(dcfg.sampling, self.sampling, history, allowed)


def _laid_out(state: DecodeState, target: Target,
              dcfg: DecodeConfig) -> DecodeState:
  """The state pinned to ``dcfg.mesh``'s layout (a no-op without one), so
  the loop carry keeps one sharding from step to step."""
  if dcfg.mesh is None:
    return state
  return sharding.constrain(
      state, sharding.state_specs(state, target, dcfg.mesh), dcfg.mesh)


def _update_stops(state: DecodeState, hit_eos_B: jax.Array,
                  dcfg: DecodeConfig,
                  nonfinite_B: Optional[jax.Array] = None,
                  bad_prompt_B: Optional[jax.Array] = None,
                  hit_stop_B: Optional[jax.Array] = None) -> DecodeState:
  """Marks rows that just stopped; the first reason to fire wins."""
  clauses = (
      (STOP_BAD_PROMPT, False if bad_prompt_B is None else bad_prompt_B),
      (STOP_NONFINITE, False if nonfinite_B is None else nonfinite_B),
      (STOP_EOS, hit_eos_B),
      (STOP_SEQUENCE, False if hit_stop_B is None else hit_stop_B),
      (STOP_BUDGET, state.num_new_tokens >= state.max_new_tokens),
      # The token buffer is full: AR's clause for every method (``_draft``
      # clips the drafts to the slots left, so speculation never stops a
      # row earlier than AR would).
      (STOP_CAPACITY, state.num_tokens >= dcfg.capacity),
  )
  reason = state.stop_reason
  for code, fired in reversed(clauses):
    reason = jnp.where((state.stop_reason == RUNNING) & fired, code, reason)
  return state.replace(stop_reason=reason)


def _feature_taps(dcfg: DecodeConfig) -> tuple[int, ...]:
  """Target layers whose inputs the drafter reads (EAGLE); usually none."""
  return () if dcfg.drafter is None else tuple(dcfg.drafter.feature_taps)


def _features(out: ForwardOutput):
  """``[B, T, n_taps * D]`` tapped hidden states side by side, or None."""
  if out.taps is None:
    return None
  return jnp.concatenate(list(out.taps), axis=-1)


def _verify_forward(params, target: Target, block_BT, cache, taps, width: int,
                    positions_BT=None, mask_BTT=None,
                    write: bool = False) -> ForwardOutput:
  """The target forward over the first ``width`` tokens of the block (at
  ``positions``, under ``mask``: a tree's; default a chain's): its logits,
  taps and new entries zero-padded back to the block's width (fixed shapes
  for ``lax.cond``; verification never reads past a row's drafts). The
  caller writes the entries it keeps (``KVCache.write``): inside the
  ``lax.cond`` the cache is only read, and the write after it depends on
  its outputs, so XLA never copies the cache.

  With ``write`` (AR's one token, scored with no ``lax.cond``) each
  layer writes its entry before it attends: written after the forward,
  nothing would order the write after the layer's read, and XLA would copy
  every layer's keys and values, all S slots, every step."""
  if positions_BT is not None:
    positions_BT, mask_BTT = positions_BT[:, :width], mask_BTT[:, :width,
                                                               :width]
  out = target.forward(params, block_BT[:, :width], cache, taps=taps,
                       positions_BT=positions_BT, mask_BTT=mask_BTT,
                       write_cache=write)
  extra = block_BT.shape[1] - width
  if not extra:
    return out
  pad = lambda a, axis: jnp.pad(a, [(0, extra if i == axis else 0)
                                    for i in range(a.ndim)])
  return out.replace(logits=pad(out.logits, 1),
                     taps=None if out.taps is None else pad(out.taps, 2),
                     new_kv=jax.tree.map(lambda a: pad(a, 1), out.new_kv))


def _nothing_allowed(logits_BTV: jax.Array, sampler: Sampler) -> jax.Array:
  """NaN at each position where ``sampler`` (settled) allows no token,
  the hook's mask with the closed EOS ids taken out: the non-finite cut
  treats it as a position with no distribution to sample (module doc)."""
  mask = sampler.mask()
  if mask is None:
    return logits_BTV
  if mask.ndim == 2:  # one position per row (the prefill's)
    mask = mask[:, None]
  return jnp.where(~jnp.any(mask, axis=-1)[..., None], jnp.nan, logits_BTV)


def _finite(logits_BTV: jax.Array) -> jax.Array:
  """``bool[B, T]``: every logit at the position is finite."""
  return jnp.all(jnp.isfinite(logits_BTV), axis=-1)


def _usable_logits(logits_BTV: jax.Array, finite_BT: jax.Array) -> jax.Array:
  """Non-finite positions zeroed: the step never reads them (their drafts
  or nodes are cut), and nothing computed over the block can turn NaN."""
  return jnp.where(finite_BT[..., None], logits_BTV, 0.0)


def _chain_cut(logits_BTV: jax.Array, num_draft_B: jax.Array):
  """A chain step's non-finite logits (module doc): ``(usable logits, drafts
  to verify, the first non-finite position or T)``. Draft j is tested at
  position j - 1, so the drafts up to the first non-finite position are
  verified; accepting all of them would read it, and the row stops there
  instead (``_verify``)."""
  finite_BT = _finite(logits_BTV)
  first_bad_B = jnp.where(jnp.all(finite_BT, axis=1), finite_BT.shape[1],
                          jnp.argmin(finite_BT, axis=1))
  return (_usable_logits(logits_BTV, finite_BT),
          jnp.minimum(num_draft_B, first_bad_B), first_bad_B)


def _tree_cut(logits_BMV: jax.Array, tree, anc_BMM: jax.Array,
              live_B: jax.Array):
  """A tree step's non-finite logits (module doc): ``(usable logits, the
  tree without the nodes whose logits or an ancestor's are not finite,
  live rows that stop)``: such a node can neither end the path nor have
  its children accepted."""
  finite_BM = _finite(logits_BMV)
  valid_BM = tree.valid & ~jnp.any(anc_BMM & ~finite_BM[:, None, :], axis=-1)
  return (_usable_logits(logits_BMV, finite_BM),
          tree.replace(valid=valid_BM.at[:, 0].set(True)),
          live_B & ~finite_BM[:, 0])


def _is_eos(tokens, dcfg: DecodeConfig):
  return jnp.isin(tokens, jnp.asarray(dcfg.eos_ids or (-1,), jnp.int32))


def _stop_ends(state: DecodeState, tokens_BT: jax.Array,
               dcfg: DecodeConfig) -> jax.Array:
  """``bool[B, T]``: a stop sequence ends at new token j (the row's
  committed tokens, then ``tokens``), all of it among the generated tokens
  and at or past the row's ``min_new_tokens``."""
  L = max(map(len, dcfg.stop_sequences))
  B, T = tokens_BT.shape
  hist_BH = jnp.arange(1 - L, 0)[None, :] + state.num_tokens[:, None]
  seq_BX = jnp.concatenate(
      [at_rows(state.tokens, jnp.maximum(hist_BH, 0)), tokens_BT], axis=1)
  generated_BX = jnp.concatenate(
      [hist_BH >= state.prompt_lengths[:, None], jnp.ones((B, T), bool)], 1)
  ends_BT = jnp.zeros((B, T), bool)
  for stop in dcfg.stop_sequences:
    idx_TL = (np.arange(T)[:, None] + (L - len(stop))
              + np.arange(len(stop))[None, :])
    stop_11L = jnp.asarray(stop, jnp.int32)[None, None, :]
    ends_BT |= (jnp.all(seq_BX[:, idx_TL] == stop_11L, axis=-1)
                & jnp.all(generated_BX[:, idx_TL], axis=-1))
  new_BT = state.num_new_tokens[:, None] + jnp.arange(T)[None, :]
  return ends_BT & (new_BT >= state.min_new_tokens[:, None])


def prefill(params, prompt_BT: jax.Array,
            prompt_lengths_B: jax.Array, key: jax.Array,
            max_new_tokens: jax.Array | int, *, target: Target,
            dcfg: DecodeConfig, drafter_params: Any = None,
            min_new_tokens: jax.Array | int = 0,
            sampling: Optional[RowSampling] = None) -> DecodeState:
  """Runs the prompts (right-padded to a bucket) and samples each first token.

  Args:
    prompt_BT: ``int32[B, Tp]`` prompts padded on the right (any pad id).
    prompt_lengths_B: true lengths, each in ``[1, Tp]`` (a row outside
      it stops at once as ``STOP_BAD_PROMPT``).
    key: one PRNG key, or one per row (``key[B]``, ``DecodeState.key``).
    max_new_tokens: budget of generated tokens, at least 1 (the prefill
      always samples one): one for all rows or ``int32[B]``, each row's (an
      array: changing it does not recompile).
    min_new_tokens: tokens each row generates before an EOS or a stop
      sequence can end it (``DecodeState.min_new_tokens``); one or per row.
    drafter_params: the drafter's parameters (a pytree), if it has any.
    sampling: each row's sampling values (``RowSampling``; data: changing
      them does not recompile), which must fit ``dcfg.sampling``'s program
      (``RowSampling.build`` checks); None: ``dcfg.sampling``'s values, as
      constants of the program.
    target: the model (``models.target.Target``; static), e.g.
      ``Model.target``.
  """
  missing = missing_members(target)
  if missing:
    raise TypeError(f"target must implement specjax.Target (a model's "
                    f"``.target``); {type(target).__name__} lacks "
                    f"{', '.join(missing)}")
  if (dcfg.drafter is not None and drafter_params is None
      and dcfg.drafter.needs_params):
    raise TypeError(f"{type(dcfg.drafter).__name__} needs drafter_params "
                    f"(its head, weights or datastore); got None")
  B, Tp = prompt_BT.shape
  S = dcfg.capacity
  V = target.config.vocab_size
  dcfg.sampling.check_vocab(V)
  if dcfg.pearl:
    from specjax.core import pearl
    pearl.check_key(dcfg, key)
  if Tp >= S:  # the first sampled token needs a slot after the prompt
    raise ValueError(f"prompt bucket {Tp} must be below cache capacity {S}")
  given = jnp.asarray(prompt_lengths_B, jnp.int32)
  bad_B = (given < 1) | (given > Tp)
  lengths = jnp.where(bad_B, 1, given)  # decoded from, then discarded
  cache = target.init_cache(params, B, S)
  if dcfg.mesh is not None:
    cache = sharding.constrain(
        cache, sharding.cache_specs(cache, target, dcfg.mesh), dcfg.mesh)
  out = _score_prompt(params, target, prompt_BT, lengths, cache,
                      _feature_taps(dcfg), dcfg.prefill_chunk)
  drafter_state = None
  if dcfg.drafter is not None:
    drafter_state = dcfg.drafter.init(drafter_params,
                                      Context(prompt_BT, lengths), S, dcfg.k,
                                      _features(out))
  if dcfg.pearl:
    drafter_state = pearl.nothing_pending(drafter_state, B, dcfg.k, V)
  zeros_B = jnp.zeros((B,), jnp.int32)
  per_row = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (B,))
  zeros_BS = jnp.zeros((B, S), jnp.float32)
  state = DecodeState(
      tokens=jnp.zeros((B, S), jnp.int32).at[:, :Tp].set(prompt_BT),
      num_tokens=lengths, logprobs=zeros_BS, raw_logprobs=zeros_BS,
      sampling=None if sampling is None
      else jax.tree.map(jnp.asarray, sampling),
      prompt_lengths=lengths, max_new_tokens=per_row(max_new_tokens),
      min_new_tokens=per_row(min_new_tokens), stop_reason=zeros_B,
      cache=out.cache.with_lengths(lengths),
      drafter_state=drafter_state, key=key,
      num_steps=jnp.zeros((), jnp.int32), num_wide=jnp.zeros((), jnp.int32),
      num_forwards=zeros_B,
      num_drafted=zeros_B, accepted_at=jnp.zeros((B, dcfg.k), jnp.int32),
      accepted_nodes=jnp.zeros((B, dcfg.tree_nodes), jnp.int32))
  # The first token: sampled from the prompt's last logits and emitted as
  # a block of one (EOS, stop sequences and the budget as in a step).
  key, sub = split(key)
  sampler = state.sampler(dcfg, V).closing_eos(
      state.min_new_tokens > 0, dcfg.eos_ids).settled()
  logits_B1V = _nothing_allowed(out.logits, sampler)
  ok_B = _finite(logits_B1V)[:, 0] & ~bad_B
  logits_B1V = _usable_logits(logits_B1V, ok_B[:, None])
  q_B1V = warp(logits_B1V, sampler)
  first_B1 = draw(q_B1V, sampler, sub)
  state, n_B, hit_eos_B, hit_stop_B = _emit(
      state.replace(key=key), first_B1, ok_B.astype(jnp.int32), ok_B, dcfg,
      _token_logprobs(logits_B1V, q_B1V, jnp.zeros((B, 1), jnp.int32),
                      first_B1))
  state = state.replace(num_tokens=lengths + n_B)
  return _laid_out(_update_stops(state, hit_eos_B, dcfg, nonfinite_B=~ok_B,
                                 bad_prompt_B=bad_B, hit_stop_B=hit_stop_B),
                   target, dcfg)


def _score_prompt(params, target: Target, prompt_BT, lengths_B, cache, taps,
                  chunk: int) -> ForwardOutput:
  """The prompt's forward: the cache filled (``prefill`` then sets each
  row's length), each row's logits at its last token (``[B, 1, V]``) and
  the taps at every prompt position. A prompt longer than ``chunk`` goes
  through the forward one chunk at a time (a ``lax.scan``): chunk c is
  written after the prompt's first c * chunk tokens, the same positions
  and visibility as one forward, so only the order of float sums
  differs. A chunk past every row's prompt (bucket padding) is skipped."""
  B, Tp = prompt_BT.shape
  if Tp <= chunk:
    return target.forward(params, prompt_BT, cache, taps=taps,
                          logit_positions_BP=(lengths_B - 1)[:, None])
  num = -(-Tp // chunk)
  padded = jnp.pad(prompt_BT, ((0, 0), (0, num * chunk - Tp)))
  by_chunk = padded.reshape(B, num, chunk).transpose(1, 0, 2)  # [num, B, chunk]
  last_B = lengths_B - 1

  def run(cache, logits_B1V, start, tokens_BT):
    out = target.forward(
        params, tokens_BT, cache.with_lengths(jnp.full((B,), start, jnp.int32)),
        taps=taps, logit_positions_BP=jnp.clip(last_B - start, 0,
                                               chunk - 1)[:, None])
    here_B = (last_B >= start) & (last_B < start + chunk)
    logits_B1V = jnp.where(here_B[:, None, None], out.logits, logits_B1V)
    return (out.cache, logits_B1V), jnp.asarray(out.taps) if taps else None

  def skip(cache, logits_B1V, start, tokens_BT):
    taps_shape = jax.eval_shape(run, cache, logits_B1V, start, tokens_BT)[1]
    return (cache, logits_B1V), jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), taps_shape)

  def body(carry, xs):
    c, tokens_BT = xs
    start = c * chunk
    return jax.lax.cond(start <= jnp.max(last_B), run, skip,
                        *carry, start, tokens_BT)

  V = target.config.vocab_size
  (cache, logits), taps_by_chunk = jax.lax.scan(
      body, (cache, jnp.zeros((B, 1, V), jnp.float32)),
      (jnp.arange(num), by_chunk))
  if taps:  # [num, taps, B, chunk, D] -> [taps, B, Tp, D]
    n, D = taps_by_chunk.shape[1], taps_by_chunk.shape[-1]
    taps_by_chunk = taps_by_chunk.transpose(1, 2, 0, 3, 4).reshape(
        n, B, num * chunk, D)[:, :, :Tp]
  return ForwardOutput(logits=logits, cache=cache,
                       taps=taps_by_chunk if taps else None)


@struct.dataclass
class _Draft:
  """One step's drafts as the block the target scores: a chain's
  ``[newest token, drafts]`` at the next positions under the causal mask,
  or a tree's nodes at their depths under the ancestor mask.

  Attributes:
    block: ``int32[B, W]`` the tokens scored, W = ``DecodeConfig.block``.
    num_drafted: ``int32[B]`` drafted tokens (nodes) per row, the newest
      token not counted.
    drafter_state: the drafter's state after proposing.
    probs: a chain's draft distributions ``f32[B, K, V]``, or None (a
      deterministic drafter, a tree).
    tree: a tree step's ``core.tree.Tree``, or None (a chain).
    anc: the tree's ancestor mask ``bool[B, W, W]``, or None.
    riders: a ``RidingDrafter``'s riders, scored after the block, or None.
  """
  block: jax.Array
  num_drafted: jax.Array
  drafter_state: Any
  probs: Optional[jax.Array] = None
  tree: Optional[trees.Tree] = None
  anc: Optional[jax.Array] = None
  riders: Optional[Riders] = None


def drafter_context(state: DecodeState, drafter: Drafter) -> Context:
  """What ``drafter.propose`` reads: the committed tokens, and the
  target's cache for a drafter whose ``reads_target_cache`` is true."""
  if getattr(drafter, "reads_target_cache", False):
    return state.context.replace(cache=state.cache)
  return state.context


def _draft(drafter_params, state: DecodeState, dcfg: DecodeConfig,
           sampler: Sampler, key: jax.Array) -> _Draft:
  """The drafter's chain or tree, cut to what the row's buffer and cache
  can still take (a step emits up to its accepted depth + 1 tokens); AR
  (K = 0): the newest token alone."""
  ctx = drafter_context(state, dcfg.drafter)
  room_B = dcfg.capacity - ctx.num_tokens - 1  # < 0 only in a stopped row
  if dcfg.tree_nodes:
    prop = dcfg.drafter.propose_tree(drafter_params, state.drafter_state, ctx,
                                     key, dcfg.k, dcfg.tree_nodes, sampler)
    tree = prop.tree
    anc_BMM = trees.ancestors(tree.parents, tree.valid)
    fits_BM = ((trees.depths(anc_BMM) <= room_B[:, None])
               & (jnp.arange(dcfg.block)[None, :] <= room_B[:, None] + 1))
    tree = tree.replace(valid=tree.valid & fits_BM)
    return _Draft(block=tree.tokens, num_drafted=tree.num_drafted,
                  drafter_state=prop.state, tree=tree, anc=anc_BMM,
                  riders=prop.riders)
  newest_B1 = ctx.newest()[:, None]
  if not dcfg.k:
    return _Draft(block=newest_B1, num_drafted=jnp.zeros_like(room_B),
                  drafter_state=state.drafter_state)
  prop = dcfg.drafter.propose(drafter_params, state.drafter_state, ctx, key,
                              dcfg.k, sampler)
  return _Draft(block=jnp.concatenate([newest_B1, prop.tokens], axis=1),
                num_drafted=jnp.minimum(prop.num_drafted,
                                        jnp.maximum(room_B, 0)),
                drafter_state=prop.state, probs=prop.probs)


def _score(params, cache: KVCache, draft: _Draft, live_B: jax.Array, *,
           target: Target, dcfg: DecodeConfig):
  """The target forward over the draft's block: ``(out, wide)``. When no
  live row drafted (no n-gram match, an unconfident head), it scores the
  newest token alone (``wide`` False): on a CPU a forward over the block
  costs more than a one-token one. A draft with riders always scores the
  block and its riders (``_with_riders``), their logits after the block's."""
  positions_BT = mask_BTT = None
  block_BT = draft.block
  if draft.tree is not None:
    positions_BT = trees.positions(cache.lengths, draft.anc)
    mask_BTT = draft.anc
  if draft.riders is not None:
    block_BT, positions_BT, mask_BTT = _with_riders(
        draft.block, positions_BT, mask_BTT, draft.riders)
  verify = functools.partial(_verify_forward, params, target, block_BT,
                             cache, _feature_taps(dcfg),
                             positions_BT=positions_BT, mask_BTT=mask_BTT)
  if draft.riders is not None:
    return verify(block_BT.shape[1]), jnp.any(live_B)
  wide = jnp.any((draft.num_drafted > 0) & live_B)
  if not dcfg.k:
    return verify(1, write=True), wide
  return jax.lax.cond(wide, lambda: verify(dcfg.block),
                      lambda: verify(1)), wide


def _with_riders(block_BM, positions_BM, anc_BMM, riders: Riders):
  """A tree's block with the riders after it: ``(tokens, positions, mask)``
  of ``M + E`` tokens, the riders placed after the root and seeing it and
  what ``riders.sees`` marks, the tree's nodes seeing none of them."""
  B, M = block_BM.shape
  E = riders.tokens.shape[1]
  sees_BEE = jnp.broadcast_to(riders.sees, (B, E, E))
  root_BEM = jnp.broadcast_to(jnp.arange(M) == 0, (B, E, M))
  mask_BTT = jnp.concatenate([
      jnp.concatenate([anc_BMM, jnp.zeros((B, M, E), bool)], axis=2),
      jnp.concatenate([root_BEM, sees_BEE], axis=2)], axis=1)
  positions_BE = positions_BM[:, :1] + riders.offsets[None, :]
  return (jnp.concatenate([block_BM, riders.tokens], axis=1),
          jnp.concatenate([positions_BM, positions_BE], axis=1), mask_BTT)


def _verify(state: DecodeState, draft: _Draft, logits_BWV: jax.Array,
            live_B: jax.Array, sampler: Sampler, key: jax.Array,
            dcfg: DecodeConfig):
  """Exact verification of the draft against the target's logits, after
  the non-finite cut (module doc): ``(result, path, log-probs, rows that
  stop)``. Each position is warped with ``sampler`` along its path (the
  penalties count the drafts before it, the allowed-token hook reads
  them). ``path`` is the block position each emitted token was scored at
  (a tree's accepted nodes by depth; None for a chain: its first
  positions); log-probs are ``_token_logprobs``' of the result's tokens."""
  new_B1 = state.num_new_tokens[:, None]
  B, W = draft.block.shape
  chain = draft.tree is None
  anc_BWW = (jnp.broadcast_to(jnp.tri(W, dtype=bool), (B, W, W)) if chain
             else draft.anc)
  new_BW = new_B1 + (jnp.arange(W)[None, :] if chain
                     else trees.depths(draft.anc))
  at_block = sampler.along(draft.block, anc_BWW).closing_eos(
      new_BW < state.min_new_tokens[:, None], dcfg.eos_ids).settled()
  logits_BWV = _nothing_allowed(logits_BWV, at_block)
  if chain:
    logits, num_drafted_B, first_bad_B = _chain_cut(logits_BWV,
                                                    draft.num_drafted)
    q_BWV = warp(logits, at_block)
    res = verify_chain(draft.block[:, 1:], draft.probs, q_BWV, num_drafted_B,
                       key, greedy=dcfg.sampling.greedy)
    # Every draft before the first non-finite position accepted: the row
    # emits them and stops (no token comes from that position).
    nonfinite_B = live_B & (res.num_accepted == first_bad_B)
    res = res.replace(num_emitted=jnp.where(nonfinite_B, res.num_accepted,
                                            res.num_emitted))
    path_BK1 = None
    at_BK1 = jnp.broadcast_to(jnp.arange(res.tokens.shape[1]),
                              res.tokens.shape)
  else:
    logits, tree, nonfinite_B = _tree_cut(logits_BWV, draft.tree, draft.anc,
                                          live_B)
    q_BWV = warp(logits, at_block)
    res = trees.verify_tree(tree, draft.anc, q_BWV, key, sampler, dcfg.k)
    res = res.replace(num_emitted=jnp.where(nonfinite_B, 0, res.num_emitted))
    path_BK1 = at_BK1 = res.path
  return (res, path_BK1, _token_logprobs(logits, q_BWV, at_BK1, res.tokens),
          nonfinite_B)


def _token_logprobs(logits_BWV: jax.Array, q_BWV: jax.Array,
                    at_BT: jax.Array, tokens_BT: jax.Array):
  """``(log q, log softmax(logits))`` of ``tokens[b, j]`` at block position
  ``at[b, j]``, ``f32[B, T]`` each: under the warped distribution ``q`` it
  was sampled from and under the target's own (T = 1)."""
  b_B1 = jnp.arange(tokens_BT.shape[0])[:, None]
  logits_BWV = logits_BWV.astype(jnp.float32)
  lse_BW = jax.nn.logsumexp(logits_BWV, axis=-1)
  return (jnp.log(q_BWV[b_B1, at_BT, tokens_BT]),
          logits_BWV[b_B1, at_BT, tokens_BT] - lse_BW[b_B1, at_BT])


def _on_path(x, path_BK1: Optional[jax.Array]):
  """The block positions on the accepted path, in depth order (every leaf
  of ``x`` indexed ``[B, W, ...]``); a chain's block as it is."""
  if x is None or path_BK1 is None:
    return x
  return jax.tree.map(lambda a: jnp.take_along_axis(
      a, path_BK1.reshape(path_BK1.shape + (1,) * (a.ndim - 2)), axis=1), x)


def _emit(state: DecodeState, tokens_BT: jax.Array, num_emitted_B: jax.Array,
          live_B: jax.Array, dcfg: DecodeConfig, logprobs):
  """Writes each live row's verified tokens and their ``logprobs`` (the
  pair ``_token_logprobs`` returns) at its own offset, cut after an EOS and
  after a stop sequence and at the budget: ``(state, n, hit_eos,
  hit_stop)``, the state's tokens and log-probs written, with ``n[b]`` the
  tokens row b emitted. The buffer always has
  room: a live row has a free slot and ``_draft`` cut its drafts to the
  slots left."""
  B, T = tokens_BT.shape
  S = dcfg.capacity
  idx_T = jnp.arange(T)[None, :]
  eos_BT = _is_eos(tokens_BT, dcfg) & (idx_T < num_emitted_B[:, None])
  stop_BT = (_stop_ends(state, tokens_BT, dcfg) if dcfg.stop_sequences
             else jnp.zeros_like(eos_BT)) & (idx_T < num_emitted_B[:, None])
  end_BT = eos_BT | stop_BT
  first_end_B = jnp.where(jnp.any(end_BT, axis=1),
                          jnp.argmax(end_BT, axis=1), T)
  n_B = jnp.minimum(num_emitted_B, first_end_B + 1)
  n_B = jnp.where(live_B, jnp.minimum(
      n_B, state.max_new_tokens - state.num_new_tokens), 0)
  slots_BT = jnp.where(idx_T < n_B[:, None], state.num_tokens[:, None] + idx_T,
                       S)
  write = lambda buf, values: set_at_rows(buf, slots_BT, values, mode="drop")
  state = state.replace(tokens=write(state.tokens, tokens_BT),
                        logprobs=write(state.logprobs, logprobs[0]),
                        raw_logprobs=write(state.raw_logprobs, logprobs[1]))
  kept_BT = idx_T < n_B[:, None]
  return (state, n_B, jnp.any(eos_BT & kept_BT, axis=1),
          jnp.any(stop_BT & kept_BT, axis=1))


def _tally(state: DecodeState, cache: KVCache, live_B: jax.Array,
           wide: jax.Array, num_draft_B: jax.Array,
           num_accepted_B: jax.Array, K: int,
           path_BK1: Optional[jax.Array] = None) -> DecodeState:
  """The target cache rolled back to each live row's committed tokens (by
  lengths), and the step's statistics (``path``: a tree step's accepted
  nodes by depth, ``verify_tree``'s)."""
  acc_BK = ((jnp.arange(K)[None, :] < num_accepted_B[:, None])
            & live_B[:, None])
  if path_BK1 is not None:  # drafted nodes on the accepted path
    on_BK1M = (jax.nn.one_hot(path_BK1, state.accepted_nodes.shape[1] + 1,
                              dtype=jnp.int32)
               * (jnp.arange(K + 1)[None, :] <= num_accepted_B[:, None])[
                   ..., None])
    state = state.replace(accepted_nodes=state.accepted_nodes + jnp.where(
        live_B[:, None], jnp.max(on_BK1M, axis=1)[:, 1:], 0))
  return state.replace(
      cache=cache.with_lengths(jnp.where(live_B, state.num_tokens - 1,
                                         state.cache.lengths)),
      num_steps=state.num_steps + 1, num_wide=state.num_wide + wide,
      num_forwards=state.num_forwards + live_B,
      num_drafted=state.num_drafted + jnp.where(live_B, num_draft_B, 0),
      accepted_at=state.accepted_at + acc_BK)


def step(params, state: DecodeState, *,
         target: Target, dcfg: DecodeConfig,
         drafter_params: Any = None) -> DecodeState:
  """Draft -> score (one target forward) -> verify -> emit -> commit ->
  tally, for a chain or (``dcfg.tree_nodes``) a tree.

  Rows already stopped still ride along in the batch (fixed shapes) but their
  tokens, lengths and statistics do not move. The target's new cache
  entries are the accepted path's, written contiguously from the newest
  token's slot (a chain's path is its block's first positions).
  With ``dcfg.pearl``, PEARL's step (``core.pearl.step``).
  """
  if dcfg.pearl:
    from specjax.core import pearl
    return pearl.step(params, state, target=target, dcfg=dcfg,
                      drafter_params=drafter_params)
  live_B = ~state.done
  key, k_draft, k_verify = split(state.key, 3)
  sampler = state.sampler(dcfg, target.config.vocab_size)
  draft = _draft(drafter_params, state, dcfg, sampler, k_draft)
  out, wide = _score(params, state.cache, draft, live_B, target=target,
                     dcfg=dcfg)
  res, path_BK1, logprobs, nonfinite_B = _verify(
      state, draft, out.logits[:, :dcfg.block], live_B, sampler, k_verify,
      dcfg)
  # A row that reached a non-finite position still emits what it accepted
  # before it (``_verify``), then stops, unless an EOS, a stop sequence or
  # its budget ended it first.
  state, n_B, hit_eos_B, hit_stop_B = _emit(
      state, res.tokens, res.num_emitted, live_B, dcfg, logprobs)
  nonfinite_B &= (n_B == res.num_emitted) & ~hit_eos_B & ~hit_stop_B
  ctx = Context(tokens=state.tokens, num_tokens=state.num_tokens + n_B)
  drafter_state = draft.drafter_state
  if draft.riders is not None:
    drafter_state = dcfg.drafter.ridden(
        drafter_params, drafter_state, ctx,
        jnp.argmax(out.logits[:, dcfg.block:], axis=-1).astype(jnp.int32))
  if dcfg.k:  # the drafter sees a tree's path as a chain
    drafter_state = dcfg.drafter.commit(drafter_params, drafter_state, ctx,
                                        _on_path(_features(out), path_BK1))
  state = state.replace(num_tokens=ctx.num_tokens,
                        drafter_state=drafter_state, key=key)
  cache = out.cache if out.new_kv is None else state.cache.write(
      _on_path(out.new_kv, path_BK1), state.cache.new_slots(dcfg.k + 1))
  state = _tally(state, cache, live_B, wide, draft.num_drafted,
                 res.num_accepted, dcfg.k, path_BK1)
  return _laid_out(_update_stops(state, hit_eos_B, dcfg, nonfinite_B,
                                 hit_stop_B=hit_stop_B), target, dcfg)


def generate(params, prompt_BT: jax.Array,
             prompt_lengths_B: jax.Array, key: jax.Array,
             max_new_tokens: jax.Array | int, *, target: Target,
             dcfg: DecodeConfig, drafter_params: Any = None,
             min_new_tokens: jax.Array | int = 0,
             sampling: Optional[RowSampling] = None) -> DecodeState:
  """Prefill then ``step`` until every row has stopped, in one while_loop
  (the arguments are ``prefill``'s)."""
  state = prefill(params, prompt_BT, prompt_lengths_B, key, max_new_tokens,
                  target=target, dcfg=dcfg, drafter_params=drafter_params,
                  min_new_tokens=min_new_tokens, sampling=sampling)
  return jax.lax.while_loop(
      lambda s: jnp.any(~s.done),
      lambda s: step(params, s, target=target, dcfg=dcfg,
                     drafter_params=drafter_params),
      state)


_STATIC = ("target", "dcfg")
prefill_jit = jax.jit(prefill, static_argnames=_STATIC)
step_jit = jax.jit(step, static_argnames=_STATIC, donate_argnames=("state",))
generate_jit = jax.jit(generate, static_argnames=_STATIC)


def stream(params, prompt_BT, prompt_lengths_B, key,
           max_new_tokens, *, target: Target, dcfg: DecodeConfig,
           drafter_params: Any = None,
           min_new_tokens: jax.Array | int = 0,
           sampling: Optional[RowSampling] = None) -> Iterator[DecodeState]:
  """Yields the state after the prefill and after every step (same jitted step).

  For notebooks and streaming UIs: each yielded state's ``tokens`` hold
  everything so far. The state is donated to the next step, so read what you
  need from a yielded state before advancing the iterator.
  """
  state = prefill_jit(params, prompt_BT, prompt_lengths_B, key, max_new_tokens,
                      target=target, dcfg=dcfg, drafter_params=drafter_params,
                      min_new_tokens=min_new_tokens, sampling=sampling)
  yield state
  while not bool(jnp.all(state.done)):
    state = step_jit(params, state, target=target, dcfg=dcfg,
                     drafter_params=drafter_params)
    yield state
