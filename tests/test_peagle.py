"""P-EAGLE: a head that drafts a block of K in one forward.

The block's outputs against the head run over the whole sequence from
scratch, greedy identity through the engine, what a P-EAGLE config refuses.
Sampled exactness (chi-square, and the mutation it must catch) is in
tests/test_exactness.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.core import runner
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
  from specjax.models.registry import Model
  model = Model(target=Decoder(cfg), params=params, tokenizer=None)
  prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 1, 9], [3, 4, 3, 4, 3, 4, 3, 4]]
  ar = runner.generate_ids(model, prompts, max_new_tokens=20,
                           min_new_tokens=20)
  spec = runner.generate_ids(model, prompts, max_new_tokens=20,
                             min_new_tokens=20, method=Method(
                                 EagleDrafter(hcfg), dparams, 4, 0))
  assert [r.output_ids for r in spec.rows] == [r.output_ids for r in ar.rows]
  assert sum(sum(r.accepted_at) for r in spec.rows) > 0


def test_a_peagle_config_is_refused_where_it_cannot_work():
  """Invariant: a P-EAGLE head needs a placeholder token in the vocabulary,
  and only P-EAGLE heads take one; its trees are refused in one line."""
  cfg, _ = testing.tiny("llama_gqa_tied")
  with pytest.raises(ValueError, match="mask_token must be a token id"):
    HeadConfig.for_target(cfg, 37, variant="peagle", taps=(0, 1, 2))
  with pytest.raises(ValueError, match="mask_token is for P-EAGLE heads"):
    HeadConfig.for_target(cfg, 37, taps=(0, 1, 2), mask_token=3)
  _, _, hcfg, dparams = _peagle()
  with pytest.raises(ValueError, match="a P-EAGLE head drafts chains"):
    EagleDrafter(hcfg).propose_tree(dparams, None, None, None, 3, 6, None)
