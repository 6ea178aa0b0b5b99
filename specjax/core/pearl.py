"""PEARL (Liu et al., 2024): the drafter drafts the next block while the
target verifies the previous one, so neither waits for the other.

Each row carries P pending drafts: drafted in the previous step, not yet
scored by the target. A step, for every row at once:

- the target scores ``[newest token, pending]`` (one forward over the
  block of K tokens, K = ``DecodeConfig.num_draft``);
- the drafter drafts K tokens after the committed tokens *and* the pending
  ones, as if every pending draft were accepted;
- the chain ``pending + [first new draft]`` is verified exactly
  (``verify.verify_chain``) against the target's logits at those
  positions: the block's last scored position, where a plain step would
  sample its bonus token, tests the first new draft instead;
- all accepted: they are emitted and the other K - 1 new drafts become
  pending (PEARL's post-verify mode); a rejection emits the accepted
  prefix and the residual draw and leaves nothing pending (pre-verify: the
  next step's block is the newest token alone, its one scored position
  testing the next first draft).

``DecodeConfig(pearl=True)`` selects these steps: ``engine.generate``,
``engine.stream`` and ``runner.generate_ids`` run them after the prefill
(which leaves nothing pending, ``nothing_pending``); the method grammar's
``pearl=1`` (``draft:k=4:pearl=1``) sets it.

The two halves read nothing of each other's output: on a mesh from
``make_mesh`` (``DecodeConfig.mesh``) they run at once, the drafter on the
devices of role 0 and the target on those of role 1 (``_on_groups``); on
one device, one after the other. Exactness is the chain rule's: every
emitted token passed the accept/reject test against the target's
distribution given the committed prefix before it, with the distribution
it was drawn from; which prefix the drafter assumed does not enter (a
rejection drops the drafts made behind it because they were drafted for a
prefix that did not happen, not for exactness). A step emits the accepted
chain and never a bonus token after an accepted first draft: its position
is the next pending draft's.

Drafters: chain drafters that need nothing of the target's but the
committed tokens (a draft model, layer-skip, n-gram), and a P-EAGLE head,
which reads the target's features but drafts each block slot from a
placeholder: it drafts behind the pending drafts from the committed
tokens' features without reading the pending ones (``propose_behind``:
row b's K drafts from the slots after its P pending ones). A drafter that
reads its own previous draft with its features (EAGLE's chains) or the
target's cache (CLaSp) cannot draft behind tokens the target has not
scored.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, PartitionSpec as P

from specjax.core import engine, sharding
from specjax.core.rows import set_at_rows
from specjax.core.sampling import split
from specjax.drafters.base import RidingDrafter
from specjax.models.target import Target


ROLE = "role"  # the mesh axis between the drafter's devices and the target's


def make_mesh(data: int = 1, devices: Optional[list] = None) -> Mesh:
  """A ``(role=2, data, model=1)`` mesh: role 0's devices draft and role
  1's score, each group's rows split over ``data`` (``2 * data`` devices,
  default all of them)."""
  devices = jax.devices() if devices is None else devices
  if len(devices) != 2 * data:
    raise sharding.MeshError(f"PEARL's mesh (role=2, data={data}) needs "
                             f"{2 * data} devices, there are {len(devices)}")
  return Mesh(np.asarray(devices).reshape(2, data, 1),
              (ROLE, sharding.DATA, sharding.MODEL))


@struct.dataclass
class Pending:
  """PEARL's drafter state: the inner drafter's, and each row's pending
  drafts.

  Attributes:
    inner: the drafter's own state.
    tokens: ``int32[B, K]`` pending drafts first (entries past ``num``
      unused).
    probs: ``f32[B, K, V]`` the distributions they were drawn from.
    num: ``int32[B]`` pending drafts, in ``[0, K - 1]``.
    pre_steps: ``int32[B]`` steps the row took with nothing pending
      (pre-verify).
    post_steps: ``int32[B]`` steps with drafts pending (post-verify).
  """
  inner: Any
  tokens: jax.Array
  probs: jax.Array
  num: jax.Array
  pre_steps: jax.Array
  post_steps: jax.Array


def check_config(dcfg: engine.DecodeConfig) -> None:
  """Refuses what PEARL cannot run, with one line naming it
  (``DecodeConfig`` asks when ``pearl`` is set)."""
  drafter = dcfg.drafter
  if drafter is None:
    raise ValueError("PEARL needs a drafter (a draft model, layer-skip, "
                     "n-gram, a P-EAGLE head)")
  if dcfg.tree_nodes:
    raise ValueError(f"PEARL drafts chains; tree_nodes={dcfg.tree_nodes} "
                     "is not supported")
  if ((_reads_features(drafter)
       and not getattr(drafter, "drafts_behind", False))
      or isinstance(drafter, RidingDrafter)
      or getattr(drafter, "reads_target_cache", False)):
    raise ValueError(f"PEARL drafts behind tokens the target has not "
                     f"scored: {type(drafter).__name__} reads the target's "
                     "features or cache")


def _reads_features(drafter) -> bool:
  """Whether the drafter reads the target's features (a P-EAGLE head,
  drafting behind the pending drafts with ``propose_behind``)."""
  return bool(tuple(drafter.feature_taps))


def check_key(dcfg: engine.DecodeConfig, key: jax.Array) -> None:
  """Refuses one key for the batch where each device group's rows draw
  their drafts apart: rows split over ``data`` at T > 0."""
  mesh = dcfg.mesh
  if (mesh is not None and ROLE in mesh.axis_names
      and mesh.shape[sharding.DATA] > 1 and not dcfg.sampling.greedy
      and jnp.ndim(key) == 0):
    raise ValueError("PEARL on device groups with rows split over data "
                     "draws each row's drafts on its own device: give one "
                     "key per row (key[B]) at T > 0, or the devices' rows "
                     "draw alike")


def nothing_pending(inner: Any, B: int, K: int, V: int) -> Pending:
  """The drafter state after the prefill: the inner drafter's, nothing
  pending, no steps counted."""
  zeros_B = jnp.zeros((B,), jnp.int32)
  return Pending(inner=inner, tokens=jnp.zeros((B, K), jnp.int32),
                 probs=jnp.zeros((B, K, V), jnp.float32), num=zeros_B,
                 pre_steps=zeros_B, post_steps=zeros_B)


def _speculative(state: engine.DecodeState) -> engine.DecodeState:
  """The state with each row's pending drafts appended to its tokens, as
  the drafter drafts behind them."""
  pend = state.drafter_state
  K = pend.tokens.shape[1]
  idx_K = jnp.arange(K)[None, :]
  slots_BK = jnp.where(idx_K < pend.num[:, None],
                       state.num_tokens[:, None] + idx_K,
                       state.tokens.shape[1])
  return state.replace(
      tokens=set_at_rows(state.tokens, slots_BK, pend.tokens, mode="drop"),
      num_tokens=state.num_tokens + pend.num)


def _chain(pend: Pending, drafts_BK, probs_BKV, num_drafted_B):
  """The chain a step verifies, ``(tokens [B, K], probs [B, K, V],
  length [B])``: the pending drafts, then the first new draft if the
  drafter drafted one."""
  K = pend.tokens.shape[1]
  at_B = pend.num
  idx_BK = jnp.broadcast_to(jnp.arange(K)[None, :], drafts_BK.shape)
  first_B = idx_BK == at_B[:, None]
  tokens = jnp.where(first_B, drafts_BK[:, :1], pend.tokens)
  probs = jnp.where(first_B[..., None], probs_BKV[:, :1], pend.probs)
  return tokens, probs, at_B + (num_drafted_B > 0)


def _next_pending(pend: Pending, drafts_BK, probs_BKV, num_drafted_B,
                  all_accepted_B, live_B) -> Pending:
  """What stays pending after the step: the new drafts after the first when
  the whole chain, the first new draft included, was accepted; else
  nothing (they were drafted behind a rejected token)."""
  keep_B = all_accepted_B & (num_drafted_B > 0)
  roll = lambda a: jnp.roll(a, -1, axis=1)
  return pend.replace(
      tokens=roll(drafts_BK), probs=roll(probs_BKV),
      num=jnp.where(keep_B, num_drafted_B - 1, 0),
      pre_steps=pend.pre_steps + (live_B & (pend.num == 0)),
      post_steps=pend.post_steps + (live_B & (pend.num > 0)))


def draft_half(state: engine.DecodeState, key, *,
               dcfg: engine.DecodeConfig, vocab_size: int, drafter_params):
  """The drafter's half: K drafts behind the pending ones, ``(proposal, its
  distributions)`` (one-hot for a deterministic drafter). A drafter that
  reads only tokens drafts after them; one that reads the target's
  features, which the pending drafts do not have yet, drafts behind them
  without reading them (``propose_behind``)."""
  pend, drafter = state.drafter_state, dcfg.drafter
  ahead = _speculative(state)
  sampler = ahead.sampler(dcfg, vocab_size)
  if _reads_features(drafter):
    prop = drafter.propose_behind(drafter_params, pend.inner, state.context,
                                  pend.num, key, dcfg.k, sampler)
  else:
    prop = drafter.propose(drafter_params, pend.inner, ahead.context, key,
                           dcfg.k, sampler)
  probs_BKV = (jax.nn.one_hot(prop.tokens, vocab_size, dtype=jnp.float32)
               if prop.probs is None else prop.probs)
  return prop, probs_BKV


def _score(params, state: engine.DecodeState, *, target: Target, K: int,
           taps: tuple[int, ...]):
  """The target's half: its forward over ``[newest, pending]``, ``(logits
  [B, K, V], new cache entries, the ``taps``' features [B, K, F] or
  None)``."""
  block_BK = jnp.concatenate([state.context.newest()[:, None],
                              state.drafter_state.tokens[:, :K - 1]], axis=1)
  out = engine._verify_forward(params, target, block_BK, state.cache, taps,
                               K)
  return out.logits, out.new_kv, engine._features(out)


def _draft_and_score(params, state: engine.DecodeState, key, *,
                     target: Target, dcfg: engine.DecodeConfig,
                     drafter_params):
  """The step's two halves, neither reading the other's output:
  ``((proposal, distributions), (logits, new cache entries))``. On a mesh
  with a ``role`` axis (``make_mesh``) the drafter runs on role 0's devices
  and the target on role 1's, at once (``_on_groups``)."""
  draft = lambda state, key, dparams: draft_half(
      state, key, dcfg=dcfg, vocab_size=target.config.vocab_size,
      drafter_params=dparams)
  score = lambda params, state: _score(params, state, target=target,
                                       K=dcfg.k,
                                       taps=engine._feature_taps(dcfg))
  mesh = dcfg.mesh
  if mesh is None or ROLE not in mesh.axis_names:
    return draft(state, key, drafter_params), score(params, state)
  return _on_groups(draft, score, params, state, key, drafter_params, mesh)


