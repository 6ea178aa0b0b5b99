"""specjax's Llama-family forward against transformers on random tiny models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.models import decoder, layers
from specjax.models.hf_loader import load_hf
from tests.tiny_hf import TINY_CONFIGS, make_tiny

T, S = 13, 29


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
  d = tmp_path_factory.mktemp(request.param)
  torch_model = make_tiny(request.param, d)
  cfg, params = load_hf(d)
  return torch_model, cfg, params


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def test_full_forward_matches_transformers(tiny):
  """Invariant: logits of a full forward equal transformers' (max |Δ| < 1e-4, f32)."""
  model, cfg, params = tiny
  tokens = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.vocab_size)
  out = decoder.forward(params, cfg, tokens, decoder.init_cache(cfg, 2, S))
  ref = _torch_logits(model, tokens)
  assert out.logits.shape == ref.shape
  np.testing.assert_array_less(np.abs(np.asarray(out.logits) - ref).max(), 1e-4)
  np.testing.assert_array_equal(out.cache.lengths, [T, T])


def test_prefill_then_decode_equals_full_forward(tiny):
  """Invariant: prefill of a prefix + one-token decode steps = one full forward."""
  _, cfg, params = tiny
  tokens = jax.random.randint(jax.random.key(2), (2, T), 0, cfg.vocab_size)
  full = decoder.forward(params, cfg, tokens, decoder.init_cache(cfg, 2, S)).logits
  fwd = jax.jit(lambda p, t, c: decoder.forward(p, cfg, t, c))
  out = fwd(params, tokens[:, :5], decoder.init_cache(cfg, 2, S))
  pieces, cache = [out.logits], out.cache
  for t in range(5, T):
    out = fwd(params, tokens[:, t:t + 1], cache)
    pieces.append(out.logits)
    cache = out.cache
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=2e-5)
  np.testing.assert_array_equal(cache.lengths, [T, T])


@pytest.mark.long
def test_ragged_batch_equals_rows_alone(tiny):
  """Invariant: rows of different lengths in one batch (right-padded prefill,
  lengths rolled back, then decode) give each row's logits as if run alone."""
  _, cfg, params = tiny
  lengths = np.array([4, 11, 7])
  seqs = np.asarray(jax.random.randint(jax.random.key(3), (3, T), 0,
                                       cfg.vocab_size))
  padded = np.where(np.arange(T)[None] < lengths[:, None], seqs, 0)
  out = decoder.forward(params, cfg, jnp.asarray(padded[:, :11]),
                      decoder.init_cache(cfg, 3, S))
  cache = out.cache.with_lengths(lengths)
  nxt = seqs[np.arange(3), lengths][:, None]
  step = decoder.forward(params, cfg, jnp.asarray(nxt), cache)
  for b in range(3):
    alone = np.concatenate([seqs[b, :lengths[b]], nxt[b]])[None]
    ref = decoder.forward(params, cfg, jnp.asarray(alone),
                        decoder.init_cache(cfg, 1, S)).logits
    np.testing.assert_allclose(out.logits[b, :lengths[b]],
                               ref[0, :lengths[b]], atol=2e-5)
    np.testing.assert_allclose(step.logits[b, 0], ref[0, -1], atol=2e-5)


def test_taps_are_layer_inputs(tiny):
  """Invariant: tap i equals transformers' hidden_states[i] (the input of layer i);
  tap L is the last layer's output before the final norm."""
  model, cfg, params = tiny
  tokens = jax.random.randint(jax.random.key(4), (1, 6), 0, cfg.vocab_size)
  taps = (0, 1, cfg.num_layers)
  out = decoder.forward(params, cfg, tokens, decoder.init_cache(cfg, 1, S),
                      taps=taps)
  with torch.no_grad():
    hs = model(torch.tensor(np.asarray(tokens)),
               output_hidden_states=True).hidden_states
  for i, tap in enumerate(taps[:-1]):
    np.testing.assert_allclose(out.taps[i], hs[tap].numpy(), atol=1e-5)
  # transformers' last entry has the final norm applied; ours must not.
  scale_D, eps = decoder.Decoder(cfg).output_norm(params)
  normed = layers.rms_norm(out.taps[-1], scale_D, eps)
  np.testing.assert_allclose(normed, hs[-1].numpy(), atol=1e-5)


