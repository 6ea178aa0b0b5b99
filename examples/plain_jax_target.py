"""A model of your own as a specjax target: a small decoder written in plain
``jax.numpy`` (learned absolute positions, LayerNorm, GELU MLP: nothing from
specjax's layer library), made a ``specjax.Target`` by the six members the
protocol declares. Every method then runs on it: AR, n-gram chains and
tries, EAGLE-3 chains and trees, layer-skip, training an EAGLE-3 head
(notebooks/05_your_own_model.ipynb, tests/test_own_target.py).

What the protocol asks of ``forward`` (``specjax/models/target.py``): T new
tokens per row attend to the row's cached prefix (slots below
``cache.lengths``) and, among themselves, as ``mask_BTT`` says, at
``positions_BT``; with ``write_cache=False`` the cache is left as it is and
the new keys/values come back in ``new_kv`` for the engine to keep what
verification accepted.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from specjax.core.cache import KVCache, write_kv
from specjax.models.config import ModelConfig
from specjax.models.target import ForwardOutput


def init_params(key, cfg: ModelConfig, scale: float = 0.3) -> dict:
  """Random weights: a dict pytree, as a user's own model would have."""
  D, F, NH = cfg.dim, cfg.ffn_dim, cfg.num_heads * cfg.head_dim
  keys = iter(jax.random.split(key, 6 * cfg.num_layers + 3))
  w = lambda *shape: scale * jax.random.normal(next(keys), shape) / shape[0] ** .5
  layer = lambda: dict(ln1=jnp.ones(D), wq=w(D, NH), wk=w(D, NH), wv=w(D, NH),
                       wo=w(NH, D), ln2=jnp.ones(D), w1=w(D, F), w2=w(F, D))
  return dict(embed=w(cfg.vocab_size, D), pos=w(cfg.max_position, D),
              layers=[layer() for _ in range(cfg.num_layers)],
              ln_f=jnp.ones(D), unembed=w(D, cfg.vocab_size) * 10)


def _ln(x, w):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True)
                                  + 1e-5) * w[None, None]


@dataclasses.dataclass(frozen=True)
class PlainTarget:
  """The protocol over ``init_params``' dict (multi-head attention: G = N)."""
  config: ModelConfig

  @property
  def axis_sizes(self) -> dict[str, int]:
    c = self.config
    return dict(kv_heads=c.num_heads, ffn=c.ffn_dim, vocab=c.vocab_size)

  def init_cache(self, params, batch, capacity, dtype=None, layers=None):
    n = self.config.num_layers if layers is None else len(layers)
    return KVCache.init(n, batch, capacity, self.config.num_heads,
                        self.config.head_dim, dtype or params["embed"].dtype)

  def forward(self, params, tokens_BT, cache, *, positions_BT=None,
              mask_BTT=None, taps: Sequence[int] = (),
              logit_positions_BP=None, write_cache: bool = True,
              layers: Optional[Sequence[int]] = None) -> ForwardOutput:
    c, (B, T) = self.config, tokens_BT.shape
    N, H, S = c.num_heads, c.head_dim, cache.capacity
    if positions_BT is None:
      positions_BT = cache.lengths[:, None] + jnp.arange(T)[None]
    if mask_BTT is None:
      mask_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    prefix_BS = jnp.arange(S)[None] < cache.lengths[:, None]
    slots_BT = cache.new_slots(T)
    x = params["embed"][tokens_BT] + params["pos"][positions_BT]
    hidden, ks, vs, new_kv = [], list(cache.k), list(cache.v), []
    run = range(c.num_layers) if layers is None else layers
    for j, i in enumerate(run):
      lp = params["layers"][i]
      hidden.append(x)
      h = _ln(x, lp["ln1"])
      q, k, v = ((h @ lp[n]).reshape(B, T, N, H) for n in ("wq", "wk", "wv"))
      s_prefix = jnp.einsum("btnh,bnhs->bnts", q, cache.k[j]) * H ** -0.5
      s_new = jnp.einsum("btnh,bunh->bntu", q, k) * H ** -0.5
      s = jnp.concatenate(
          [jnp.where(prefix_BS[:, None, None], s_prefix, -1e30),
           jnp.where(mask_BTT[:, None], s_new, -1e30)], axis=-1)
      p = jax.nn.softmax(s, axis=-1)
      out = (jnp.einsum("bnts,bnsh->btnh", p[..., :S], cache.v[j])
             + jnp.einsum("bntu,bunh->btnh", p[..., S:], v))
      x = x + out.reshape(B, T, N * H) @ lp["wo"]
      x = x + jax.nn.gelu(_ln(x, lp["ln2"]) @ lp["w1"]) @ lp["w2"]
      new_kv.append((k, v))
      if write_cache:
        ks[j], vs[j] = write_kv(ks[j], vs[j], k, v, slots_BT)
    hidden.append(x)
    h = _ln(x, params["ln_f"])
    if logit_positions_BP is not None:
      h = jnp.take_along_axis(h, logit_positions_BP[..., None], axis=1)
    new_cache = KVCache(k=tuple(ks), v=tuple(vs), lengths=cache.lengths
                        + (T if write_cache else 0))
    return ForwardOutput(
        logits=(h @ params["unembed"]).astype(jnp.float32), cache=new_cache,
        taps=jnp.stack([hidden[t] for t in taps]) if taps else None,
        new_kv=None if write_cache else tuple(new_kv))

  def embedding(self, params):
    return params["embed"]

  def lm_head(self, params):
    return params["unembed"].T

  def output_norm(self, params):
    raise NotImplementedError("a LayerNorm, not an RMSNorm: EAGLE-1 and "
                              "Medusa heads, which copy it, do not apply")

  def param_axes(self, params):
    mha = dict(ln1=(None,), wq=(None, "kv_heads"), wk=(None, "kv_heads"),
               wv=(None, "kv_heads"), wo=("kv_heads", None), ln2=(None,),
               w1=(None, "ffn"), w2=("ffn", None))
    return dict(embed=("vocab", None), pos=(None, None), ln_f=(None,),
                unembed=(None, "vocab"), layers=[mha for _ in params["layers"]])