def _on_groups(draft, score, params, state, key, drafter_params, mesh):
  """``(draft(state, key, drafter_params), score(params, state))``, the
  first on role 0's devices and the second on role 1's (``shard_map``):
  each group's rows split over ``data``, the parameters whole. Both
  results are then summed over ``role``, the other group's being zeros, so
  every device holds both."""
  zeros = lambda shapes: jax.tree.map(
      lambda a: jnp.zeros(a.shape, a.dtype), shapes)

  def both(params, state, key, drafter_params):
    d = lambda: draft(state, key, drafter_params)
    s = lambda: score(params, state)
    halves = jax.lax.cond(jax.lax.axis_index(ROLE) == 0,
                          lambda: (d(), zeros(jax.eval_shape(s))),
                          lambda: (zeros(jax.eval_shape(d)), s()))
    return jax.lax.psum(halves, ROLE)

  B = state.tokens.shape[0]
  rows = lambda tree: sharding.batch_specs(tree, B, mesh)
  whole = lambda tree: jax.tree.map(lambda _: P(), tree)
  shapes = jax.eval_shape(lambda: (draft(state, key, drafter_params),
                                   score(params, state)))
  return jax.shard_map(
      both, mesh=mesh, check_vma=False,
      in_specs=(whole(params), rows(state), rows(key), whole(drafter_params)),
      out_specs=rows(shapes))(params, state, key, drafter_params)


