"""Every architecture ``load_model`` reads, against transformers (the
reference nobody here wrote) on random tiny checkpoints it builds.

Architectures (``tests.tiny_hf.ARCH_CONFIGS``): Mistral with a sliding
window, Qwen3 (q/k norms, sliding top layers), Gemma 2 (soft-caps, sandwich
norms, alternating windows), Gemma 3 (local/global RoPE, q/k norms), Phi-3
(fused projections, window) and Llama with biases and GELU. Windows are
shorter than the sequences, soft-caps bind (``test_each_feature_binds``
shows turning each off moves the logits far past the tolerance).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.core import engine
from specjax.models import decoder
from specjax.models.decoder import Decoder
from specjax.models.hf_loader import config_from_hf, load_hf
from specjax.models.weights import WeightError
from tests.test_eagle_ttt import greedy_decode
from tests.tiny_hf import ARCH_CONFIGS, make_tiny

ARCHS = sorted(ARCH_CONFIGS)
# Every drafter against transformers' greedy output on every architecture.
# The fast stage runs all of them on Gemma 2, and on Mistral and Qwen3 the
# drafters whose target side differs (features, trees, heads, a second
# model of the architecture, a layer subset, lookahead's window beside a
# tree, CLaSp's layers skipped at run time); the long stage the rest.
FAST = "gemma2_softcap"
DRAFTERS = ("ngram", "ngram_trie", "lookup_trie", "lookahead", "eagle3",
            "eagle3_tree", "eagle3_static_2x2", "eagle3_tree+lookup",
            "eagle1", "medusa", "medusa_static_2x2x1", "layerskip", "clasp",
            "draft_model", "mtp", "mtp_tree", "peagle", "peagle_tree",
            "peagle_tree+lookup", "pearl_draft_model", "pearl_peagle")
CORE = ("eagle3", "eagle3_tree", "medusa_static_2x2x1", "draft_model",
        "layerskip", "mtp", "lookahead", "clasp", "peagle_tree",
        "pearl_peagle")
DRAFTER_RUNS = [pytest.param(FAST, None, id=f"{FAST}-all")] + [
    run for arch in ARCHS if arch != FAST for run in (
        pytest.param(arch, "core", id=f"{arch}-core", marks=() if arch in (
            "mistral_window", "qwen3_qknorm") else pytest.mark.long),
        pytest.param(arch, "rest", id=f"{arch}-rest",
                     marks=pytest.mark.long))]
S = 48  # cache capacity
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5], [9, 1, 9, 1, 9, 1, 2]]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
  d = tmp_path_factory.mktemp(request.param)
  torch_model = make_tiny(request.param, d)
  cfg, params = load_hf(d)
  return request.param, torch_model, cfg, params, d


def _torch_logits(model, seq):
  with torch.no_grad():
    return model(torch.tensor([seq])).logits[0].numpy()


def test_ragged_logits_match_transformers(arch):
  """Invariant: on a ragged batch (right-padded prefill, lengths rolled
  back, then one-token steps at different positions per row), every
  position's logits equal transformers' for the row alone, max |d| < 1e-4
  (f32), at positions up to 3 windows past the start; the taps (EAGLE's
  features) equal transformers' hidden states at those layers' inputs."""
  _, model, cfg, params, _ = arch
  rng = np.random.RandomState(0)
  lengths, steps = np.array([13, 7]), 8
  seqs = rng.randint(0, cfg.vocab_size, (2, 13 + steps))
  padded = np.where(np.arange(13)[None] < lengths[:, None], seqs[:, :13], 0)
  fwd = jax.jit(lambda p, t, c: decoder.forward(p, cfg, t, c,
                                                taps=(0, cfg.num_layers - 1)))
  out = fwd(params, jnp.asarray(padded), decoder.init_cache(cfg, 2, S))
  with torch.no_grad():  # taps: the inputs of layers 0 and L - 1
    hs = model(torch.tensor(seqs[:1, :13]), output_hidden_states=True
               ).hidden_states
  for i, layer in enumerate((0, cfg.num_layers - 1)):
    np.testing.assert_allclose(out.taps[i, 0], hs[layer][0].numpy(),
                               atol=1e-5)
  got = [[out.logits[b, :lengths[b]]] for b in range(2)]
  cache = out.cache.with_lengths(lengths)
  for i in range(steps):
    nxt = seqs[np.arange(2), lengths + i][:, None]
    out = fwd(params, jnp.asarray(nxt), cache)
    cache = out.cache
    for b in range(2):
      got[b].append(out.logits[b])
  for b in range(2):
    n = lengths[b] + steps
    ref = _torch_logits(model, seqs[b, :n].tolist())
    np.testing.assert_array_less(
        np.abs(np.concatenate(got[b]) - ref).max(), 1e-4)
  assert cfg.sliding_window is None or 13 + steps > 3 * cfg.sliding_window


def _without(name, cfg, params):
  """The architecture's distinguishing feature turned off."""
  off = {
      "mistral_window": lambda: (dataclasses.replace(cfg, layer_types=()),
                                 params),
      "phi3_fused": lambda: (dataclasses.replace(cfg, layer_types=()), params),
      "qwen3_qknorm": lambda: (cfg, params.replace(layers=tuple(
          lp.replace(q_norm=None, k_norm=None) for lp in params.layers))),
      "gemma2_softcap": lambda: (dataclasses.replace(cfg, attn_logit_cap=None),
                                 params),
      "gemma3_local_global": lambda: (dataclasses.replace(
          cfg, local_rope_theta=None), params),
      "llama_bias_gelu": lambda: (dataclasses.replace(cfg, activation="silu"),
                                  params),
  }
  return off[name]()


