"""CLaSp: the skip set's dynamic programme, skipped layers left unread,
greedy identity.

Sampled exactness is in tests/test_exactness.py; every architecture against
transformers in tests/test_architectures.py.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.core import runner
from specjax.core.cache import KVCache
from specjax.drafters import ClaspDrafter, Method, methods
from specjax.drafters.base import Context
from specjax.drafters.clasp import choose_skip, skip_programme
from specjax.models import decoder
from specjax.models.decoder import Decoder

S = 32


def _model(num_layers: int, seed: int = 0):
  cfg = dataclasses.replace(testing.CONFIGS["llama_gqa_tied"],
                            num_layers=num_layers)
  return cfg, testing.tiny_params(cfg, seed)


def _prefix_and_states(cfg, params, prefix_BT):
  """The cache of the prefixes and ``x_0 .. x_L`` of each row's last
  token."""
  B, T = prefix_BT.shape
  L = cfg.num_layers
  out = decoder.forward(params, cfg, jnp.asarray(prefix_BT),
                        decoder.init_cache(cfg, B, S), taps=tuple(range(L + 1)))
  return out.cache, jnp.transpose(out.taps[:, :, -1], (1, 0, 2))


def _state_of(cfg, params, cache, token_B, skipped) -> jax.Array:
  """The last token's state after its layers but ``skipped``, run from its
  embedding through a forward of the kept layers alone (each over the
  prefix's own keys and values), not through the programme's cells."""
  kept = [i for i in range(cfg.num_layers) if i not in skipped]
  if not kept:
    x = params.embed[token_B]
    return x
  p = cache.lengths - 1
  sub = KVCache(k=tuple(cache.k[i] for i in kept),
                v=tuple(cache.v[i] for i in kept), lengths=p)
  out = decoder.forward(params, cfg, token_B[:, None], sub,
                        positions_BT=p[:, None], layers=kept,
                        taps=(len(kept),), write_cache=False)
  return out.taps[0, :, 0]


def _cos_sum(a, x):
  a, x = np.asarray(a, np.float64), np.asarray(x, np.float64)
  return float(np.sum(np.sum(a * x, -1) / (np.linalg.norm(a, axis=-1)
                                            * np.linalg.norm(x, axis=-1))))


def _reference_sets(cfg, params, cache, token_B, hidden, M) -> dict:
  """The programme written from its definition: ``{(i, j): the skip set
  of cell (i, j)}``, each candidate's state recomputed from scratch for the
  skip set it stands for."""
  L = cfg.num_layers
  sets = {(0, 0): frozenset()}
  for i in range(1, L + 1):
    sets[i, 0] = frozenset()
    for j in range(1, min(i, M) + 1):
      skip_set = sets[i - 1, j - 1] | {i - 1}
      if j > i - 1:
        sets[i, j] = skip_set
        continue
      run_set = sets[i - 1, j]
      x = hidden[:, i]
      score = lambda s: _cos_sum(_state_of(cfg, params, cache, token_B,
                                           s | set(range(i, L))), x)
      sets[i, j] = skip_set if score(skip_set) > score(run_set) else run_set
  return sets


@pytest.mark.parametrize("num_layers,num_skipped", [(2, 1), (5, 2), (6, 3)])
def test_the_programme_equals_its_definition(num_layers, num_skipped):
  """Invariant: the batched programme (one layer call per layer on all M
  candidates, each seeing the prefix and itself) holds in every cell the
  state of the cell's skip set run from the token's embedding by a forward
  of its kept layers, and picks the skip set of the recursion written cell
  by cell with every candidate recomputed that way; with two layers and one
  skipped, that is the exhaustive search's best set."""
  cfg, params = _model(num_layers)
  rng = np.random.default_rng(num_layers)
  prefix = rng.integers(0, cfg.vocab_size, (2, 9))
  cache, hidden = _prefix_and_states(cfg, params, prefix)
  target, M = Decoder(cfg), num_skipped
  got = jax.jit(lambda p, h, c: choose_skip(target, p, h, c, M))(
      params, hidden, cache)
  got = set(np.flatnonzero(np.asarray(got)).tolist())
  token_B = jnp.asarray(prefix[:, -1])
  sets = _reference_sets(cfg, params, cache, token_B, hidden, M)
  assert len(got) == M and got == set(sets[num_layers, M])
  _, states = jax.jit(lambda p, h, c: skip_programme(target, p, h, c, M))(
      params, hidden, cache)
  for (i, j), cell in sets.items():
    if i:
      np.testing.assert_allclose(
          states[i - 1, :, j], _state_of(cfg, params, cache, token_B,
                                         cell | set(range(i, num_layers))),
          atol=2e-5)
  if num_layers == 2:
    best = max(itertools.combinations(range(num_layers), num_skipped),
               key=lambda s: _cos_sum(_state_of(cfg, params, cache, token_B,
                                                set(s)), hidden[:, -1]))
    assert got == set(best)


def test_skipped_layers_are_never_read():
  """Invariant: with a skip set in place, NaN weights in the skipped layers
  leave the drafts and their distributions unchanged (a skipped layer is
  not computed); NaN in a layer the draft runs does change them (the check
  can fail)."""
  cfg, params = _model(4)
  rng = np.random.default_rng(1)
  prompt = rng.integers(0, cfg.vocab_size, (2, 10)).astype(np.int32)
  cache = decoder.forward(params, cfg, jnp.asarray(prompt[:, :-1]),
                          decoder.init_cache(cfg, 2, S)).cache
  drafter = ClaspDrafter.from_target(Decoder(cfg), 2, refresh=2)
  ctx = Context(tokens=jnp.asarray(prompt), num_tokens=jnp.full((2,), 10),
                cache=cache)
  skip = np.array([False, True, False, True])
  state = drafter.init(None, ctx, S, 3, jnp.zeros((2, 10, 5 * cfg.dim)))
  state = state.replace(skip=jnp.broadcast_to(skip, (2, 4)),
                        age=jnp.zeros((2,), jnp.int32))  # no new choice
  from specjax.core.sampling import SamplingParams
  propose = jax.jit(lambda p: drafter.propose(
      p, state, ctx, jax.random.key(0), 3, SamplingParams()))
  poison = lambda i: params.replace(layers=tuple(
      jax.tree.map(lambda w: jnp.full_like(w, jnp.nan), lp) if j == i else lp
      for j, lp in enumerate(params.layers)))
  clean = propose(params)
  for i in np.flatnonzero(skip):
    nan = propose(poison(i))
    np.testing.assert_array_equal(nan.tokens, clean.tokens)
    np.testing.assert_array_equal(nan.probs, clean.probs)
  run = propose(poison(0))
  assert not (np.array_equal(run.tokens, clean.tokens)
              and np.array_equal(run.probs, clean.probs))


def test_each_tree_node_has_the_skipping_models_best_children():
  """Invariant: with every candidate kept, each node of CLaSp's tree that
  has children has exactly the W best tokens of the skipping model's
  forward over the node's root path alone on the target's cache of the
  prefix (one sequence per node, brute force), and the tree is K deep:
  the block's slots, positions and ancestor mask are right."""
  cfg, params = _model(4)
  rng = np.random.default_rng(2)
  prompt = rng.integers(0, cfg.vocab_size, (2, 10)).astype(np.int32)
  cache = decoder.forward(params, cfg, jnp.asarray(prompt[:, :-1]),
                          decoder.init_cache(cfg, 2, S)).cache
  K, W = 3, 2
  drafter = ClaspDrafter.from_target(Decoder(cfg), 2, tree_width=W)
  ctx = Context(tokens=jnp.asarray(prompt), num_tokens=jnp.full((2,), 10),
                cache=cache)
  skip = jnp.asarray([True, False, False, True])
  state = drafter.init(None, ctx, S, K, jnp.zeros((2, 10, 5 * cfg.dim)))
  state = state.replace(skip=jnp.broadcast_to(skip, (2, 4)),
                        age=jnp.zeros((2,), jnp.int32))
  C = W + (K - 1) * W * W
  tree = jax.jit(lambda p: drafter.propose_tree(
      p, state, ctx, None, K, C, None).tree)(params)
  tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
  assert np.asarray(tree.valid).all()
  for b in range(2):
    row_cache = decoder.forward(params, cfg, jnp.asarray(prompt[b:b + 1, :-1]),
                                decoder.init_cache(cfg, 1, S)).cache
    paths = {0: [int(tokens[b, 0])]}
    for m in range(1, C + 1):
      paths[m] = paths[int(parents[b, m])] + [int(tokens[b, m])]
    assert max(map(len, paths.values())) == K + 1
    for m, path in paths.items():
      kids = {int(tokens[b, c]) for c in range(1, C + 1)
              if parents[b, c] == m}
      if not kids:
        continue
      logits = decoder.forward(params, cfg, jnp.asarray([path]), row_cache,
                               skip=skip, write_cache=False).logits[0, -1]
      assert kids == set(np.argsort(-np.asarray(logits))[:W].tolist()), m


def test_greedy_identity_on_a_ragged_batch():
  """Invariant: at T = 0 CLaSp (the set re-chosen every step, or every
  third; a chain or a tree) emits AR's tokens on a ragged batch, with
  drafts accepted."""
  model = testing.tiny_model()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 37, 12).tolist() * 2,
             rng.integers(3, 37, 7).tolist()]
  ar = runner.generate_ids(model, prompts, max_new_tokens=24,
                           min_new_tokens=24)
  for text in ("clasp:k=3:layers=2", "clasp:k=2:layers=1:refresh=3",
               "clasp:k=3:layers=2:nodes=6:width=2"):
    spec = runner.generate_ids(model, prompts, max_new_tokens=24,
                               min_new_tokens=24, method=methods.build(
                                   model, methods.MethodSpec.parse(text)))
    assert [r.output_ids for r in spec.rows] == [r.output_ids
                                                 for r in ar.rows]
    assert sum(sum(r.accepted_at) for r in spec.rows) > 0


