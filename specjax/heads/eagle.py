"""The EAGLE-3 draft head (Flax): fused target features -> one decoder layer;
EAGLE-1, native multi-token-prediction (MTP) and P-EAGLE modules, the same
interface.

Follows the released reference code (SafeAILab/EAGLE) where it differs from
the paper: the attention input is the 2D-wide
``concat(in_norm(embed(token)), hidden_norm(h))`` (no second FC), the residual
is the un-normalized ``h``, logits are ``lm_head(norm(out))`` over the draft
vocabulary Vd, and the token embedding is the target's, passed in frozen (it
is an argument, never a parameter, so it is neither trained nor saved).

``h`` is ``fc(concat(taps))`` -- the target's residual stream at the inputs of
layers ``HeadConfig.taps`` -- on a row's first step, and the head's own
previous output afterwards (the recurrent feature). The layer is the
decoder's own (``heads.base.DecoderLayer`` over ``decoder.layer_qkv`` and
``decoder.layer_out``, the fused layout, q/k/v reading 2D inputs), as
tpu-inference's ``Eagle3LlamaDecoderLayer`` subclasses its Llama layer.
The module exposes the layer in pieces (``features``, ``project``,
``finish``, ``logits``) so the attention between ``project`` and
``finish`` is the caller's: drafting runs
the target's own (``layers.attention`` over a one-layer ``KVCache``, RoPE from
``layers.rope``), training the TTT block form of the same rule
(``specjax.training.ttt.attend_blocks``, tested equal to it).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from specjax.heads.base import DecoderLayer, HeadConfig, Norm, dense
from specjax.models.layers import attention, causal_mask, query_mask


class Eagle3Head(nn.Module):
  """One EAGLE-3 decoder layer over (token, feature) pairs. See module doc."""
  cfg: HeadConfig

  def setup(self):
    c = self.cfg
    self.fc = dense(c.target_dim, "fc")
    self.in_norm, self.hidden_norm = Norm(c.norm_eps), Norm(c.norm_eps)
    self.layer = DecoderLayer(c.layer_config(), 2 * c.target_dim)
    self.norm = Norm(c.norm_eps)
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
    return (*self.layer.qkv(z_BT2D, positions_BT), h_BTD)

  def finish(self, resid_BTD, attn_BTNH):
    """Attention output (``[B, T, N, H]`` or ``[B, T, N * H]``) onto the
    residual, then the SwiGLU MLP."""
    return self.layer.out(resid_BTD, attn_BTNH)

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
    self.feature_norm = Norm(c.norm_eps)
    self.fc = dense(c.target_dim, "fc", use_bias=True)
    self.layer = DecoderLayer(c.layer_config(), c.target_dim)
    self.lm_head = dense(c.draft_vocab, "lm_head")

  __call__ = Eagle3Head.__call__

  def features(self, taps_BTD):
    return self.feature_norm(taps_BTD)

  def project(self, tok_BT, h_BTD, embed_VD, positions_BT):
    e_BTD = jnp.take(embed_VD, tok_BT, axis=0).astype(h_BTD.dtype)
    z_BTD = self.fc(jnp.concatenate([e_BTD, h_BTD], axis=-1))
    return (*self.layer.qkv(z_BTD, positions_BT), z_BTD)

  def finish(self, resid_BTD, attn_BTNH):
    return self.layer.out(resid_BTD, attn_BTNH)

  def logits(self, out_BTD):
    return self.lm_head(out_BTD).astype(jnp.float32)

  def normed(self, out_BTD):
    return out_BTD


class MTPHead(nn.Module):
  """A multi-token-prediction module (DeepSeek-V3's, Qwen3.5's), same
  interface: the feature is the target's last hidden state after its final
  norm (``feature_norm``, frozen), the layer's input is
  ``fc(concat(in_norm(embed(token)), hidden_norm(feature)))`` (DeepSeek's
  ``eh_proj``, ``enorm``, ``hnorm``: embedding first), then one whole
  decoder layer (its own input norm; q/k norms if ``cfg.qk_norm``), the
  final ``norm`` and ``lm_head`` over the full vocabulary (the target's,
  frozen). The next step is fed the layer's output (DeepSeek-V3) or, with
  ``cfg.feed_normed``, its normed output (Qwen3.5, speculators). Trained
  with soft CE only, as DeepSeek trains it."""
  cfg: HeadConfig

  def setup(self):
    c = self.cfg
    self.feature_norm = Norm(c.norm_eps)
    self.in_norm, self.hidden_norm = Norm(c.norm_eps), Norm(c.norm_eps)
    self.fc = dense(c.target_dim, "fc")
    self.layer = DecoderLayer(c.layer_config(), c.target_dim, attn_norm=True)
    self.norm = Norm(c.norm_eps)
    self.lm_head = dense(c.draft_vocab, "lm_head")

  __call__ = Eagle3Head.__call__
  features = Eagle1Head.features

  def project(self, tok_BT, h_BTD, embed_VD, positions_BT):
    e_BTD = self.in_norm(jnp.take(embed_VD, tok_BT, axis=0).astype(h_BTD.dtype))
    z_BTD = self.fc(jnp.concatenate([e_BTD, self.hidden_norm(h_BTD)], -1))
    return (*self.layer.qkv(z_BTD, positions_BT), z_BTD)

  def finish(self, resid_BTD, attn_BTNH):
    out_BTD = self.layer.out(resid_BTD, attn_BTNH)
    return self.norm(out_BTD) if self.cfg.feed_normed else out_BTD

  def logits(self, out_BTD):
    return self.lm_head(self.normed(out_BTD)).astype(jnp.float32)

  def normed(self, out_BTD):
    return out_BTD if self.cfg.feed_normed else self.norm(out_BTD)


class PEagleHead(Eagle3Head):
  """P-EAGLE: an EAGLE-3 head that drafts K tokens in one forward. Slot 0 of
  its block is EAGLE-3's pair (the newest token, the fused taps); slots
  1..K-1 hold the placeholder ``cfg.mask_token`` and a learned
  ``mask_hidden`` in place of the taps (``placeholders``), one position
  each after slot 0, causal. No slot reads another slot's sampled token, so
  the K distributions come out of one pass."""

  def setup(self):
    super().setup()
    width = len(self.cfg.taps) * self.cfg.target_dim
    self.mask_hidden = self.param("mask_hidden", nn.initializers.normal(0.02),
                                  (width,))

  def placeholders(self, tok_BT):
    """The feature of placeholder slots shaped as ``tok`` (``[B, T, D]``):
    ``fc(mask_hidden)``, as the taps go through ``fc``."""
    h_11D = self.fc(self.mask_hidden[None, None])
    return jnp.broadcast_to(h_11D[0, 0], tok_BT.shape + h_11D.shape[-1:])
