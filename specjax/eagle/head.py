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
layer in pieces (``features``, ``project``, ``finish``, ``logits``) because
training (TTT, ``specjax.eagle.ttt``) and drafting attend differently but
share everything else.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.llama import apply_rope


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """Static shape of a head (hashable).

  Attributes:
    target_dim: D of the target (the head's width too: it adds to the target's
      embedding and its features).
    target_vocab: V.
    target_layers: L of the target (to check a loaded head fits).
    taps: target layer indices whose *inputs* are fused (low, mid, high).
    num_heads, num_kv_heads, head_dim: N, G, H of the head's attention.
    ffn_dim: SwiGLU width.
    draft_vocab: Vd.
    rope_theta: the head's own RoPE base.
    norm_eps: RMSNorm epsilon.
  """
  target_dim: int
  target_vocab: int
  target_layers: int
  taps: tuple[int, ...]
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  draft_vocab: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5

  @classmethod
  def for_target(cls, target: ModelConfig, draft_vocab: int,
                 **overrides) -> "HeadConfig":
    """EAGLE-3 defaults for a target: taps {2, L//2, L-3}, the target's
    attention shape and MLP width."""
    L = target.num_layers
    kw = dict(target_dim=target.dim, target_vocab=target.vocab_size,
              target_layers=L, taps=(2, L // 2, L - 3),
              num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
              head_dim=target.head_dim, ffn_dim=target.ffn_dim,
              draft_vocab=draft_vocab, rope_theta=target.rope_theta,
              norm_eps=target.norm_eps)
    kw.update(overrides)
    return cls(**kw)

  def check_fits(self, target: ModelConfig) -> None:
    """Raises ValueError naming the first mismatch with ``target``."""
    for name, mine, theirs in (("hidden size", self.target_dim, target.dim),
                               ("vocab", self.target_vocab, target.vocab_size),
                               ("layer count", self.target_layers,
                                target.num_layers)):
      if mine != theirs:
        raise ValueError(f"EAGLE head was trained for a target with {name} "
                         f"{mine}, this target has {theirs}")
    if max(self.taps) >= target.num_layers:
      raise ValueError(f"EAGLE head taps layer {max(self.taps)}, the target "
                       f"has {target.num_layers} layers")


def _dense(features: int, name: str) -> nn.Dense:
  return nn.Dense(features, use_bias=False, name=name,
                  kernel_init=nn.initializers.normal(0.02))


class Eagle3Head(nn.Module):
  """One EAGLE-3 decoder layer over (token, feature) pairs. See module doc."""
  cfg: HeadConfig

  def setup(self):
    c = self.cfg
    D, N, G, H = c.target_dim, c.num_heads, c.num_kv_heads, c.head_dim
    norm = lambda name: nn.RMSNorm(epsilon=c.norm_eps, name=name)
    self.fc = _dense(D, "fc")
    self.in_norm, self.hidden_norm = norm("in_norm"), norm("hidden_norm")
    self.wq, self.wk, self.wv = (_dense(N * H, "wq"), _dense(G * H, "wk"),
                                 _dense(G * H, "wv"))
    self.wo = _dense(D, "wo")
    self.mlp_norm = norm("mlp_norm")
    self.w_gate, self.w_up = _dense(c.ffn_dim, "w_gate"), _dense(c.ffn_dim,
                                                                 "w_up")
    self.w_down = _dense(D, "w_down")
    self.norm = norm("norm")
    self.lm_head = _dense(c.draft_vocab, "lm_head")

  def __call__(self, taps_BTF, tok_BT, embed_VD, positions_BT):
    """Init helper and a plain causal single step (tests, shape checks)."""
    h = self.features(taps_BTF)
    q, k, v = self.project(tok_BT, h, embed_VD, positions_BT)
    T = tok_BT.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    attn = attend(q, [(k, v, causal[None])])
    return self.logits(self.finish(h, attn))

  def features(self, taps_BTF):
    """``fc``: concatenated target taps ``[B, T, len(taps) * D]`` -> ``[B, T, D]``."""
    return self.fc(taps_BTF)

  def project(self, tok_BT, h_BTD, embed_VD, positions_BT):
    """RoPE'd q ``[B,T,N,H]``, k and v ``[B,T,G,H]`` from (token, feature)."""
    c = self.cfg
    B, T = tok_BT.shape
    e_BTD = self.in_norm(jnp.take(embed_VD, tok_BT, axis=0).astype(h_BTD.dtype))
    z_BT2D = jnp.concatenate([e_BTD, self.hidden_norm(h_BTD)], axis=-1)
    q = self.wq(z_BT2D).reshape(B, T, c.num_heads, c.head_dim)
    k = self.wk(z_BT2D).reshape(B, T, c.num_kv_heads, c.head_dim)
    v = self.wv(z_BT2D).reshape(B, T, c.num_kv_heads, c.head_dim)
    cos, sin = rope_tables(positions_BT, c.head_dim, c.rope_theta)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def finish(self, h_BTD, attn_BTNH):
    """Residual on the un-normalized feature, then the SwiGLU MLP."""
    B, T = attn_BTNH.shape[:2]
    r = h_BTD + self.wo(attn_BTNH.reshape(B, T, -1))
    m = self.mlp_norm(r)
    return r + self.w_down(jax.nn.silu(self.w_gate(m)) * self.w_up(m))

  def logits(self, out_BTD):
    """``f32[B, T, Vd]`` over the draft vocabulary."""
    return self.lm_head(self.normed(out_BTD)).astype(jnp.float32)

  def normed(self, out_BTD):
    """The LM head's input (training fuses the head with its loss)."""
    return self.norm(out_BTD)


def rope_tables(positions_BT, head_dim: int, theta: float):
  """cos/sin ``[B, T, H]`` (halves repeated) for ``llama.apply_rope``."""
  inv = 1.0 / (theta ** (np.arange(head_dim // 2, dtype=np.float64) * 2
                         / head_dim))
  ang = (positions_BT[..., None].astype(jnp.float32)
         * inv.astype(np.float32)[None, None, :])
  ang = jnp.concatenate([ang, ang], axis=-1)
  return jnp.cos(ang), jnp.sin(ang)


def attend(q_BTNH, blocks) -> jax.Array:
  """Attention of queries over several key blocks with one joint softmax.

  ``blocks``: ``(k, v, mask)`` triples; ``k``/``v`` are ``[B, S, G, H]`` with
  a ``bool`` mask broadcastable to ``[B, T, S]`` (query t may see key s), or
  ``[B, T, G, H]`` with mask ``None`` marking a *diagonal* block: query t sees
  only key t of it (the TTT rule for the head's own earlier steps); a
  diagonal block may also come with a ``bool[B, T]`` validity instead.
  Scores and softmax are f32.
  """
  B, T, N, H = q_BTNH.shape
  G = blocks[0][0].shape[2]
  q = (q_BTNH.reshape(B, T, G, N // G, H) * H ** -0.5).astype(jnp.float32)
  scores, values = [], []
  for k, v, mask in blocks:
    if mask is None or mask.ndim == 2:  # diagonal block
      s = jnp.einsum("btgrh,btgh->bgrt", q, k.astype(jnp.float32))[..., None]
      if mask is not None:
        s = jnp.where(mask[:, None, None, :, None], s, -1e30)
      scores.append(s)
      values.append((v, None))
    else:
      s = jnp.einsum("btgrh,bsgh->bgrts", q, k.astype(jnp.float32))
      s = jnp.where(jnp.broadcast_to(mask, (B, T, k.shape[1]))[:, None, None],
                    s, -1e30)
      scores.append(s)
      values.append((v, k.shape[1]))
  p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
  out, col = 0.0, 0
  for v, width in values:
    if width is None:
      out = out + jnp.einsum("bgrt,btgh->btgrh", p[..., col],
                             v.astype(jnp.float32))
      col += 1
    else:
      out = out + jnp.einsum("bgrts,bsgh->btgrh", p[..., col:col + width],
                             v.astype(jnp.float32))
      col += width
  return out.reshape(B, T, N, H).astype(q_BTNH.dtype)