def test_missing_tensor_and_bad_arch_errors(tmp_path):
  """Invariant: a missing tensor or unknown architecture is a one-line error."""
  import json
  from safetensors.numpy import load_file, save_file
  from specjax.models.weights import WeightError
  make_tiny("llama_gqa_tied", tmp_path)
  f = next(tmp_path.glob("*.safetensors"))
  tensors = load_file(f)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, f)
  with pytest.raises(WeightError, match="model.layers.1.mlp.up_proj.weight"):
    load_hf(tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["model_type"] = "gpt2"
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(WeightError, match="unsupported model_type 'gpt2'"):
    load_hf(tmp_path)


@pytest.mark.parametrize("tiny", [  # other architectures: the long stage
    "llama_gqa_tied", pytest.param("llama3_rope_scaling", marks=pytest.mark.long),
    pytest.param("qwen2_bias_untied", marks=pytest.mark.long)], indirect=True)
def test_tree_mask_and_positions(tiny):
  """Invariant: with a tree mask and depth positions, each new token sees
  exactly its ancestors: on top of a cached prefix, siblings x1 and x2 (both
  children of x0) give the logits of the chains prefix+x0+x1 and prefix+x0+x2."""
  _, cfg, params = tiny
  seq = np.asarray(jax.random.randint(jax.random.key(6), (1, 7), 0,
                                      cfg.vocab_size))
  prefix, x0, x1, x2 = seq[:, :4], seq[:, 4:5], seq[:, 5:6], seq[:, 6:7]
  cache = decoder.forward(params, cfg, jnp.asarray(prefix),
                        decoder.init_cache(cfg, 1, S)).cache
  mask = jnp.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], bool)
  tree = decoder.forward(params, cfg, jnp.asarray(np.concatenate([x0, x1, x2], 1)),
                       cache, positions_BT=jnp.array([[4, 5, 5]]),
                       mask_BTT=mask)
  for node, leaf in ((1, x1), (2, x2)):
    chain = np.concatenate([prefix, x0, leaf], 1)
    ref = decoder.forward(params, cfg, jnp.asarray(chain),
                        decoder.init_cache(cfg, 1, S)).logits
    np.testing.assert_allclose(tree.logits[0, node], ref[0, -1], atol=2e-5)
  np.testing.assert_allclose(tree.logits[0, 0], ref[0, 4], atol=2e-5)


@pytest.mark.parametrize("tiny", [  # other architectures: the long stage
    "llama_gqa_tied", pytest.param("llama3_rope_scaling", marks=pytest.mark.long),
    pytest.param("qwen2_bias_untied", marks=pytest.mark.long)], indirect=True)
