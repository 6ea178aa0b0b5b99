"""The EAGLE-3 draft head (Flax): fused target features -> one decoder layer.

Follows the released reference code where it differs from the paper
(../shared/research/eagle3.md §1): the attention input is the 2D-wide
``concat(in_norm(embed(token)), hidden_norm(h))`` (no second FC), the residual
is the un-normalized ``h``, logits are ``lm_head(norm(out))`` over the draft
vocabulary Vd, and the token embedding is the target's, passed in frozen (it
is an argument, never a parameter, so it is neither trained nor saved).

``h`` is ``fc(concat(taps))`` -- the target's residual stream at the inputs of
layers ``HeadConfig.taps`` -- on a row's first step, and the head's own
previous output afterwards (the recurrent feature). The module exposes the
layer in pieces (``features``, ``project``, ``finish``, ``logits``) so the
attention between ``project`` and ``finish`` is the caller's: drafting runs
the target's own (``layers.attention`` over a one-layer ``KVCache``, RoPE from
``layers.rope``), training the TTT block form of the same rule
(``specjax.training.ttt.attend_blocks``, tested equal to it).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.heads.base import HeadConfig, dense
from specjax.models.layers import (apply_rope, attention, causal_mask,
                                   query_mask, rope, rope_inv_freq)


class Eagle3Head(nn.Module):
  """One EAGLE-3 decoder layer over (token, feature) pairs. See module doc."""
  cfg: HeadConfig

  def setup(self):
    c = self.cfg
    norm = lambda name: nn.RMSNorm(epsilon=c.norm_eps, name=name)
    self.fc = dense(c.target_dim, "fc")
    self.in_norm, self.hidden_norm = norm("in_norm"), norm("hidden_norm")
    _layer(self)
    self.norm = norm("norm")
    self.lm_head = dense(c.draft_vocab, "lm_head")

  def __call__(self, taps_BTF, tok_BT, embed_VD, positions_BT):
    """Init helper and a plain causal single step (tests, shape checks)."""
    h = self.features(taps_BTF)
    q, k, v, resid = self.project(tok_BT, h, embed_VD, positions_BT)
    B, T = tok_BT.shape
    mask = query_mask(jnp.zeros((B,), jnp.int32), causal_mask(B, T), T,
                      self.cfg.num_heads // self.cfg.num_kv_heads)
    attn = attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3),
                     mask)
    return self.logits(self.finish(resid, attn))

  def features(self, taps_BTF):
    """``fc``: concatenated target taps ``[B, T, len(taps) * D]`` -> ``[B, T, D]``."""
    return self.fc(taps_BTF)

  def project(self, tok_BT, h_BTD, embed_VD, positions_BT):
    """RoPE'd q ``[B,T,N,H]``, k and v ``[B,T,G,H]`` from (token, feature),
    and the residual stream the layer adds to (here the feature itself)."""
    e_BTD = self.in_norm(jnp.take(embed_VD, tok_BT, axis=0).astype(h_BTD.dtype))
    z_BT2D = jnp.concatenate([e_BTD, self.hidden_norm(h_BTD)], axis=-1)
    return (*_qkv(self, z_BT2D, positions_BT), h_BTD)

  def finish(self, resid_BTD, attn_BTNH):
    """Attention output (``[B, T, N, H]`` or ``[B, T, N * H]``) onto the
    residual, then the SwiGLU MLP."""
    return _finish(self, resid_BTD, attn_BTNH)

  def logits(self, out_BTD):
    """``f32[B, T, Vd]`` over the draft vocabulary."""
    return self.lm_head(self.normed(out_BTD)).astype(jnp.float32)

  def normed(self, out_BTD):
    """The LM head's input (training fuses the head with its loss)."""
    return self.norm(out_BTD)


class Eagle1Head(nn.Module):
  """EAGLE-1 (the baseline EAGLE-3 improves on), same interface: the feature
  is the target's last hidden state after its final norm (``feature_norm``,
  a copy of that norm), ``fc(concat(embed(token), feature))`` with a bias
  feeds one decoder layer without an input norm, and the output is the
  predicted next feature, read out by a copy of the target's LM head over the
  full vocabulary. ``feature_norm`` and ``lm_head`` stay frozen in training
  (``FROZEN``); the loss adds feature regression to the soft CE."""
  cfg: HeadConfig

  def setup(self):
    c = self.cfg
    self.feature_norm = nn.RMSNorm(epsilon=c.norm_eps, name="feature_norm")
    self.fc = dense(c.target_dim, "fc", use_bias=True)
    _layer(self)
    self.lm_head = dense(c.draft_vocab, "lm_head")

  __call__ = Eagle3Head.__call__

  def features(self, taps_BTD):
    return self.feature_norm(taps_BTD)

  def project(self, tok_BT, h_BTD, embed_VD, positions_BT):
    e_BTD = jnp.take(embed_VD, tok_BT, axis=0).astype(h_BTD.dtype)
    z_BTD = self.fc(jnp.concatenate([e_BTD, h_BTD], axis=-1))
    return (*_qkv(self, z_BTD, positions_BT), z_BTD)

  def finish(self, resid_BTD, attn_BTNH):
    return _finish(self, resid_BTD, attn_BTNH)

  def logits(self, out_BTD):
    return self.lm_head(out_BTD).astype(jnp.float32)

  def normed(self, out_BTD):
    return out_BTD


def _layer(m):
  """The decoder layer's attention and SwiGLU weights (both variants)."""
  c = m.cfg
  D, N, G, H = c.target_dim, c.num_heads, c.num_kv_heads, c.head_dim
  m.wq, m.wk, m.wv = (dense(N * H, "wq"), dense(G * H, "wk"),
                      dense(G * H, "wv"))
  m.wo = dense(D, "wo")
  m.mlp_norm = nn.RMSNorm(epsilon=c.norm_eps, name="mlp_norm")
  m.w_gate, m.w_up = dense(c.ffn_dim, "w_gate"), dense(c.ffn_dim, "w_up")
  m.w_down = dense(D, "w_down")


def _qkv(m, z_BTX, positions_BT):
  c = m.cfg
  B, T = z_BTX.shape[:2]
  q = m.wq(z_BTX).reshape(B, T, c.num_heads, c.head_dim)
  k = m.wk(z_BTX).reshape(B, T, c.num_kv_heads, c.head_dim)
  v = m.wv(z_BTX).reshape(B, T, c.num_kv_heads, c.head_dim)
  cos, sin = rope(positions_BT, rope_inv_freq(c.head_dim, c.rope_theta))
  return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _finish(m, resid_BTD, attn_BTNH):
  B, T = attn_BTNH.shape[:2]
  r = resid_BTD + m.wo(attn_BTNH.reshape(B, T, -1))
  x = m.mlp_norm(r)
  return r + m.w_down(jax.nn.silu(m.w_gate(x)) * m.w_up(x))