def _tested_at(length_B, first_new_B, K: int) -> jax.Array:
  """``int32[B, K + 1]``: the scored block position whose logits each
  verify position reads. Draft j is tested at position j - 1 and a bonus
  drawn at ``length``: a scored pending token's position, unless the chain
  ends with the first new draft, which takes no bonus (the position, K at
  most, is the next pending draft's). Positions past the last one read
  carry its logits, so they are finite where it is."""
  last_B = jnp.where(first_new_B, length_B - 1, length_B)
  return jnp.minimum(jnp.arange(K + 1)[None, :], last_B[:, None])


def _verify(state: engine.DecodeState, prop, probs_BKV, logits_BKV,
            live_B, key, dcfg: engine.DecodeConfig, vocab_size: int):
  """The chain ``pending + [first new draft]`` verified
  (``engine._verify``): ``(result, log-probs, rows that stop non-finite,
  chain length, whether the chain ends with the first new draft)``."""
  pend = state.drafter_state
  tokens_BK, chain_BKV, length_B = _chain(pend, prop.tokens, probs_BKV,
                                          prop.num_drafted)
  room_B = jnp.maximum(dcfg.capacity - state.num_tokens - 1, 0)
  length_B = jnp.minimum(length_B, room_B)
  first_new_B = (prop.num_drafted > 0) & (length_B == pend.num + 1)
  at_BW = _tested_at(length_B, first_new_B, dcfg.k)
  draft = engine._Draft(
      block=jnp.concatenate([state.context.newest()[:, None], tokens_BK], 1),
      num_drafted=length_B, drafter_state=None, probs=chain_BKV)
  res, _, logprobs, nonfinite_B = engine._verify(
      state, draft, jnp.take_along_axis(logits_BKV, at_BW[..., None], 1),
      live_B, state.sampler(dcfg, vocab_size), key, dcfg)
  return res, logprobs, nonfinite_B, length_B, first_new_B