def test_clasp_is_refused_where_it_cannot_work():
  """Invariant: CLaSp on a target without ``run_layer``, or with all or
  none of its layers, is one line naming the problem."""
  model = testing.tiny_model()

  class NoLayers:
    config = model.config
  with pytest.raises(ValueError, match="needs a target with run_layer"):
    ClaspDrafter.from_target(NoLayers(), 2)
  with pytest.raises(methods.MethodError, match="1 <= layers < 3"):
    methods.build(model, methods.MethodSpec.parse("clasp:layers=3"))
  with pytest.raises(methods.MethodError, match="refresh must be >= 1"):
    methods.MethodSpec.parse("clasp:refresh=0")


@pytest.mark.long
def test_smollm2_greedy_identity(smollm2):
  """Invariant: on SmolLM2 at T = 0, CLaSp equals AR token for token on a
  ragged batch of chat prompts, with drafts accepted."""
  prompts = [smollm2.tokenizer.encode_chat(p) for p in
             ("List three uses of a paperclip.", "Hi!")]
  ar = runner.generate_ids(smollm2, prompts, max_new_tokens=32)
  spec = runner.generate_ids(smollm2, prompts, max_new_tokens=32,
                             method=methods.build(smollm2, methods.MethodSpec(
                                 "clasp", num_draft=3, layers=20)))
  for a, s in zip(ar.rows, spec.rows):
    assert s.output_ids == a.output_ids
  assert sum(sum(r.accepted_at) for r in spec.rows) > 0
