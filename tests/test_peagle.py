"""P-EAGLE: a head that drafts a block of K in one forward.

The block's outputs against the head run over the whole sequence from
scratch, greedy identity through the engine, what a P-EAGLE config refuses.
Sampled exactness (chi-square, and the mutation it must catch) is in
tests/test_exactness.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.core import runner
from specjax.core.sampling import Sampler, SamplingParams
from specjax.drafters import Method
from specjax.drafters.base import Context
from specjax.drafters.eagle import EagleDrafter, EagleParams
from specjax.heads.base import HeadConfig
from specjax.heads.vocab import build_draft_vocab
from specjax.models.decoder import Decoder

S = 64
MASK = 36  # the placeholder token


def _peagle(seed=0):
  """The tiny target and an untrained P-EAGLE head over its full vocabulary
  (``init_head``'s warm start: the target's LM head and final norm)."""
  from specjax.training.train import init_head
  cfg, params = testing.tiny("llama_gqa_tied", seed=3)
  hcfg = HeadConfig.for_target(cfg, 37, variant="peagle", taps=(0, 1, 2),
                               mask_token=MASK)
  vocab = build_draft_vocab([np.arange(37)], 37, 37)
  head = init_head(jax.random.key(seed), hcfg, Decoder(cfg), params, vocab)
  # A mask_hidden as large as real features, so the placeholders matter.
  head = dict(head, mask_hidden=jax.random.normal(
      jax.random.key(seed + 1), head["mask_hidden"].shape))
  return cfg, params, hcfg, EagleParams(head=head,
                                        draft_ids=jnp.asarray(vocab.ids),
                                        embed=params.embed)


def test_the_block_equals_the_head_run_over_the_whole_sequence():
  """Invariant: the K outputs of a P-EAGLE block (slot 0: the newest pair
  after the cached prefix; slots 1..K-1: the placeholder token with
  ``mask_hidden``) equal the head run once, causally, from an empty cache
  over every pair of the prompt, the newest pair and the K - 1
  placeholders: the block's positions, slots and mask are right, and the
  prefix it reads is the one the cache holds. Changing the placeholders'
  feature changes slots 1.. and not slot 0."""
  cfg, params, hcfg, dparams = _peagle()
  K, P = 4, 9
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 37, (2, P + 1)).astype(np.int32)  # prompt + 1
  feats = rng.normal(size=(2, P, 3 * cfg.dim)).astype(np.float32)
  drafter = EagleDrafter(hcfg)
  prompt = Context(tokens=jnp.asarray(tokens[:, :P]),
                   num_tokens=jnp.full((2,), P, jnp.int32))
  state = drafter.init(dparams, prompt, S, K, jnp.asarray(feats))
  ctx = Context(tokens=jnp.asarray(tokens),
                num_tokens=jnp.full((2,), P + 1, jnp.int32))
  block = jax.jit(lambda dp: drafter.block_outputs(
      dp, *drafter._start(dp, state, ctx, K), K))
  out_BKD = block(dparams)

  empty = drafter.init(dparams, prompt, S, K, jnp.asarray(feats)
                       ).with_lengths(jnp.zeros((2,), jnp.int32))
  mask_BT = jnp.full((2, K - 1), MASK, jnp.int32)
  call = lambda m, *a: drafter._call(dparams, m, *a)
  h = jnp.concatenate([call("features", jnp.asarray(feats)),
                       call("placeholders", mask_BT)], axis=1)
  whole, _ = drafter._run(dparams, empty, jnp.concatenate(
      [jnp.asarray(tokens[:, 1:]), mask_BT], axis=1), h)
  np.testing.assert_allclose(out_BKD, whole[:, P - 1:], atol=2e-5)

  moved = dparams.replace(head=dict(
      dparams.head, mask_hidden=dparams.head["mask_hidden"] + 1.0))
  other = block(moved)
  np.testing.assert_allclose(other[:, 0], out_BKD[:, 0], atol=1e-6)
  assert not np.allclose(other[:, 1:], out_BKD[:, 1:], atol=1e-3)


def test_greedy_identity_on_a_ragged_batch():
  """Invariant: at T = 0 a P-EAGLE chain emits AR's tokens on a ragged
  batch (an untrained head: most drafts rejected, some first ones
  accepted; deeper slots are accepted once a head is trained)."""
  cfg, params, hcfg, dparams = _peagle(seed=1)
  _greedy_identity(cfg, params, Method(EagleDrafter(hcfg), dparams, 4, 0))


def test_pearl_drafts_behind_pending_drafts_greedy_identically():
  """Invariant: with PEARL (``Method(pearl=True)``) a P-EAGLE head drafts
  behind the pending drafts (``propose_behind``) and emits AR's tokens at
  T = 0 on a ragged batch, with steps in both modes."""
  cfg, params, hcfg, dparams = _peagle(seed=1)
  spec = _greedy_identity(cfg, params, Method(EagleDrafter(hcfg), dparams, 3,
                                              0, pearl=True))
  assert sum(r.post_verify_steps for r in spec.rows) > 0
  assert sum(r.pre_verify_steps for r in spec.rows) > 0


def test_pearl_pairs_each_committed_token_with_its_features():
  """Invariant: after every PEARL step (both modes) the head's pending
  pairs hold, for each committed position t from its stable length to the
  newest token, the target's features at t as one teacher-forced forward
  over the committed tokens gives them (1e-5): the block's features are
  paired with the right tokens after an accepted chain (no bonus) and
  after a rejection. (Misaligned features would stay exact, only draft
  worse, so the chi-square cannot see this.)"""
  from specjax.core import bucketing, engine
  cfg, params, hcfg, dparams = _peagle(seed=1)
  target = Decoder(cfg)
  prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 1, 9], [3, 4, 3, 4, 3, 4, 3, 4]]
  prompt_BT, lengths = bucketing.pad_prompts(prompts)
  kw = dict(target=target, dcfg=engine.DecodeConfig(
      capacity=S, drafter=EagleDrafter(hcfg), num_draft=3, pearl=True),
      drafter_params=dparams)
  state = engine.prefill_jit(params, prompt_BT, lengths, jax.random.key(0),
                             np.int32(40), **kw)
  B, modes = len(prompts), set()
  for _ in range(8):
    modes |= {int(n > 0) for n in np.asarray(state.drafter_state.num)}
    state = engine.step_jit(params, state, **kw)
    assert not np.asarray(state.done).any()
    out = target.forward(params, state.tokens,
                         target.init_cache(params, B, S), taps=hcfg.taps)
    feats = np.asarray(jnp.concatenate(list(out.taps), axis=-1))
    inner = state.drafter_state.inner
    stable, num = np.asarray(inner.lengths), np.asarray(state.num_tokens)
    for b in range(B):
      count = num[b] - 1 - stable[b]
      assert 1 <= count <= 3
      np.testing.assert_allclose(inner.pending[b, :count],
                                 feats[b, stable[b]:stable[b] + count],
                                 atol=1e-5)
  assert modes == {0, 1}


def test_drafting_behind_nothing_is_the_plain_block():
  """Invariant: ``propose_behind`` with nothing behind draws the plain
  block's K drafts from the same K distributions (its longer block of
  2K - 1 slots is causal: later slots change nothing before them), and
  behind P it draws from slots P.., which differ; an EAGLE-3 head, whose
  drafts read the draft before, is refused."""
  cfg, params, hcfg, dparams = _peagle(seed=2)
  K, P = 3, 7
  drafter = EagleDrafter(hcfg)
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 37, (2, P + 1)), jnp.int32)
  feats = jnp.asarray(rng.normal(size=(2, P, 3 * cfg.dim)), jnp.float32)
  prompt = Context(tokens=tokens[:, :P], num_tokens=jnp.full((2,), P,
                                                               jnp.int32))
  state = drafter.init(dparams, prompt, S, K, feats)
  ctx = Context(tokens=tokens, num_tokens=jnp.full((2,), P + 1, jnp.int32))
  sampler = Sampler(SamplingParams(temperature=1.0))
  key = jax.random.key(0)
  plain = drafter.propose(dparams, state, ctx, key, K, sampler)
  behind = lambda b: drafter.propose_behind(
      dparams, state, ctx, jnp.asarray(b, jnp.int32), key, K, sampler)
  none, some = behind([0, 0]), behind([0, 2])
  np.testing.assert_allclose(none.probs, plain.probs, atol=1e-6)
  np.testing.assert_array_equal(none.tokens, plain.tokens)
  np.testing.assert_allclose(some.probs[0], plain.probs[0], atol=1e-6)
  assert not np.allclose(some.probs[1], plain.probs[1], atol=1e-3)
  e3cfg = HeadConfig.for_target(cfg, 37, taps=(0, 1, 2))
  with pytest.raises(ValueError, match="only a P-EAGLE block drafts"):
    EagleDrafter(e3cfg).propose_behind(dparams, state, ctx,
                                       jnp.zeros((2,), jnp.int32), key, K,
                                       sampler)


def _greedy_identity(cfg, params, method):
  """Asserts ``method`` emits AR's tokens at T = 0 on a ragged batch of the
  tiny target, with drafts accepted; returns its result."""
  from specjax.models.registry import Model
  model = Model(target=Decoder(cfg), params=params, tokenizer=None)
  prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 1, 9], [3, 4, 3, 4, 3, 4, 3, 4]]
  run = lambda **kw: runner.generate_ids(
      model, prompts, max_new_tokens=20, min_new_tokens=20, **kw)
  ar, spec = run(), run(method=method)
  assert [r.output_ids for r in spec.rows] == [r.output_ids for r in ar.rows]
  assert sum(sum(r.accepted_at) for r in spec.rows) > 0
  return spec


def test_a_block_tree_is_the_best_paths_of_the_marginals():
  """Invariant: with every candidate kept, a P-EAGLE tree's root children
  are slot 0's W best tokens and every other expanded node's children slot
  d's W best (the same for every parent at that depth), K deep; T = 0
  output through the engine with such trees equals AR's on a ragged
  batch."""
  cfg, params, hcfg, dparams = _peagle(seed=1)
  K, W = 3, 2
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 37, (2, 10)).astype(np.int32)
  feats = rng.normal(size=(2, 9, 3 * cfg.dim)).astype(np.float32)
  drafter = EagleDrafter(hcfg, tree_width=W)
  prompt = Context(tokens=jnp.asarray(tokens[:, :9]),
                   num_tokens=jnp.full((2,), 9, jnp.int32))
  state = drafter.init(dparams, prompt, S, K, jnp.asarray(feats))
  ctx = Context(tokens=jnp.asarray(tokens), num_tokens=jnp.full((2,), 10))
  C = W + (K - 1) * W * W
  tree = drafter.propose_tree(dparams, state, ctx, None, K, C, None).tree
  out = drafter.block_outputs(dparams, *drafter._start(dparams, state, ctx,
                                                       K), K)
  best = np.argsort(-np.asarray(drafter._call(dparams, "logits", out)),
                    axis=-1)[..., :W]
  tok, par = np.asarray(tree.tokens), np.asarray(tree.parents)
  for b in range(2):
    depth = {0: 0}
    for m in range(1, C + 1):
      depth[m] = depth[int(par[b, m])] + 1
    assert max(depth.values()) == K
    for m in range(C + 1):
      kids = [int(tok[b, c]) for c in range(1, C + 1) if par[b, c] == m]
      if kids:
        assert sorted(kids) == sorted(best[b, depth[m]].tolist()), (b, m)
  _greedy_identity(cfg, params, Method(drafter, dparams, K, 6))


def test_a_block_tree_ranks_the_vocabulary_without_sorting_it():
  """Invariant: the block tree's best tokens per slot come from XLA's top-k
  call, not from a sort of the whole draft vocabulary -- which the top-k
  became on the CPU once fused into the tree's scoring (a SmolLM2 tree's
  draft took 4.5x as long). Read from the compiled program."""
  cfg, _, hcfg, dparams = _peagle()
  drafter = EagleDrafter(hcfg, tree_width=2)
  feats = jnp.zeros((2, 9, 3 * cfg.dim), jnp.float32)
  tokens = jnp.zeros((2, 10), jnp.int32)
  state = drafter.init(dparams, Context(tokens=tokens[:, :9],
                                        num_tokens=jnp.full((2,), 9)),
                       S, 3, feats)
  ctx = Context(tokens=tokens, num_tokens=jnp.full((2,), 10))
  hlo = jax.jit(lambda p, s: drafter.propose_tree(
      p, s, ctx, None, 3, 6, None).tree.tokens).lower(
          dparams, state).compile().as_text()
  sorts = [line for line in hlo.splitlines() if " sort(" in line]
  assert not [line for line in sorts if ",37]" in line], sorts


def test_a_peagle_config_is_refused_where_it_cannot_work():
  """Invariant: a P-EAGLE head needs a placeholder token in the vocabulary,
  and only P-EAGLE heads take one; a static tree shape is refused in one
  line (its trees come from the block's marginals)."""
  cfg, _ = testing.tiny("llama_gqa_tied")
  with pytest.raises(ValueError, match="mask_token must be a token id"):
    HeadConfig.for_target(cfg, 37, variant="peagle", taps=(0, 1, 2))
  with pytest.raises(ValueError, match="mask_token is for P-EAGLE heads"):
    HeadConfig.for_target(cfg, 37, taps=(0, 1, 2), mask_token=3)
  _, _, hcfg, dparams = _peagle()
  with pytest.raises(ValueError, match="not a static tree_shape"):
    EagleDrafter(hcfg, tree_shape=(0, 0, 1)).propose_tree(
        dparams, None, None, None, 2, 3, None)


def test_a_block_deeper_than_the_head_was_trained_is_refused(tmp_path):
  """Invariant: a P-EAGLE head records the depths it was trained on
  (``block_depths``), and a block of more slots is refused in one line --
  by the drafter, and by the method grammar before decoding (K past them,
  or PEARL's 2K - 1 slots past them); a block within them runs. Other
  variants take no depths."""
  import dataclasses
  from specjax.drafters import methods
  from specjax.heads.export import save_head
  cfg, _, hcfg, dparams = _peagle()
  with pytest.raises(ValueError, match="block_depths is a P-EAGLE head's"):
    HeadConfig.for_target(cfg, 37, taps=(0, 1, 2), block_depths=3)
  deep = dataclasses.replace(hcfg, block_depths=3)
  with pytest.raises(ValueError, match="trained on 3 depths; a block of 4"):
    EagleDrafter(deep).block_outputs(dparams, None, None, None, 4)
  path = tmp_path / "pe.npz"
  save_head(path, deep, dparams.head, np.asarray(dparams.draft_ids))
  model = testing.tiny_model("llama_gqa_tied", seed=3)
  for text, words in (("k=4", "a block of 4 slots"),
                      ("k=3:pearl=1", "a block of 5 slots drafts past them "
                       "(num_draft at most 3, with PEARL at most 2)")):
    with pytest.raises(methods.MethodError, match=re.escape(words)):
      methods.build(model, methods.MethodSpec.parse(
          f"peagle:{text}:head={path}"))
  for text in ("k=3", "k=3:nodes=6:width=2", "k=2:pearl=1"):
    methods.build(model, methods.MethodSpec.parse(f"peagle:{text}:head={path}"))


def test_cod_layout_equals_the_rule_written_entry_by_entry():
  """Invariant: COD keeps every position at depth 0 and ceil(T r^d) at
  depth d, each depth's anchors among the depth before's; entry (t, d)
  sits at position t + d and sees depth 0 up to t and its own chain's
  depths 1..d, and nothing else (brute force, entry by entry). Two keys
  draw different anchors; given priorities, each depth keeps anchors of
  the highest first."""
  from specjax.training.ttt import cod_count, cod_layout
  B, T, D, r = 2, 10, 4, 0.5
  lay = cod_layout(jax.random.key(3), B, T, D, r)
  anchor, depth, mask = (np.asarray(x) for x in (lay.anchor, lay.depth,
                                                 lay.mask))
  sizes = [T] + [cod_count(T, r, d) for d in range(1, D)]
  assert sizes == [10, 5, 3, 2]
  np.testing.assert_array_equal(depth, np.repeat(np.arange(D), sizes))
  for b in range(B):
    at = [set(anchor[b][depth == d].tolist()) for d in range(D)]
    assert at[0] == set(range(T)) and all(len(a) == n
                                          for a, n in zip(at, sizes))
    assert all(at[d] <= at[d - 1] for d in range(1, D))
    for i in range(len(depth)):
      for j in range(len(depth)):
        ti, di, tj, dj = anchor[b, i], depth[i], anchor[b, j], depth[j]
        sees = (dj == 0 and tj <= ti) or (tj == ti and 1 <= dj <= di)
        assert mask[b, i, j] == sees, (b, i, j)
  other = cod_layout(jax.random.key(4), B, T, D, r)
  assert not np.array_equal(np.asarray(other.anchor), anchor)
  # With priorities, each depth's anchors are ones of the highest.
  prio = np.random.default_rng(0).integers(0, 3, (B, T))
  ranked = np.asarray(cod_layout(jax.random.key(3), B, T, D, r,
                                 priority_BT=jnp.asarray(prio)).anchor)
  for b in range(B):
    for d in range(1, D):
      kept = ranked[b][depth == d]
      rest = np.setdiff1d(np.arange(T), kept)
      assert prio[b, kept].min() >= prio[b, rest].max(), (b, d)


def test_training_outputs_equal_drafting_on_each_chain():
  """Invariant: every entry (t, d) of ``peagle_outputs`` over a COD layout
  equals what drafting computes for it: the drafter's head run causally
  from an empty cache over the pairs (x[1..t+1], taps[0..t]) and d
  placeholders, its last output (the one forward it is, entry by entry).
  Training and drafting share one layout."""
  from specjax.training.ttt import TTTBatch, cod_layout, peagle_outputs
  cfg, params, hcfg, dparams = _peagle()
  B, T, D = 2, 8, 3
  rng = np.random.default_rng(5)
  tokens = rng.integers(0, 37, (B, T)).astype(np.int32)
  taps = rng.normal(size=(B, T, 3 * cfg.dim)).astype(np.float32)
  batch = TTTBatch(tokens=jnp.asarray(tokens), taps=jnp.asarray(taps),
                   target_logits=None, target_in_vocab=None, loss_mask=None)
  lay = cod_layout(jax.random.key(1), B, T, D, 0.5)
  out = np.asarray(jax.jit(peagle_outputs, static_argnums=1)(
      dparams.head, hcfg, params.embed, batch, lay))
  drafter = EagleDrafter(hcfg)
  prompt = Context(tokens=jnp.asarray(tokens), num_tokens=jnp.full((B,), T))
  empty = drafter.init(dparams, prompt, S, D, jnp.asarray(taps)
                       ).with_lengths(jnp.zeros((B,), jnp.int32))
  call = lambda m, *a: drafter._call(dparams, m, *a)
  run = jax.jit(lambda tok, h: drafter._run(dparams, empty, tok, h)[0])
  anchor, depth = np.asarray(lay.anchor), np.asarray(lay.depth)
  for e in range(len(depth)):
    t, d = anchor[:, e], int(depth[e])
    for b in range(B):
      n = t[b] + 1  # x[T] past the row: its last token (weight 0)
      ext = np.concatenate([tokens[b], tokens[b, -1:]])
      tok = np.concatenate([ext[1:n + 1], [MASK] * d])[None].astype(np.int32)
      h = jnp.concatenate([call("features", jnp.asarray(taps[b:b + 1, :n])),
                           call("placeholders", jnp.asarray(tok[:, n:]))],
                          axis=1)
      ref = run(jnp.broadcast_to(jnp.asarray(tok), (B,) + tok.shape[1:]),
                jnp.broadcast_to(h, (B,) + h.shape[1:]))[0, -1]
      np.testing.assert_allclose(out[b, e], ref, atol=2e-5, err_msg=str(
          (b, e, t[b], d)))


def test_each_entry_is_scored_on_the_token_its_depth_drafts():
  """Invariant: ``peagle_loss`` scores entry (t, d) -- the head's output
  drafting x[t + 2 + d] -- against the target's distribution at t + 1 + d,
  counted where x[t + 2 + d] is an assistant token and the target's argmax
  at t + 1 + d is in the draft vocabulary: per depth, the loss and the
  accuracy equal soft CE and argmax hits summed entry by entry (brute
  force), over anchors drawn by how many depths each is counted at
  (counted brute force too). Scoring every depth on depth 0's token fails
  it."""
  from specjax.heads import head_call
  from specjax.training.ttt import (TTTBatch, cod_layout, peagle_loss,
                                    peagle_outputs)
  cfg, params, hcfg, dparams = _peagle()
  B, T, D, key = 2, 9, 3, jax.random.key(2)
  rng = np.random.default_rng(7)
  batch = TTTBatch(
      tokens=jnp.asarray(rng.integers(0, 37, (B, T)), jnp.int32),
      taps=jnp.asarray(rng.normal(size=(B, T, 3 * cfg.dim)), jnp.float32),
      target_logits=jnp.asarray(3 * rng.normal(size=(B, T, 37)), jnp.float32),
      target_in_vocab=jnp.asarray(rng.random((B, T)) < 0.8),
      loss_mask=jnp.asarray(rng.random((B, T)) < 0.7))
  _, m = peagle_loss(dparams.head, hcfg, params.embed, batch, D, key)
  target, in_vocab, mask = (np.asarray(x) for x in (
      batch.target_logits, batch.target_in_vocab, batch.loss_mask))
  counts = lambda b, t: sum(t + 2 + d < T and mask[b, t + 2 + d]
                            and in_vocab[b, t + 1 + d] for d in range(D))
  lay = cod_layout(key, B, T, D, 0.5, priority_BT=jnp.asarray(
      [[counts(b, t) for t in range(T)] for b in range(B)]))
  logits = np.asarray(head_call(hcfg, dparams.head)("logits", peagle_outputs(
      dparams.head, hcfg, params.embed, batch, lay)))
  ce, hits, count = np.zeros(D), np.zeros(D), np.zeros(D)
  for b in range(B):
    for e, d in enumerate(np.asarray(lay.depth)):
      s = int(lay.anchor[b, e]) + 1 + d  # the position whose next token
      if s + 1 >= T or not (mask[b, s + 1] and in_vocab[b, s]):
        continue
      p = np.exp(target[b, s] - target[b, s].max())
      logq = logits[b, e] - np.log(np.sum(np.exp(logits[b, e])))
      ce[d] -= np.sum(p / p.sum() * logq)
      hits[d] += logits[b, e].argmax() == target[b, s].argmax()
      count[d] += 1
  assert count.min() > 0
  np.testing.assert_array_equal(np.asarray(m["count"]), count)
  np.testing.assert_allclose(np.asarray(m["loss"]), ce / count, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(m["acc"]), hits / count)


@pytest.mark.long
def test_a_head_trained_on_cod_depths_drafts_its_block():
  """Invariant: a P-EAGLE head over-fitted with ``peagle_loss`` on the
  target's own greedy text (all depths in one packed COD sequence) gets
  its block's last slot accepted a quarter of the steps more than the
  untrained head (which drafts nothing deep), the first > 80%, and greedy
  output stays AR's: the training layout (tokens, placeholders, positions,
  mask) is the one drafting runs. The loss's gap above its floor (the
  target's entropy) halves."""
  from specjax.core import engine
  from specjax.training.ttt import peagle_loss
  from tests.test_eagle_ttt import greedy_batch, greedy_decode, overfit
  cfg, params, hcfg, dparams = _peagle(seed=1)
  head = untrained = dict(dparams.head,
                         mask_hidden=0.02 * dparams.head["mask_hidden"])
  prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 1, 9], [3, 4, 3, 4, 3, 4, 3, 4, 3, 4],
             [20]]
  run = greedy_decode(params, Decoder(cfg), prompts)
  ar, _ = run(engine.DecodeConfig(capacity=S))
  K = 3
  vocab = build_draft_vocab([np.arange(37)], 37, 37)
  batch = greedy_batch(params, cfg, hcfg, vocab, prompts, ar)
  loss = lambda h: peagle_loss(h, hcfg, params.embed, batch, K,
                               jax.random.key(5), ratio=1.0)
  head, (loss0, _), (loss1, _) = overfit(loss, head, 3e-3, 400)
  # Soft CE cannot go below the target's entropy over the counted entries
  # (every anchor at every depth at ratio 1).
  p = np.asarray(jax.nn.softmax(batch.target_logits, -1))
  ent = -np.sum(p * np.log(p + 1e-30), -1)
  mask, vocab_ok = np.asarray(batch.loss_mask), np.asarray(
      batch.target_in_vocab)
  T = mask.shape[1]
  w = np.stack([np.pad(mask[:, 2 + d:] & vocab_ok[:, 1 + d:T - 1],
                       ((0, 0), (0, 2 + d))) for d in range(K)])
  e = np.stack([np.pad(ent[:, 1 + d:T - 1], ((0, 0), (0, 2 + d)))
                for d in range(K)])
  floor = float(np.sum(w * e) / np.sum(w))
  assert float(loss1) - floor < 0.5 * (float(loss0) - floor)
  def acceptance(head):
    spec, st = run(engine.DecodeConfig(capacity=S,
                                       drafter=EagleDrafter(hcfg),
                                       num_draft=K), dparams.replace(head=head))
    assert spec == ar
    return (np.asarray(st.accepted_at).sum(0)
            / np.asarray(st.num_forwards).sum())
  before, after = acceptance(untrained), acceptance(head)
  assert after[0] > 0.8 and after[K - 1] > before[K - 1] + 0.25, (before,
                                                                   after)