def _commit(drafter, drafter_params, inner, state: engine.DecodeState,
            features):
  """The drafter's state after the step: a drafter of tokens commits the
  new pending drafts too (it drafts behind them next); one of features
  commits the committed tokens and the block's features (K, padded to
  the K + 1 of an engine step's block), of which it reads those before
  each committed token."""
  if features is None:
    return drafter.commit(drafter_params, inner, _speculative(state).context)
  return drafter.commit(drafter_params, inner, state.context,
                        jnp.pad(features, ((0, 0), (0, 1), (0, 0))))


def step(params, state: engine.DecodeState, *, target: Target,
         dcfg: engine.DecodeConfig,
         drafter_params: Any = None) -> engine.DecodeState:
  """One PEARL step (module doc): draft behind the pending drafts and
  score ``[newest, pending]``, verify the chain, emit, commit, tally."""
  live_B = ~state.done
  key, k_draft, k_verify = split(state.key, 3)
  (prop, probs_BKV), (logits_BKV, new_kv, features) = _draft_and_score(
      params, state, k_draft, target=target, dcfg=dcfg,
      drafter_params=drafter_params)
  res, logprobs, nonfinite_B, length_B, first_new_B = _verify(
      state, prop, probs_BKV, logits_BKV, live_B, k_verify, dcfg,
      target.config.vocab_size)
  # An accepted first new draft takes no bonus token (module doc).
  no_bonus_B = first_new_B & (res.num_accepted == length_B) & ~nonfinite_B
  emitted_B = jnp.where(no_bonus_B, length_B, res.num_emitted)
  state, n_B, hit_eos_B, hit_stop_B = engine._emit(
      state, res.tokens, emitted_B, live_B, dcfg, logprobs)
  nonfinite_B &= (n_B == emitted_B) & ~hit_eos_B & ~hit_stop_B
  pend = _next_pending(state.drafter_state, prop.tokens, probs_BKV,
                       prop.num_drafted, no_bonus_B & (n_B == emitted_B),
                       live_B)
  state = state.replace(num_tokens=state.num_tokens + n_B, key=key,
                        drafter_state=pend)
  inner = _commit(dcfg.drafter, drafter_params, prop.state, state, features)
  state = state.replace(drafter_state=pend.replace(inner=inner))
  cache = state.cache.write(new_kv, state.cache.new_slots(dcfg.k))
  state = engine._tally(state, cache, live_B, jnp.any(live_B), length_B,
                        res.num_accepted, dcfg.k)
  return engine._laid_out(engine._update_stops(
      state, hit_eos_B, dcfg, nonfinite_B, hit_stop_B=hit_stop_B),
      target, dcfg)
