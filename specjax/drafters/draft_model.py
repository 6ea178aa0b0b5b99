"""A separate (smaller) model, any ``Target``, that shares the target's tokenizer.

The drafter keeps its own KV cache with the target's invariant: it holds
``num_tokens - 2`` or more committed entries. Each ``propose`` first re-feeds
the row's last two committed tokens at their positions (after verification the
drafter may lag by up to two tokens: the last accepted draft it never fed and
the correction/bonus token), which yields the first draft distribution; up to
K - 1 single-token forwards follow, each sampling from the *warped* draft
distribution (the same ``sampling.warp`` the target uses). ``commit`` rolls
the cache back to the committed prefix by lengths.

Dynamic K (``min_confidence > 0``, the rule in ``chain``): the verify
forward keeps its fixed ``[B, K + 1]`` shape; the saving is in draft forwards
and in drafts that would most likely be rejected.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax.numpy as jnp

from specjax.core.rows import at_rows
from specjax.drafters.base import Context, Proposal
from specjax.drafters.chain import draft_chain
from specjax.models.target import Target


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
  """Drafts with ``target``'s model (a ``models.target.Target``, e.g. a
  loaded model's ``Model.target``); its params are the drafter params.

  Attributes:
    target: the draft model (its vocabulary must be the target's).
    min_confidence: dynamic K threshold on the draft model's top probability
      (0 = always draft K).
    layers: run only these of the draft model's layers (layer-skip; None:
      all of them).
  """
  target: Target
  min_confidence: float = 0.0
  layers: Optional[tuple[int, ...]] = None
  feature_taps: ClassVar[tuple[int, ...]] = ()
  needs_params: ClassVar[bool] = True  # the draft model's weights

  def __post_init__(self):
    if not 0.0 <= self.min_confidence < 1.0:
      raise ValueError(f"min_confidence must be in [0, 1), got "
                       f"{self.min_confidence}")

  def _forward(self, params, tokens_BT, cache, **kw):
    return self.target.forward(params, tokens_BT, cache, layers=self.layers,
                               **kw)

  def init(self, params, prompt: Context, capacity, num_draft,
           features=None):
    del num_draft, features
    prompt_BT = prompt.tokens
    cache = self.target.init_cache(params, prompt_BT.shape[0], capacity,
                                   layers=self.layers)
    return self._forward(params, prompt_BT, cache,
                         logit_positions_BP=jnp.zeros_like(prompt_BT[:, :1])
                         ).cache.with_lengths(prompt.num_tokens - 1)

  def commit(self, params, cache, ctx: Context, features=None):
    del params, features
    # Roll back to entries that certainly match committed tokens: everything
    # before the newest two (the accepted drafts it fed are among them).
    return cache.with_lengths(ctx.num_tokens - 2)

  def propose(self, params, cache, ctx: Context, key, num_draft,
              sampling) -> Proposal:
    start_B = jnp.maximum(ctx.num_tokens - 2, 0)
    pair_B2 = at_rows(ctx.tokens, jnp.stack([start_B, ctx.num_tokens - 1], 1))
    out = self._forward(params, pair_B2, cache.with_lengths(start_B))

    def step(tok_B, cache):
      o = self._forward(params, tok_B[:, None], cache)
      return o.logits[:, 0], o.cache

    drafts_BK, probs_BKV, num_B, cache = draft_chain(
        out.logits[:, 1], step, out.cache, key, num_draft, sampling,
        self.min_confidence)
    return Proposal(tokens=drafts_BK, probs=probs_BKV, num_drafted=num_B,
                    state=cache)


class LayerSkipDrafter(DraftModelDrafter):
  """Self-drafting: the target's first layers, then its final norm and LM
  head (``Target.forward(layers=...)``). The drafter params are the
  target's own params (nothing is copied). Build it with
  ``LayerSkipDrafter.from_target``."""

  @classmethod
  def from_target(cls, target: Target, num_layers: int,
                  min_confidence: float = 0.0) -> "LayerSkipDrafter":
    depth = target.config.num_layers
    if not 1 <= num_layers < depth:
      raise ValueError(f"layer-skip needs 1 <= layers < {depth} "
                       f"(the target's depth), got {num_layers}")
    return cls(target, min_confidence, tuple(range(num_layers)))
