"""A Tunix rollout engine backed by specjax: GRPO (and Tunix's other RL
learners) with speculative rollouts, exact at the rollout temperature.

Tunix (PyPI ``google-tunix``, written against 0.1.7) builds its rollout
engine from a class, ``ClusterConfig(rollout_engine=...)``; pass
``functools.partial(SpecjaxRollout, method=..., drafter_params=...)``. Tunix
then calls ``SpecjaxRollout(rollout_actor=, tokenizer=, mesh=,
rollout_config=)``, ``generate`` for each micro-batch of prompts (each
repeated once per sample, consecutively), ``update_params`` with the
actor's ``nnx.Param`` state after every step (``model()`` is None, so it
always syncs), and ``get_per_token_logps`` when the learner needs the
rollout policy's log-probs (``num_iterations > 1``).

The actor is a Tunix Llama 3 (``tunix.models.llama3``); ``llama3_target``
and ``llama3_params`` give specjax's target and weights for it (another
architecture needs its own pair: ``target=`` and ``to_params=``).
Conventions, as Tunix's own sampler keeps them: the prompt is BOS +
``tokenizer.encode``, left-padded to ``max_prompt_length`` (a longer one is
refused); completions are unpadded, without their EOS. Two log-probs:
``RolloutOutput.logprobs`` are the sampling policy's (after top-k and
top-p; 0 at T = 0), read from the verify pass; ``get_per_token_logps``
gives ``log_softmax(logits / temperature)``, what Tunix's loss computes
for the actor (the same numbers when neither top-k nor top-p cuts).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout

from specjax.core import bucketing, engine
from specjax.core.runner import row_keys
from specjax.core.sampling import SamplingParams
from specjax.drafters.base import AR, Method
from specjax.kernels import native as native_kernels
from specjax.models.config import ModelConfig
from specjax.models.decoder import (Decoder, DecoderParams, LayerParams,
                                    fuse_qkv, pack_params)
from specjax.models.layers import fuse_gate_up


def llama3_target(config) -> Decoder:
  """specjax's decoder for a Tunix Llama 3 ``ModelConfig`` (plain RoPE:
  Tunix's Llama 3 has no rope scaling)."""
  return Decoder(ModelConfig(
      vocab_size=config.vocab_size, dim=config.embed_dim,
      num_layers=config.num_layers, num_heads=config.num_heads,
      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
      ffn_dim=config.hidden_dim, rope_theta=float(config.rope_theta),
      norm_eps=config.norm_eps, tie_embeddings=config.weight_tying,
      max_position=2 ** 20, name="tunix-llama3"))


def llama3_params(state) -> DecoderParams:
  """specjax's weights of a Tunix Llama 3 (its module, or its
  ``nnx.Param`` state): jittable, so a weight sync is one device program."""
  tree = nnx.state(state, nnx.Param) if isinstance(state, nnx.Module) else state
  w = tree.to_pure_dict() if hasattr(tree, "to_pure_dict") else tree
  layers = []
  for i in itertools.count():
    lw = w["layers"].get(i, w["layers"].get(str(i)))
    if lw is None:
      break
    attn, mlp = lw["attn"], lw["mlp"]
    D, N, H = attn["q_proj"]["w"].shape
    G = attn["k_proj"]["w"].shape[1]
    layers.append(LayerParams(
        attn_norm=lw["input_layernorm"]["w"],
        wqkv=fuse_qkv(attn["q_proj"]["w"].reshape(D, N * H),
                      attn["k_proj"]["w"].reshape(D, G * H),
                      attn["v_proj"]["w"].reshape(D, G * H), G),
        bqkv=None, wo=attn["o_proj"]["w"].reshape(N * H, D),
        mlp_norm=lw["post_attention_layernorm"]["w"],
        w_gate_up=fuse_gate_up(mlp["gate_proj"]["kernel"],
                               mlp["up_proj"]["kernel"]),
        w_down=mlp["down_proj"]["kernel"]))
  head = w.get("lm_head")
  return DecoderParams(embed=w["embedder"]["input_embedding"],
                       layers=tuple(layers), final_norm=w["final_norm"]["w"],
                       lm_head=None if head is None else head["w"].T)