def test_each_feature_binds(arch):
  """Invariant (the parity test is not vacuous): turning off what sets the
  architecture apart (the window, the q/k norms, the attention soft-cap,
  the local RoPE base, GELU) moves the logits by more than 1e-2."""
  name, _, cfg, params, _ = arch
  tok = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size,
                                                     (1, 20)))
  run = lambda c, p: decoder.forward(p, c, tok, decoder.init_cache(c, 1, S)
                                     ).logits
  diff = np.abs(np.asarray(run(cfg, params) - run(*_without(name, cfg,
                                                             params)))).max()
  assert diff > 1e-2, diff


def _transformers_greedy(model, prompts, max_new):
  """transformers' own greedy decoding, each prompt alone."""
  out = []
  for prompt in prompts:
    with torch.no_grad():
      ids = model.generate(torch.tensor([prompt]), do_sample=False,
                           max_new_tokens=max_new, min_new_tokens=max_new,
                           pad_token_id=0)
    out.append(ids[0, len(prompt):].tolist())
  return out


def test_greedy_matches_transformers_generate(arch):
  """Invariant: 32 greedy tokens of specjax's AR decoding (one ragged batch)
  equal transformers' ``generate(do_sample=False)`` for each prompt."""
  _, model, cfg, params, _ = arch
  ours, _ = greedy_decode(params, Decoder(cfg), PROMPTS, 32)(
      engine.DecodeConfig(capacity=S))
  assert ours == _transformers_greedy(model, PROMPTS, 32)


def test_tree_attention_equals_root_paths(arch):
  """Invariant: a tree over a cached prefix, at depth positions under the
  ancestor mask, gives each node the logits of the forward of its root
  path alone, windows counted along that path (prefix 9 > windows)."""
  _, _, cfg, params, _ = arch
  rng = np.random.RandomState(2)
  prefix = rng.randint(0, cfg.vocab_size, (1, 9))
  nodes = rng.randint(0, cfg.vocab_size, (1, 5))
  parents = [-1, 0, 0, 1, 3]  # a chain of depth 3 and a sibling at depth 1
  anc = np.zeros((5, 5), bool)
  for m in range(5):
    a = m
    while a >= 0:
      anc[m, a], a = True, parents[a]
  depth = anc.sum(1) - 1

  @jax.jit
  def tree(params):
    cache = decoder.forward(params, cfg, jnp.asarray(prefix),
                            decoder.init_cache(cfg, 1, S)).cache
    return decoder.forward(params, cfg, jnp.asarray(nodes), cache,
                           positions_BT=jnp.asarray(9 + depth[None]),
                           mask_BTT=jnp.asarray(anc[None])).logits[0]

  paths = [np.concatenate([prefix[0], nodes[0, anc[m]]]) for m in range(5)]
  padded = np.stack([np.pad(p, (0, 14 - len(p))) for p in paths])
  last = np.array([[len(p) - 1] for p in paths])
  alone = jax.jit(lambda params: decoder.forward(
      params, cfg, jnp.asarray(padded), decoder.init_cache(cfg, 5, S),
      logit_positions_BP=jnp.asarray(last)).logits[:, 0])
  np.testing.assert_allclose(tree(params), alone(params), atol=2e-5)


