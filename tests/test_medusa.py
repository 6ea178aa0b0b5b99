"""Medusa heads: the loss's alignment, drafting from each depth's top-k, greedy
identity and trained acceptance through the engine, the trainer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core import bucketing, engine, tree
from specjax.core.sampling import SamplingParams
from specjax.drafters.medusa import MedusaDrafter, MedusaParams
from specjax.heads import head_call
from specjax.heads.base import HeadConfig
from specjax.heads.medusa import MedusaHead
from specjax.heads.vocab import build_draft_vocab
from specjax.models.decoder import Decoder
from specjax.training.ttt import TTTBatch, loss_rows, medusa_loss
from tests.test_eagle_ttt import greedy_decode, greedy_batch, overfit

# D=24, V=37, Vd=29, T=11, 3 depths; the tap is the last layer's output.
CFG = HeadConfig(target_dim=24, target_vocab=37, target_layers=3, taps=(3,),
                 num_heads=6, num_kv_heads=2, head_dim=4, ffn_dim=40,
                 draft_vocab=29, variant="medusa", medusa_heads=3)
B, T = 2, 11
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 1, 9], [3, 4, 3, 4, 3, 4, 3, 4, 3, 4],
           [20]]
SHAPE_2X2X1 = tuple(tree.parse_shape("2x2x1"))


def _random_head(cfg=CFG, seed=0):
  """A head whose depths differ (the blocks start at zero: randomize)."""
  k = jax.random.split(jax.random.key(seed), 2)
  params = MedusaHead(cfg).init(k[0], jnp.zeros((1, 2, cfg.target_dim)))
  leaves, treedef = jax.tree.flatten(params["params"])
  keys = jax.random.split(k[1], len(leaves))
  return jax.tree.unflatten(treedef, [
      0.5 * jax.random.normal(kk, x.shape) + (x if x.ndim == 1 else 0)
      for kk, x in zip(keys, leaves)])


@pytest.mark.long
def test_medusa_loss_scores_depth_k_against_token_t_plus_2_plus_k():
  """Invariant: depth k's loss is the soft CE of the head's distribution at
  position t (from the hidden state at t) against the target's distribution
  of token t + 2 + k (its logits at t + 1 + k), counted where token t + 2 + k
  is an assistant token and the target's argmax at t + 1 + k is in Vd,
  averaged over those, summed with weights 0.8^k; accuracy is top-1
  agreement. Checked against a direct computation, with and without the
  LM head on gathered rows (an off-by-one alignment fails it)."""
  params = _random_head()
  k = jax.random.split(jax.random.key(1), 4)
  batch = TTTBatch(
      tokens=jax.random.randint(k[0], (B, T), 0, 37),
      taps=jax.random.normal(k[1], (B, T, 24)),
      target_logits=2 * jax.random.normal(k[2], (B, T, 29)),
      target_in_vocab=jax.random.uniform(k[3], (B, T)) < 0.8,
      loss_mask=jnp.arange(T)[None, :] >= jnp.array([[3], [5]]))
  call = head_call(CFG, params)
  out = call("outputs", call("features", batch.taps))
  shift = lambda a, s: jnp.concatenate(
      [a[:, s:], jnp.zeros((B, s) + a.shape[2:], a.dtype)], axis=1)
  total, accs = 0.0, []
  for d in range(3):
    logq = jax.nn.log_softmax(call("logits", out[:, :, d]))
    tgt = shift(batch.target_logits, 1 + d)
    w = (shift(batch.loss_mask, 2 + d) & shift(batch.target_in_vocab, 1 + d)
         ).astype(jnp.float32)
    ce = -jnp.sum(jax.nn.softmax(tgt) * logq, -1)
    n = jnp.maximum(w.sum(), 1.0)
    total += 0.8 ** d * jnp.sum(w * ce) / n
    accs.append(jnp.sum(w * (jnp.argmax(logq, -1) == jnp.argmax(tgt, -1)))
                / n)
  for rows in (None, loss_rows(batch.loss_mask, 4)):
    loss, m = medusa_loss(params, CFG, batch, rows=rows)
    np.testing.assert_allclose(loss, total, rtol=1e-5)
    np.testing.assert_allclose(m["acc"], accs, rtol=1e-6)
    assert m["loss"].shape == (3,)


def _tiny(tmp_path):
  from specjax import testing
  return testing.tiny("llama_gqa_tied", seed=0)


@pytest.mark.long
def test_medusa_drafts_each_depths_top_k(tmp_path):
  """Invariants after a ragged prefill on a tiny target: the head reads the
  target's last hidden state at the newest position the target ran (the
  prompt's last, recomputed here by a plain forward); a greedy chain's
  draft k is depth k's argmax; in the static tree 2x2x1 a node at depth d
  and sibling rank r is depth d-1's r-th best token; K past the head's
  depths is refused."""
  from specjax.models import decoder
  tcfg, tparams = _tiny(tmp_path)
  cfg = dataclasses.replace(CFG, draft_vocab=37)
  vocab = build_draft_vocab([np.arange(37)], 37, 37)
  dparams = MedusaParams(head=_random_head(cfg), draft_ids=jnp.asarray(
      vocab.ids))
  prompts = [[5, 6, 7, 8, 5], [9, 1]]
  prompt_BT, lengths = bucketing.pad_prompts(prompts)

  def start(drafter, k, nodes=0):
    dcfg = engine.DecodeConfig(capacity=64, drafter=drafter, num_draft=k,
                               tree_nodes=nodes)
    st = engine.prefill(tparams, prompt_BT, lengths, jax.random.key(0), 8,
                        target=Decoder(tcfg), dcfg=dcfg, drafter_params=dparams)
    return (dparams, st.drafter_state, st.context, jax.random.key(1), k)

  want = []  # [B, depth, ranks]: each depth's ranking, from a plain forward
  for b, p in enumerate(prompts):
    out = decoder.forward(tparams, tcfg, jnp.asarray([p]), decoder.init_cache(
        tcfg, 1, 16, jnp.float32), taps=(3,))
    call = head_call(cfg, dparams.head)
    h = call("features", out.taps[0][:, len(p) - 1])
    want.append(np.argsort(-np.asarray(call("logits", call("outputs", h))[0]),
                           axis=-1))
  want = np.stack(want)
  chain = MedusaDrafter(cfg).propose(*start(MedusaDrafter(cfg), 3),
                                     SamplingParams())
  np.testing.assert_array_equal(chain.tokens, want[:, :, 0])
  assert chain.num_drafted.tolist() == [3, 3]
  drafter = MedusaDrafter(cfg, tree_shape=SHAPE_2X2X1)
  args = start(drafter, 3, 10)
  t = drafter.propose_tree(*args, 10, SamplingParams()).tree
  shape = tree.Shape(SHAPE_2X2X1)
  for m, path in enumerate(shape.paths(), 1):
    np.testing.assert_array_equal(t.tokens[:, m],
                                  want[:, len(path) - 1, path[-1]])
  newest = args[2].newest()  # the prefill's sample
  np.testing.assert_array_equal(t.tokens[:, 0], newest)
  with pytest.raises(ValueError, match="exceeds the Medusa head's 3"):
    MedusaDrafter(cfg).propose(*start(MedusaDrafter(cfg), 4),
                               SamplingParams())


@pytest.mark.long
def test_medusa_greedy_identity_and_trained_acceptance(tmp_path):
  """Invariants on a tiny target, ragged batch of 4, chain K = 3 and the
  static tree 2x2x1: (1) at T = 0 the output equals AR token for token with
  an untrained head (depths start as the target's LM head: wrong a step
  early); (2) ``medusa_loss`` overfit on the target's own greedy text
  raises each depth's accuracy by > 0.15, to > 0.85; (3) the overfit head then gets
  most drafts accepted, still equal to AR (the hidden state the drafter
  reads is the one training paired with the depth-k token; one that reads
  it a position early falls below the bounds, checked)."""
  from specjax.training.train import init_head
  tcfg, tparams = _tiny(tmp_path)
  cfg = dataclasses.replace(CFG, draft_vocab=37)
  vocab = build_draft_vocab([np.arange(37)], 37, 37)
  head = init_head(jax.random.key(0), cfg, Decoder(tcfg), tparams, vocab)
  decode = greedy_decode(tparams, Decoder(tcfg), PROMPTS)
  run = lambda dcfg, head=None: decode(dcfg, head and MedusaParams(
      head=head, draft_ids=jnp.asarray(vocab.ids)))

  ar, _ = run(engine.DecodeConfig(capacity=64))
  chain = engine.DecodeConfig(capacity=64, drafter=MedusaDrafter(cfg),
                              num_draft=3)
  static = engine.DecodeConfig(
      capacity=64, drafter=MedusaDrafter(cfg, tree_shape=SHAPE_2X2X1),
      num_draft=3, tree_nodes=len(SHAPE_2X2X1) - 1)
  for dcfg in (chain, static):
    assert run(dcfg, head)[0] == ar

  batch = greedy_batch(tparams, tcfg, cfg, vocab, PROMPTS, ar)
  head, (_, m0), (_, m) = overfit(lambda p: medusa_loss(p, cfg, batch), head,
                                  1e-2, 200)
  assert (np.asarray(m["acc"]) > np.maximum(np.asarray(m0["acc"]) + 0.15,
                                            0.85)).all(), (m0["acc"],
                                                           m["acc"])
  # Bounds per setting, between the correct drafter (chain 0.80 / 0.67 of
  # ~30 forwards, tree 0.96 / 0.77 of ~26, depth 0 / 2) and one reading the
  # hidden state a position early (chain 0.28 / 0.19, tree 0.73 / 0.52).
  bounds = {chain: (0.6, 0.5), static: (0.85, 0.6)}

  def accepted(dcfg):
    out, st = run(dcfg, head)
    assert out == ar
    acc = (np.asarray(st.accepted_at).sum(0)
           / np.asarray(st.num_forwards).sum())
    return acc[0] > bounds[dcfg][0] and acc[2] > bounds[dcfg][1], acc

  for dcfg in (chain, static):
    ok, acc = accepted(dcfg)
    assert ok, acc
  logits = MedusaDrafter._logits  # mutation: the hidden state a position early
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(MedusaDrafter, "_logits", lambda self, p, s, *a: logits(
        self, p, s.replace(start=s.start + 1), *a))
    jax.clear_caches()
    try:
      for dcfg in (chain, static):
        ok, acc = accepted(dcfg)
        assert not ok, acc
    finally:
      jax.clear_caches()


@pytest.mark.long
def test_trainer_trains_medusa_and_methods_load_it(tmp_path):
  """Invariants: ``specjax train``'s trainer runs a Medusa head (the
  variant's loss, the feature norm frozen, the blocks moving), exports a
  file ``--method medusa --head`` loads as chain or static tree, and
  ``methods.build`` names what is wrong with bad Medusa requests."""
  from specjax.drafters import methods
  from specjax.training import train as etrain
  from tests.test_eagle_train import CFG as TRAIN, _examples, make_tiny_model
  model = make_tiny_model()
  cfg = TRAIN.updated({"head.variant": "medusa", "head.medusa_heads": 3,
                       "steps": 3, "head.draft_vocab": 37})
  run = etrain.train(cfg, tmp_path / "run", model=model,
                     examples=_examples(), progress=False)
  init = run.setup.params
  np.testing.assert_array_equal(run.params["feature_norm"]["scale"],
                                init["feature_norm"]["scale"])
  assert not np.allclose(run.params["block_1"]["kernel"], 0.0)
  head = str(tmp_path / "run" / "head.npz")
  drafter = methods.build(model, methods.MethodSpec(
      "medusa", num_draft=3, head=head)).drafter
  assert isinstance(drafter, MedusaDrafter) and not drafter.tree_shape
  drafter = methods.build(model, methods.MethodSpec(
      "medusa", tree_shape="2x2x1", head=head)).drafter
  assert drafter.tree_shape == SHAPE_2X2X1
  for spec, why in (
      (methods.MethodSpec("medusa", num_draft=4, head=head), "3 depths"),
      (methods.MethodSpec("medusa", num_draft=3, tree_nodes=4, head=head),
       "static"),
      (methods.MethodSpec("medusa"), "no medusa head ships"),
      (methods.MethodSpec("eagle3", head=head), "use method medusa")):
    with pytest.raises(methods.MethodError, match=why):
      methods.build(model, spec)
