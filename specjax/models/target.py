"""The ``Target`` protocol: what every part of specjax asks of a target model.

A target is a frozen, hashable object (a jit static argument, like a
``Drafter``) whose weights travel separately as a pytree ``params``. The
engine, the drafters, EAGLE/Medusa features, training, sharding and the
measuring tools call only what is declared here; ``decoder.Decoder`` is
specjax's own implementation (every architecture ``load_model`` reads), and
a model from another library becomes a target by implementing these methods
over its own parameters (``specjax.models.gemma_lib`` maps google-deepmind's
gemma library onto the decoder instead; ``examples/plain_jax_target.py`` is
a plain-JAX model implementing them).

The cache is a ``specjax.core.cache.KVCache`` (per-layer keys/values, per-row
lengths): the engine rolls speculation back by its lengths and writes the
entries it keeps with ``KVCache.write``; slot s holds position s.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import jax
from flax import struct

from specjax.core.cache import KVCache


@struct.dataclass
class ForwardOutput:
  """Result of ``Target.forward``.

  Attributes:
    logits: ``f32[B, T, V]`` (or ``[B, P, V]`` when ``logit_positions`` given).
    cache: the cache with the T new entries appended (lengths += T), or
      the input cache untouched (``write_cache=False``).
    taps: ``[len(taps), B, T, D]`` hidden states at the inputs of the requested
      layers (index L means the last layer's output, before the final norm),
      or None when no taps were requested.
    new_kv: with ``write_cache=False``, each layer's new ``(k, v)``,
      ``[B, T, G, H]`` each (keys RoPE'd), for ``KVCache.write``; else None.
  """
  logits: jax.Array
  cache: KVCache
  taps: Optional[jax.Array]
  new_kv: Optional[tuple] = None


@runtime_checkable
class Target(Protocol):
  """A target model, as specjax uses it.

  Attributes:
    config: static facts: ``vocab_size``, ``dim`` (the residual width D),
      ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
      ``ffn_dim``, ``rope_theta``, ``norm_eps``, ``max_position``,
      ``bos_id``, ``eos_ids``, ``name`` (a ``ModelConfig`` has them all),
      and optionally ``final_logit_cap`` (the logits' soft-cap; feature
      caches apply it to the logits they rebuild).
    axis_sizes: sizes of the logical axes ``param_axes`` names
      (``kv_heads``, ``ffn``, ``vocab``), for ``specjax.core.sharding``.
  """
  config: Any

  @property
  def axis_sizes(self) -> dict[str, int]: ...

  def init_cache(self, params, batch: int, capacity: int, dtype=None,
                 layers: Optional[Sequence[int]] = None) -> KVCache:
    """An empty cache of ``capacity`` slots per row (dtype None: the
    weights'), with one entry per layer of ``layers`` when given."""

  def forward(self, params, tokens_BT, cache: KVCache, *,
              positions_BT=None, mask_BTT=None, taps: Sequence[int] = (),
              logit_positions_BP=None, write_cache: bool = True,
              layers: Optional[Sequence[int]] = None) -> ForwardOutput:
    """T new tokens per row on top of each row's cached prefix, at
    ``positions`` (default ``lengths + arange(T)``) under ``mask_BTT``
    (which new tokens each sees; default causal). ``taps``: layer indices
    whose inputs to return (L: the last layer's output). ``layers``: run
    only these (layer-skip), then the final norm and LM head.

    Optional (CLaSp's dynamic layer skipping needs it, and ``run_layer``;
    a target without them is refused for that method alone): ``skip``, a
    traced ``bool[L]`` of layers passed over as the identity and not
    computed, with ``write_cache=False``."""

  def embedding(self, params) -> jax.Array:
    """The token embedding ``[V, D]`` (EAGLE heads read it, frozen)."""

  def lm_head(self, params) -> jax.Array:
    """The output projection ``[V, D]`` (draft vocabularies, warm starts)."""

  def output_norm(self, params) -> tuple[jax.Array, float]:
    """The final norm as an RMSNorm ``(effective scale [D], eps)``: logits
    are ``lm_head @ rms_norm(h) * scale`` of the last layer's output h,
    before any soft-capping (``config.final_logit_cap`` when it has one).
    A target whose final norm is something else raises
    NotImplementedError: EAGLE-1 and Medusa heads, and feature caches,
    which read that norm, are then refused; EAGLE-3 heads need it not."""

  def param_axes(self, params) -> Any:
    """A tree like ``params`` of logical axes per array (``None`` or a
    tuple naming ``kv_heads``, ``ffn``, ``vocab`` per dimension)."""


# Optional, for CLaSp (``drafters.clasp``): ``run_layer(params, layer,
# x_BTD, cache, *, positions_BT, mask_BTT) -> x_BTD``, one layer on hidden
# states over the cached prefix (read only), and ``forward(..., skip=)``.
MEMBERS = ("config", "axis_sizes", "init_cache", "forward", "embedding",
           "lm_head", "output_norm", "param_axes")


def missing_members(obj) -> list[str]:
  """The ``Target`` members ``obj`` lacks (none: it is a target)."""
  return [m for m in MEMBERS if not hasattr(obj, m)]