class SpecjaxRollout(base_rollout.BaseRollout):
  """Tunix's ``BaseRollout`` on ``engine.generate`` (module doc).

  Args:
    rollout_actor, tokenizer, mesh, rollout_config: what Tunix passes.
    method: the decoding method (``Method``; AR by default): its drafter,
      ``num_draft`` and ``tree_nodes``.
    drafter_params: the drafter's parameters, or a function of the
      target's specjax params that gives them (an EAGLE head reads the
      target's embedding, which each sync changes); default
      ``method.params``.
    target, to_params: the specjax target and the converter of the
      actor's ``nnx.Param`` state (default: Tunix's Llama 3).
    seed: the rollouts' PRNG seed; call c's row b draws from ``row_keys(
      seed, c, b)``.
    native: pack the weights for the CPU kernels (default: where
      ``load_model`` would).
  """

  def __init__(self, rollout_actor=None, tokenizer=None, mesh=None,
               rollout_config=None, *, method: Method = AR,
               drafter_params: Any = None, target=None,
               to_params: Callable[[Any], Any] = llama3_params, seed: int = 0,
               native: Optional[bool] = None):
    del mesh, rollout_config  # one device; the config comes with each call
    self._tokenizer = tokenizer
    self._target = target or llama3_target(rollout_actor.config)
    self._method = method
    self._drafter_params = (method.params if drafter_params is None
                            else drafter_params)
    on = native_kernels.default_on(jnp.float32) if native is None else native
    self._convert = jax.jit(lambda s: (pack_params if on else (lambda p: p))(
        to_params(s)))
    self._seed = seed
    self._calls = 0
    self._temperature = 1.0
    self.update_params(nnx.state(rollout_actor, nnx.Param))

  def update_params(self, params, filter_types=None) -> None:
    del filter_types
    # Tunix forbids host <-> device copies around this call on a CPU; the
    # conversion is one device program, no host copy is needed.
    with jax.transfer_guard("allow"):
      self._params = self._convert(params)
      p = self._drafter_params
      self._dparams = p(self._params) if callable(p) else p

  @property
  def params(self):
    """The target's params as the last sync gave them."""
    return self._params

  def pad_id(self) -> int:
    return self._tokenizer.pad_id()

  def eos_id(self) -> int:
    return self._tokenizer.eos_id()

  def model(self):
    return None  # specjax holds its own weights: Tunix syncs them

  def _prompt_ids(self, prompt: str, limit: int) -> list[int]:
    bos = self._tokenizer.bos_id()
    ids = ([] if bos is None else [bos]) + list(self._tokenizer.encode(prompt))
    if len(ids) > limit:
      raise ValueError(f"a prompt of {len(ids)} tokens is longer than "
                       f"max_prompt_length {limit}: {prompt[:40]!r}")
    return ids

  def generate(self, prompts, rollout_config, **kwargs
               ) -> base_rollout.RolloutOutput:
    del kwargs
    cfg = rollout_config
    P, T = cfg.max_prompt_length, cfg.max_tokens_to_generate
    ids = [self._prompt_ids(str(p), P) for p in prompts]
    sampling = SamplingParams(float(cfg.temperature), int(cfg.top_k or 0),
                              1.0 if cfg.top_p is None else float(cfg.top_p))
    self._temperature = float(cfg.temperature) or 1.0
    eos = tuple(cfg.eos_tokens or (self.eos_id(),))
    m = self._method
    prompt_BT, lengths = bucketing.pad_prompts(ids, self.pad_id())
    dcfg = engine.DecodeConfig(
        capacity=bucketing.capacity_for(prompt_BT.shape[1], T,
                                        extra=engine.block_width(
                                            m.num_draft, m.tree_nodes)),
        sampling=sampling, eos_ids=eos, drafter=m.drafter,
        num_draft=m.num_draft, tree_nodes=m.tree_nodes)
    keys = row_keys(self._seed, [self._calls] * len(ids), range(len(ids)))
    self._calls += 1
    st = engine.generate_jit(self._params, prompt_BT, lengths, keys,
                             np.int32(T), target=self._target, dcfg=dcfg,
                             drafter_params=self._dparams)
    tokens, lp, num, reason = jax.device_get(
        (st.tokens, st.logprobs, st.num_tokens, st.stop_reason))
    outs, logprobs = [], []
    for b, n in enumerate(lengths):
      end = num[b] - (reason[b] == engine.STOP_EOS)  # the EOS dropped
      outs.append(tokens[b, n:end].astype(np.int32))
      logprobs.append(lp[b, n:end].astype(np.float32))
    left = np.full((len(ids), P), self.pad_id(), np.int32)
    for b, row in enumerate(ids):
      left[b, P - len(row):] = row
    return base_rollout.RolloutOutput(
        text=[self._tokenizer.decode(o.tolist()) for o in outs], logits=None,
        tokens=outs, left_padded_prompt_tokens=left, logprobs=logprobs)

  def get_per_token_logps(self, prompt_tokens, completion_tokens):
    """``f32[B, T]`` ``log_softmax(logits / temperature)`` of each
    completion token (the last rollout's temperature, as Tunix's loss
    scales the actor's), 0 at its padding; one forward over each row's
    prompt (left padding dropped) and completion."""
    return _completion_logps(self._params, jnp.asarray(prompt_tokens),
                             jnp.asarray(completion_tokens), self.pad_id(),
                             self._temperature, target=self._target)


@functools.partial(jax.jit, static_argnames=("target",))
def _completion_logps(params, prompt_BP, completion_BT, pad_id, temperature,
                      *, target):
  """``SpecjaxRollout.get_per_token_logps``: each row's prompt moved left
  over its padding, its completion after it, one forward from an empty
  cache."""
  P, T = prompt_BP.shape[1], completion_BT.shape[1]
  pads_B = jnp.sum(jnp.cumprod(prompt_BP == pad_id, axis=1), axis=1)
  seq_BS = jax.vmap(lambda row, s: jnp.roll(row, -s))(
      jnp.concatenate([prompt_BP, completion_BT], 1), pads_B)
  cache = target.init_cache(params, len(seq_BS),
                            bucketing.bucket_length(P + T))
  logits = target.forward(params, seq_BS, cache).logits / temperature
  at_BT = (P - pads_B)[:, None] - 1 + jnp.arange(T)[None, :]
  tok_BT = jnp.take_along_axis(seq_BS, at_BT + 1, axis=1)
  lp_BT = jnp.take_along_axis(
      jax.nn.log_softmax(jnp.take_along_axis(logits, at_BT[..., None], 1)),
      tok_BT[..., None], -1)[..., 0]
  return jnp.where(completion_BT != pad_id, lp_BT, 0.0)
