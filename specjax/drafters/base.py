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
