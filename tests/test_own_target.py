"""A user's own model (``examples/plain_jax_target.py``: plain jax.numpy,
none of specjax's layers) as a target: the ``Target`` protocol is all the
engine, the drafters and the trainer need."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.plain_jax_target import PlainTarget, init_params
from specjax import Target
from specjax.core import engine
from specjax.models.config import ModelConfig
from tests.test_eagle_ttt import greedy_decode

CFG = ModelConfig(vocab_size=41, dim=24, num_layers=3, num_heads=4,
                  num_kv_heads=4, head_dim=6, ffn_dim=40, max_position=64,
                  name="plain")
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9, 1, 9, 1, 9, 1, 3]]


@pytest.fixture(scope="module")
def own():
  return PlainTarget(CFG), init_params(jax.random.key(0), CFG)


def test_it_is_a_target_and_decodes_consistently(own):
  """Invariants: ``PlainTarget`` satisfies the declared protocol, and its
  forward has the protocol's cache semantics: a prefill then one-token
  steps give the logits of one forward over the whole sequence, and a
  forward with ``write_cache=False`` leaves the cache untouched."""
  target, params = own
  assert isinstance(target, Target)
  fwd = jax.jit(lambda t, c, w: target.forward(params, t, c, write_cache=w),
                static_argnums=2)
  seq = jnp.asarray(np.random.RandomState(0).randint(0, 41, (2, 12)))
  full = fwd(seq, target.init_cache(params, 2, 32), True).logits
  out = fwd(seq[:, :5], target.init_cache(params, 2, 32), True)
  pieces, cache = [out.logits], out.cache
  for t in range(5, 12):
    kept = fwd(seq[:, t:t + 1], cache, False)
    for a, b in zip(kept.cache.k + kept.cache.v, cache.k + cache.v):
      np.testing.assert_array_equal(a, b)
    out = fwd(seq[:, t:t + 1], cache, True)
    pieces.append(out.logits)
    cache = out.cache
  np.testing.assert_allclose(jnp.concatenate(pieces, 1), full, atol=1e-5)


# The fast stage runs the drafters that reach different members of the
# protocol (forward only, taps + embedding + LM head under a tree mask, a
# layer subset); the long stage the other two.
@pytest.mark.parametrize("names", [
    ("ngram", "eagle3_tree", "layerskip"),
    pytest.param(("ngram_trie", "eagle3"), marks=pytest.mark.long)])
def test_every_method_runs_on_it_greedy_equal_ar(own, names):
  """Invariant: on the user's model, n-gram (chain and trie), an untrained
  EAGLE-3 head (chain and dynamic tree) and layer-skip emit AR's greedy
  tokens, and n-gram drafts were accepted."""
  from tests.test_architectures import every_drafter
  target, params = own
  run = greedy_decode(params, target, PROMPTS)
  ar, _ = run(engine.DecodeConfig(capacity=48))
  for name, (kw, dparams) in every_drafter(target, params,
                                           names=names).items():
    out, st = run(engine.DecodeConfig(capacity=48, **kw), dparams)
    assert out == ar, name
    if name.startswith("ngram"):
      assert int(st.accepted_at.sum()) > 0, name


@pytest.mark.long
def test_the_trainer_trains_a_head_on_it(tmp_path, own):
  """Invariant: the EAGLE-3 trainer (TTT under ``lax.scan``, orbax
  checkpoints) runs on the user's model through the protocol alone, and
  the loss falls over 12 steps on a small repeated set."""
  from specjax.models.registry import Model
  from specjax.training import data as edata
  from specjax.training import train as etrain
  target, params = own
  rng = np.random.default_rng(0)
  ids = np.tile(rng.integers(0, 41, (1, 12)), (8, 1)).astype(np.int32)
  mask = np.arange(12)[None, :] >= 3
  ex = edata.Examples(ids, np.broadcast_to(mask, ids.shape).copy(),
                      np.full((8,), 12, np.int32))
  cfg = etrain.TrainConfig().updated({
      "data.heldout": 2, "data.max_len": 12, "batch_size": 2, "steps": 12,
      "ttt.steps": 2, "head.draft_vocab": 41, "optim.lr": 1e-2,
      "optim.warmup": 1, "checkpoint_every": 6, "keep": 1, "log_every": 1})
  run = etrain.train(cfg, tmp_path, model=Model(target, params, None),
                     examples=ex, progress=False)
  losses = [run.losses[s] for s in sorted(run.losses)]
  assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
  assert (tmp_path / "head.npz").is_file()
