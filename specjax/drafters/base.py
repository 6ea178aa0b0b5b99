"""What every drafter returns."""

from __future__ import annotations

from typing import Any, Optional

import jax
from flax import struct


@struct.dataclass
class Proposal:
  """Drafts for one step.

  Attributes:
    tokens: ``int32[B, K]`` drafted tokens (entries past ``num_draft`` unused).
    probs: ``f32[B, K, V]`` the warped distributions they were sampled from,
      or None for a deterministic drafter (one-hot).
    num_draft: ``int32[B]`` drafts per row, in ``[0, K]``.
    state: the drafter's state after proposing.
  """
  tokens: jax.Array
  probs: Optional[jax.Array]
  num_draft: jax.Array
  state: Any = None


class Stateless:
  """Protocol methods for drafters that keep no state between steps (table
  lookups): nothing to set up after the prefill, nothing to roll back."""

  def init(self, params, prompt_BT, prompt_lengths_B, capacity,
           features=None):
    del params, prompt_BT, prompt_lengths_B, capacity, features
    return None

  def commit(self, params, state, tokens_BS, num_tokens_B, features=None):
    del params, tokens_BS, num_tokens_B, features
    return state
