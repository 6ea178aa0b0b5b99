"""google-deepmind's ``gemma`` library (PyPI ``gemma`` 2.0.8, its pure-Flax
modules and sampler) as the reference for ``models.gemma_lib.from_gemma``:
random tiny Gemma 2- and Gemma 3-style models built by the library, its
forward's logits and its own greedy sampling loop against specjax's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemma import modules, sampler as sampler_lib, transformer as tlib

from specjax import NGramDrafter
from specjax.core import bucketing, engine
from specjax.models.gemma_lib import config_from_gemma, from_gemma
from specjax.models.weights import WeightError

L, G = modules.AttentionType.LOCAL_SLIDING, modules.AttentionType.GLOBAL
CONFIGS = {
    # Soft-caps that bind, alternating windows shorter than the rows,
    # post norms, multi-head attention (one fused qkv einsum).
    "gemma2": lambda: tlib.TransformerConfig(
        num_layers=4, num_embed=61, embed_dim=32, hidden_dim=44, num_heads=4,
        head_dim=10, num_kv_heads=4, final_logit_softcap=3.0,
        attn_logits_soft_cap=1.0, use_post_attn_norm=True,
        use_post_ffw_norm=True, attention_types=(L, G, L, G),
        sliding_window_size=4, max_cache_length=64),
    # q/k norms, grouped kv heads (q and kv einsums), local/global RoPE
    # bases, transposed gating.
    "gemma3": lambda: tlib.TransformerConfig(
        num_layers=4, num_embed=59, embed_dim=36, hidden_dim=40, num_heads=6,
        head_dim=8, num_kv_heads=2, final_logit_softcap=None,
        use_post_attn_norm=True, use_post_ffw_norm=True,
        attention_types=(L, L, G, L), sliding_window_size=4,
        transpose_gating_einsum=True, use_qk_norm=True,
        local_base_frequency=10_000, global_base_frequency=1_000_000,
        max_cache_length=64),
}
PROMPTS = [[3, 17, 29, 8, 41, 17, 29, 8, 41, 5], [12, 7, 12, 7, 30, 2]]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def lib_model(request):
  """The library's model, random weights (norm scales and weights redrawn:
  its init leaves norms at zero and weights tiny; a small embedding, so the
  layers, not the tied embedding's echo of the input, pick the tokens)."""
  cfg = CONFIGS[request.param]()
  model = tlib.Transformer(cfg)
  tok = jnp.ones((1, 4), jnp.int32)
  params = model.init(jax.random.key(0), tok, jnp.arange(4)[None], None,
                      jnp.tril(jnp.ones((1, 4, 4), bool)))["params"]
  leaves, tree = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  scale = lambda p: (0.5 if "scale" in p else 0.05 if "embedding" in p
                     else 0.35)
  params = jax.tree_util.tree_unflatten(tree, [
      scale(jax.tree_util.keystr(p)) * jax.random.normal(k, v.shape)
      for (p, v), k in zip(leaves, keys)])
  return cfg, model, params


def test_logits_equal_the_library_forward(lib_model):
  """Invariant: the converted model's logits equal the library's own
  forward (f32, 1e-4) over 20 positions, five windows long."""
  cfg, model, params = lib_model
  ours = from_gemma(cfg, params)
  T = 20
  tok = jax.random.randint(jax.random.key(2), (2, T), 1, cfg.num_embed)
  ref, _ = model.apply({"params": params}, tok,
                       jnp.broadcast_to(jnp.arange(T), (2, T)), None,
                       jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)),
                                        (2, T, T)))
  got = ours.target.forward(ours.params, tok,
                            ours.target.init_cache(ours.params, 2, 32)).logits
  np.testing.assert_array_less(np.abs(np.asarray(got - ref)).max(), 1e-4)


@dataclasses.dataclass
class _IdVocab:
  """The sampler's vocabulary interface over "3 17 29" strings of ids;
  pad and EOS outside the model's vocabulary (never sampled)."""
  def EncodeAsIds(self, text):  # noqa: N802 (sentencepiece's names)
    return [int(t) for t in text.split()]

  def DecodeIds(self, ids):  # noqa: N802
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 1

  def eos_id(self):
    return 10_000

  def pad_id(self):
    return -1


def test_greedy_equals_the_library_sampler(lib_model):
  """Invariant: 16 greedy tokens from the library's own sampling loop equal
  specjax's AR and n-gram speculative decoding of the converted model
  (ragged batch, the sampler's BOS first)."""
  cfg, model, params = lib_model
  sampler = sampler_lib.Sampler(model, _IdVocab(), params, cache_length=64)
  n = 16
  with jax.numpy_rank_promotion("allow"):  # the library's own code needs it
    ref = sampler([" ".join(map(str, p)) for p in PROMPTS],
                  total_generation_steps=n + max(map(len, PROMPTS)),
                  echo=False, return_logits=False)
  ours = from_gemma(cfg, params)
  prompt_BT, lengths = bucketing.pad_prompts([[1] + p for p in PROMPTS])
  for dcfg in (engine.DecodeConfig(capacity=48),
               engine.DecodeConfig(capacity=48, drafter=NGramDrafter(),
                                   num_draft=3)):
    st = engine.generate_jit(ours.params, prompt_BT, lengths,
                             jax.random.key(0), np.int32(n),
                             target=ours.target, dcfg=dcfg)
    for b, text in enumerate(ref.text):
      want = [int(t) for t in text.split()][:n]
      assert len(set(want)) > 3  # not one token echoed
      assert st.tokens[b, lengths[b]:st.num_tokens[b]].tolist() == want


def test_unknown_config_fields_are_refused():
  """Invariant: a gemma config field or value the adapter cannot honour is
  refused naming it (a newer library's option, a scaled local RoPE)."""
  @dataclasses.dataclass(frozen=True)
  class Newer(tlib.TransformerConfig):
    use_bidirectional_attention: bool = False
  base = dataclasses.asdict(CONFIGS["gemma2"]())
  with pytest.raises(WeightError, match="use_bidirectional_attention"):
    config_from_gemma(Newer(**base))

  @dataclasses.dataclass(frozen=True)
  class Scaled(tlib.TransformerConfig):
    local_scale_factor: float = 2.0
  with pytest.raises(WeightError, match="local_scale_factor=2.0"):
    config_from_gemma(Scaled(**base))
