"""Medusa heads (Flax): one residual block per depth on the target's last
hidden state, all read out by one LM head over the draft vocabulary.

At position t the target's final-normed hidden state ``h_t`` (tap L after a
frozen copy of the target's final norm, as the EAGLE-1 head reads it) gives
``out_k = h_t + SiLU(W_k h_t + b_k)`` for depths k = 0..K-1, and
``lm_head(out_k)`` scores token t + 2 + k (the target's own LM head scores
t + 1). ``W_k`` starts at zero, so every depth starts as the target's LM head
restricted to Vd. One shared LM head rather than Medusa-1's one per depth:
on a CPU the LM head is the draft's whole cost (a D x Vd read per call), and
one call scores all depths as K rows of the same weight read. The heads read
nothing but ``h_t``, so a whole tree of their top-k is known after one call
(``drafters.medusa``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.heads.base import Dense, HeadConfig, Norm, dense


class MedusaHead(nn.Module):
  """The EAGLE heads' interface where it applies: ``features`` (taps ->
  normed hidden), ``outputs`` (hidden -> one output per depth, ``[..., K,
  D]``), ``normed`` and ``logits`` (the LM head's input and output)."""
  cfg: HeadConfig

  def setup(self):
    c = self.cfg
    self.feature_norm = Norm(c.norm_eps)
    self.blocks = [Dense(c.target_dim, use_bias=True, name=f"block_{k}",
                         kernel_init=nn.initializers.zeros)
                   for k in range(c.medusa_heads)]
    self.lm_head = dense(c.draft_vocab, "lm_head")

  def __call__(self, taps_BTF, tok_BT=None, embed_VD=None, positions_BT=None):
    """Logits ``[B, T, K, Vd]`` (the signature of the EAGLE heads' init)."""
    del tok_BT, embed_VD, positions_BT
    return self.logits(self.outputs(self.features(taps_BTF)))

  def features(self, taps_BTD):
    return self.feature_norm(taps_BTD)

  def outputs(self, h_XD):
    return jnp.stack([h_XD + jax.nn.silu(b(h_XD)) for b in self.blocks],
                     axis=-2)

  def normed(self, out_XD):
    return out_XD

  def logits(self, out_XD):
    return self.lm_head(out_XD).astype(jnp.float32)