def test_tree_forward_matches_transformers_4d_mask(tiny):
  """Invariant: a random 9-node tree on top of a cached prefix, scored by
  specjax with the ancestor mask and depth positions, gives the logits
  transformers gives for the same nodes fed with ``past_key_values``, a
  custom 4D attention mask (prefix + ancestors) and ``position_ids =
  prefix + depth``: tree attention against a reference nobody here wrote
  (max |d| < 1e-4, f32)."""
  from specjax.core import tree as trees
  model, cfg, params = tiny
  rng = np.random.default_rng(7)
  P, M = 6, 9
  prefix = rng.integers(0, cfg.vocab_size, (1, P))
  nodes = rng.integers(0, cfg.vocab_size, (1, M))
  parents = np.array([[0] + [int(rng.integers(0, m)) for m in range(1, M)]])
  anc = np.asarray(trees.ancestors(jnp.asarray(parents),
                                   jnp.ones((1, M), bool)))
  depth = anc.sum(-1) - 1
  cache = decoder.forward(params, cfg, jnp.asarray(prefix),
                          decoder.init_cache(cfg, 1, S)).cache
  ours = decoder.forward(params, cfg, jnp.asarray(nodes), cache,
                         positions_BT=jnp.asarray(P + depth),
                         mask_BTT=jnp.asarray(anc)).logits[0]
  visible = np.concatenate([np.ones((M, P), bool), anc[0]], 1)
  mask = torch.zeros((1, 1, M, P + M))
  mask[0, 0][~torch.from_numpy(visible)] = torch.finfo(torch.float32).min

  def reference(**mask):
    with torch.no_grad():  # a fresh cache: transformers extends it in place
      past = model(torch.tensor(prefix), use_cache=True).past_key_values
      return model(torch.tensor(nodes), cache=past,
                   position_ids=torch.tensor(P + depth),
                   **mask).logits[0].numpy()

  np.testing.assert_array_less(
      np.abs(np.asarray(ours) - reference(attention_mask=mask)).max(), 1e-4)
  # Not vacuous: transformers' own causal mask gives other logits.
  assert np.abs(np.asarray(ours) - reference()).max() > 1e-2


def test_cache_write_drops_past_capacity():
  """Invariant: writes land at each row's own offset and slots past the
  capacity are dropped instead of wrapping onto the row's prefix."""
  from specjax.core.cache import write_kv
  B, G, H, S_ = 2, 2, 3, 5
  k = jnp.zeros((B, G, H, S_))
  v = jnp.zeros((B, G, S_, H))
  new = jnp.arange(1, 1 + B * 3 * G * H, dtype=jnp.float32).reshape(B, 3, G, H)
  slots = jnp.array([[3, 4, 5], [4, 5, 6]])
  k2, v2 = write_kv(k, v, new, new, slots)
  np.testing.assert_array_equal(v2[0, :, 3], new[0, 0])
  np.testing.assert_array_equal(v2[0, :, 4], new[0, 1])
  np.testing.assert_array_equal(v2[1, :, 4], new[1, 0])
  np.testing.assert_array_equal(k2[1, :, :, 4], new[1, 0])
  assert float(jnp.abs(v2[0, :, :3]).sum() + jnp.abs(v2[1, :, :4]).sum()) == 0
  assert float(jnp.abs(k2[0, :, :, :3]).sum()) == 0


@pytest.mark.parametrize("mutation", [None, "rope_per_layer"])
def test_rope_tables_are_computed_once_per_forward(tiny, mutation,
                                                   monkeypatch):
  """Invariant: the compiled forward evaluates RoPE's cos and sin once for
  all layers, not once per layer (XLA CPU, left to itself, fuses them into
  every layer's RoPE and evaluates them per element of q and k: at 16 new
  tokens 1.6 ms of a SmolLM2 step). Six layers; the two branches of
  ``rope_once``'s conditional hold one each. Mutation caught: ``rope`` in
  place of ``rope_once`` (more than two of each)."""
  import dataclasses
  import re
  if mutation:
    monkeypatch.setattr(decoder, "rope_once", layers.rope)
  _, cfg, _ = tiny
  cfg = dataclasses.replace(cfg, num_layers=6, layer_types=(),
                            local_rope_theta=None)
  params = decoder.random_params(jax.random.key(0), cfg)
  hlo = jax.jit(lambda p, t, c: decoder.forward(p, cfg, t, c).logits).lower(
      params, jnp.zeros((1, 8), jnp.int32),
      decoder.init_cache(cfg, 1, S)).compile().as_text()
  counts = [len(re.findall(rf"\b{op}\(", hlo)) for op in ("cosine", "sine")]
  once = counts[0] <= 2 and counts[1] <= 2
  assert once != bool(mutation), counts
