"""LM head + soft cross-entropy in one custom-VJP op (the training hot spot).

At Vd = 16k the head's LM head is ~2/3 of a TTT step's FLOPs. Plain autodiff
keeps the ``[M, Vd]`` logits for the backward pass and XLA CPU then spends
most of the time transposing them; here the forward pass already forms
``dL/dlogits = w · (softmax(logits) − p)`` (valid because each target row p
sums to 1) and the two products that need it, so the backward pass is a
scale. The accuracy test ``logit[target argmax] >= max logit`` replaces an
argmax over Vd (slow on XLA CPU). What it saves: docs/DESIGN.md, "The LM
head and soft CE in one op".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def fused_soft_ce(h_MD, w_DV, target_p_MV, target_arg_M, weight_M):
  """``(Σ_m weight·CE(p_m, softmax(h_m W)), Σ_m weight·hit_m)``.

  Gradients flow to ``h`` and ``W`` only (targets and weights are data).
  """
  return _forward(h_MD, w_DV, target_p_MV, target_arg_M, weight_M)[0]


def _forward(h_MD, w_DV, target_p_MV, target_arg_M, weight_M):
  logits = jnp.einsum("md,dv->mv", h_MD, w_DV,
                      preferred_element_type=jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  ce_M = logz - jnp.sum(target_p_MV * logits, axis=-1)  # Σp = 1
  w = weight_M.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, target_arg_M[:, None], axis=-1)[:, 0]
  hit_M = picked >= jnp.max(logits, axis=-1)
  dlogits = w[:, None] * (jnp.exp(logits - logz[:, None]) - target_p_MV)
  dh = jnp.einsum("mv,dv->md", dlogits, w_DV.astype(jnp.float32))
  dw = jnp.einsum("md,mv->dv", h_MD.astype(jnp.float32), dlogits)
  out = (jnp.sum(w * ce_M), jnp.sum(w * hit_M))
  return out, (dh.astype(h_MD.dtype), dw.astype(w_DV.dtype), target_p_MV,
               target_arg_M, weight_M)


def _bwd(res, g):
  dh, dw, p, arg, weight = res
  g_loss = g[0]
  return (g_loss * dh, g_loss * dw, jnp.zeros_like(p),
          None if arg is None else jnp.zeros(arg.shape, jax.dtypes.float0),
          jnp.zeros_like(weight))


fused_soft_ce.defvjp(_forward, _bwd)