def every_drafter(target, params, draft=None, names=None):
  """Every kind of drafter on ``target`` (or those in ``names``): ``{name:
  (DecodeConfig kwargs, drafter params)}``; untrained heads (EAGLE-3,
  EAGLE-1, Medusa) over the full vocabulary, a datastore of random streams;
  ``draft``: a draft model's ``(target, params)``."""
  from specjax.core import tree
  from specjax.drafters import (ClaspDrafter, DraftModelDrafter,
                                LayerSkipDrafter, LookaheadDrafter,
                                LookupDrafter, NGramDrafter)
  from specjax.drafters.eagle import EagleDrafter, EagleParams
  from specjax.drafters.medusa import MedusaDrafter, MedusaParams
  from specjax.drafters.retrieval import build_datastore
  from specjax.drafters.union import TreeUnion, UnionParams
  from specjax.heads.base import HeadConfig
  from specjax.heads.vocab import build_draft_vocab
  from specjax.training.train import init_head
  cfg = target.config
  V, L = cfg.vocab_size, cfg.num_layers
  vocab = build_draft_vocab([np.arange(V)], V, V)

  ids = jnp.asarray(vocab.ids)

  def head(variant, **kw):
    hcfg = HeadConfig.for_target(cfg, V, variant=variant, **kw)
    return hcfg, init_head(jax.random.key(0), hcfg, target, params, vocab)

  def eagle(variant="eagle3", **drafter):
    taps = {} if L >= 3 or variant not in ("eagle3", "peagle") else dict(
        taps=(0, 1, 2))
    mask = dict(mask_token=V - 1) if variant == "peagle" else {}
    hcfg, h = head(variant, **taps, **mask)
    return EagleDrafter(hcfg, **drafter), EagleParams(
        head=h, draft_ids=ids, embed=target.embedding(params))

  def medusa(**drafter):
    hcfg, h = head("medusa", medusa_heads=3)
    return MedusaDrafter(hcfg, **drafter), MedusaParams(head=h, draft_ids=ids)

  def store():
    return jax.device_put(build_datastore(
        np.random.default_rng(0).integers(0, V, (8, 40)), num_slots=1024))

  def union(variant="eagle3"):
    drafter, hparams = eagle(variant, tree_width=2)
    return TreeUnion(drafter, LookupDrafter(), 3), UnionParams(
        head=hparams, table=store())

  static = lambda text: tuple(tree.parse_shape(text))
  entry = lambda pair, K, nodes=0, **kw: (dict(drafter=pair[0], num_draft=K,
                                               tree_nodes=nodes, **kw),
                                          pair[1])
  build = {  # name: () -> (DecodeConfig kwargs, drafter params)
      "ngram": lambda: entry((NGramDrafter(), None), 4),
      "ngram_trie": lambda: entry((NGramDrafter(num_paths=3), None), 4, 8),
      "lookup_trie": lambda: entry((LookupDrafter(), store()), 4, 6),
      "lookahead": lambda: entry((LookaheadDrafter(window=3, width=2), None),
                                 3, 6),
      "eagle3": lambda: entry(eagle(), 3),
      "eagle3_tree": lambda: entry(eagle(tree_width=2), 3, 6),
      "eagle3_static_2x2": lambda: entry(eagle(tree_shape=static("2x2")), 3, 6),
      "eagle3_tree+lookup": lambda: entry(union(), 3, 7),
      "eagle1": lambda: entry(eagle("eagle1"), 3),
      "mtp": lambda: entry(eagle("mtp"), 3),
      "mtp_tree": lambda: entry(eagle("mtp", tree_width=2), 3, 6),
      "peagle": lambda: entry(eagle("peagle"), 3),
      "peagle_tree": lambda: entry(eagle("peagle", tree_width=2), 3, 6),
      "peagle_tree+lookup": lambda: entry(union("peagle"), 3, 7),
      "pearl_peagle": lambda: entry(eagle("peagle"), 3, pearl=True),
      "medusa": lambda: entry(medusa(), 3),
      "medusa_static_2x2x1": lambda: entry(
          medusa(tree_shape=static("2x2x1")), 3, 10),
      "layerskip": lambda: entry(
          (LayerSkipDrafter.from_target(target, 1), params), 3),
      "clasp": lambda: entry(
          (ClaspDrafter.from_target(target, max(1, L // 2)), params), 3),
  }
  if draft is not None:
    build["draft_model"] = lambda: entry(
        (DraftModelDrafter(draft[0]), draft[1]), 3)
    build["pearl_draft_model"] = lambda: entry(
        (DraftModelDrafter(draft[0]), draft[1]), 3, pearl=True)
  assert set(build) <= set(DRAFTERS)
  return {name: build[name]() for name in (names or build)}


@pytest.mark.parametrize("arch,which", DRAFTER_RUNS, indirect=["arch"])
def test_every_drafter_greedy_equals_transformers(arch, which, tmp_path):
  """Invariant: at T = 0 on a ragged batch, every drafter (n-gram chain
  and trie, the n-gram/retrieval trie, lookahead, CLaSp, untrained EAGLE-3
  chain, dynamic and static trees and tree + lookup trie, EAGLE-1, MTP and
  Medusa chains, an MTP dynamic tree, a Medusa static tree, layer-skip, a
  draft model of the same architecture with other weights, an untrained
  P-EAGLE block's chain, tree and tree + lookup trie, and PEARL with the
  draft model and with the P-EAGLE head) emit transformers'
  ``generate(do_sample=False)`` tokens for each row run alone, on every
  architecture; and drafts were both accepted and rejected along the way."""
  name, model, cfg, params, _ = arch
  make_tiny(name, tmp_path, seed=1)
  run = greedy_decode(params, Decoder(cfg), PROMPTS, 32)
  reference = _transformers_greedy(model, PROMPTS, 32)
  drafted = accepted = 0
  draft_cfg, draft_params = load_hf(tmp_path)
  names = [n for n in DRAFTERS if which is None
           or (n in CORE) == (which == "core")]
  for method, (kw, dparams) in every_drafter(
      Decoder(cfg), params, (Decoder(draft_cfg), draft_params),
      names).items():
    spec, st = run(engine.DecodeConfig(capacity=S, **kw), dparams)
    assert spec == reference, method
    assert int(st.num_drafted.sum()) > 0, method
    drafted += int(st.num_drafted.sum())
    accepted += int(st.accepted_at.sum())
  assert 0 < accepted < drafted


# --- what is refused ---------------------------------------------------------

def _saved_config(name, tmp_path):
  make_tiny(name, tmp_path)
  return json.loads((tmp_path / "config.json").read_text())


REFUSED = [  # (architecture, change to config.json, words in the error)
    ("llama_bias_gelu", {"model_type": "gpt2"}, "unsupported model_type"),
    ("llama_bias_gelu", {"hidden_act": "relu"}, "hidden_act 'relu'"),
    ("llama_bias_gelu", {"rope_parameters": {"rope_type": "yarn",
                                             "factor": 4.0,
                                             "rope_theta": 1e4}},
     "rope scaling 'yarn'"),
    ("llama_bias_gelu", {"some_new_knob": 3}, "some_new_knob"),
    ("phi3_fused", {"rope_parameters": {"rope_type": "default",
                                        "rope_theta": 1e4,
                                        "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("phi3_fused", {"rope_parameters": {"rope_type": "longrope",
                                        "rope_theta": 1e4}}, "longrope"),
    ("gemma3_local_global", {"use_bidirectional_attention": True},
     "use_bidirectional_attention"),
    ("qwen3_qknorm", {"layer_types": ["full_attention", "chunked_attention",
                                      "full_attention"]},
     "chunked_attention"),
    ("mistral_window", {"sliding_window": 0}, "sliding_window=0"),
]


@pytest.mark.parametrize("name,change,words", REFUSED,
                         ids=[f"{n}:{next(iter(c))}" for n, c, _ in REFUSED])
def test_unsupported_config_refused_in_one_line(name, change, words, tmp_path,
                                                capsys):
  """Invariant: a config field specjax cannot honour is refused, naming it:
  ``WeightError`` from the loader, and from the CLI one stderr line
  ``specjax: error: ...`` with exit status 2, never a load that decodes
  differently."""
  from tests.test_cli import _assert_usage_error, _main
  cfg = {**_saved_config(name, tmp_path), **change}
  with pytest.raises(WeightError, match=words.replace("(", r"\(")):
    config_from_hf(cfg)
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  proc = _main(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi",
               "--max-new-tokens", "2")
  _assert_usage_error(proc, "specjax: error:", words)


def test_ignored_fields_are_ignored_as_transformers_does(tmp_path):
  """Invariant: fields an architecture's transformers code never reads
  (Mistral's ``attention_bias``, Gemma 3's ``attn_logit_softcapping``) load
  and change nothing, as in transformers; inert bookkeeping loads too."""
  cfg = _saved_config("mistral_window", tmp_path)
  assert config_from_hf({**cfg, "attention_bias": True}) == config_from_hf(cfg)
  g3 = _saved_config("gemma3_local_global", tmp_path / "g3")
  assert (config_from_hf({**g3, "attn_logit_softcapping": 0.5})
          == config_from_hf(g3))
  assert config_from_hf({**cfg, "torch_dtype": "bfloat16",
                         "architectures": ["X"]}) == config_from_hf(cfg)


def test_eagle3_taps_for_any_depth():
  """Invariant: an EAGLE-3 head's default taps are three distinct layers
  in range for any depth >= 3 (the reference's {2, L//2, L-3} from 7 on),
  and a shallower target is refused rather than given impossible taps."""
  from specjax.heads.base import eagle3_taps
  for L in range(3, 40):
    taps = eagle3_taps(L)
    assert len(set(taps)) == 3 and 0 <= min(taps) and max(taps) < L, (L, taps)
  assert eagle3_taps(30) == (2, 15, 27)
  with pytest.raises(ValueError, match="three distinct layers"):
    eagle3_taps(2)


def test_native_path_equals_xla(arch):
  """Invariant: with the weights packed for the native CPU kernels, a
  prefill and a 5-token verify give XLA's logits (1e-5 of the largest) on
  every architecture: the kernel's attention where it computes the layer
  (full attention, no soft-cap; another query scale folded into q), XLA's
  on sliding and soft-capped layers."""
  from specjax.kernels import native
  from tests.test_native import _assert_close, _logits
  if not native.available():
    pytest.skip("native kernels not built")
  _, _, cfg, params, _ = arch
  rng = np.random.default_rng(3)
  prompt, new = (jnp.asarray(rng.integers(0, cfg.vocab_size, (2, t)),
                             jnp.int32) for t in (13, 5))
  for a, b in zip(_logits(decoder.pack_params(params), cfg, prompt, new),
                  _logits(params, cfg, prompt, new)):
    _assert_close(a, b)


@pytest.mark.parametrize("arch", ["gemma2_softcap", "mistral_window",
                                  "phi3_fused", "qwen3_qknorm"],
                         indirect=True)
def test_a_window_wider_than_the_cache_is_full_attention(arch):
  """Invariant: a window at least the cache's capacity never binds (no two
  positions of a row are further apart), so the layer runs as a full one,
  on the native kernel where that applies: the same logits as without
  windows, exactly."""
  _, _, cfg, params, _ = arch  # sliding layers on the full layers' RoPE
  tok = jnp.asarray(np.random.RandomState(4).randint(0, cfg.vocab_size,
                                                     (2, 20)))
  run = lambda c: decoder.forward(decoder.pack_params(params), c, tok,
                                  decoder.init_cache(c, 2, 24)).logits
  full = dataclasses.replace(cfg, layer_types=(), sliding_window=None)
  np.testing.assert_array_equal(
      run(dataclasses.replace(cfg, sliding_window=24)), run(full))
  assert np.abs(np.asarray(run(cfg) - run(full))).max() > 1e-2  # it binds


def _joint_first_two(cfg, params, draft, sampling, n=50_000, seed=0):
  """n rows of one prompt, K = 2 drafts from ``draft`` (a draft model's
  ``(config, params)``): the histogram of (generated token 1, token 2)
  and the exact joint of the target's warped distributions."""
  from specjax.core.sampling import warp
  from specjax.drafters import DraftModelDrafter
  prompt = [5, 6, 7]
  dcfg = engine.DecodeConfig(capacity=16, sampling=sampling, num_draft=2,
                             drafter=DraftModelDrafter(Decoder(draft[0])))
  st = engine.generate_jit(params, jnp.tile(jnp.array([prompt]), (n, 1)),
                           jnp.full((n,), 3, jnp.int32), jax.random.key(seed),
                           np.int32(2), target=Decoder(cfg), dcfg=dcfg,
                           drafter_params=draft[1])
  t1, t2 = np.asarray(st.tokens[:, 3]), np.asarray(st.tokens[:, 4])
  V = cfg.vocab_size
  seqs = jnp.array([prompt + [t] for t in range(V)], jnp.int32)
  logits = decoder.forward(params, cfg, seqs,
                           decoder.init_cache(cfg, V, 8)).logits
  q1, q2 = warp(logits[0, 2], sampling), warp(logits[:, 3], sampling)
  expected = np.asarray(q1[:, None] * q2).ravel() * n
  accepted = int(st.accepted_at.sum())
  return np.bincount(t1 * V + t2, minlength=V * V), expected, accepted


@pytest.mark.long
@pytest.mark.parametrize("arch", ["gemma2_softcap"], indirect=True)
def test_sampled_speculation_follows_the_target(arch, tmp_path, monkeypatch):
  """Invariant (T = 0.7, top-k 12, top-p 0.9, 50,000 rows, a Gemma 2 target
  drafted by another Gemma 2): no pair outside the warped support is ever
  emitted, the first two generated tokens follow the target's warped joint
  distribution on it (chi-square below the 99.9% critical value) and
  drafts were accepted. Mutation: verifying against the temperature-only
  distribution (top-k/top-p dropped on the target side) must fail."""
  from specjax.core.sampling import SamplingParams, as_sampler
  from tests.test_speculative import _chi2
  name, _, cfg, params, _ = arch
  make_tiny(name, tmp_path, seed=1)
  draft = load_hf(tmp_path)
  sampling = SamplingParams(0.7, top_k=12, top_p=0.9)
  counts, expected, accepted = _joint_first_two(cfg, params, draft, sampling)
  support = expected > 0
  stat, crit = _chi2(counts[support], expected[support])
  assert counts[~support].sum() == 0 and accepted > 0, accepted
  assert stat < crit, (stat, crit)

  real_warp = engine.warp
  monkeypatch.setattr(engine, "warp", lambda logits, sp: real_warp(
      logits, SamplingParams(as_sampler(sp).params.temperature)))
  jax.clear_caches()
  counts, expected, _ = _joint_first_two(cfg, params, draft, sampling)
  jax.clear_caches()
  stat, crit = _chi2(counts[support], expected[support])
  assert counts[~support].sum() > 0 or stat > crit, (stat, crit)
