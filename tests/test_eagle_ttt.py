"""EAGLE-3 head and training-time test: scan == explicit loop, masks, training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax.drafters import Context
from specjax.heads.base import HeadConfig
from specjax.heads.eagle import Eagle3Head
from specjax.heads.vocab import build_draft_vocab
from specjax.models import decoder
from specjax.models import layers
from specjax.models.decoder import Decoder
from specjax.training.ttt import TTTBatch, dense_mask, target_batch, ttt_loss
from specjax.training.ttt import loss_rows

# All-different dims: D=24, N=6, G=2, H=4, F=40, V=37, Vd=29, T=11, taps 3.
CFG = HeadConfig(target_dim=24, target_vocab=37, target_layers=3,
                 taps=(0, 1, 2), num_heads=6, num_kv_heads=2, head_dim=4,
                 ffn_dim=40, draft_vocab=29)
B, T = 2, 11


def _init(seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  embed = jax.random.normal(k[0], (CFG.target_vocab, CFG.target_dim))
  taps = jax.random.normal(k[1], (B, T, 3 * CFG.target_dim))
  tok = jax.random.randint(k[2], (B, T), 0, CFG.target_vocab)
  params = Eagle3Head(CFG).init(k[3], taps, tok, embed,
                                jnp.broadcast_to(jnp.arange(T), (B, T)))
  return params["params"], embed


def _batch(seed=1):
  k = jax.random.split(jax.random.key(seed), 4)
  loss_mask = jnp.arange(T)[None, :] >= jnp.array([[3], [5]])  # ragged prompts
  return TTTBatch(
      tokens=jax.random.randint(k[0], (B, T), 0, CFG.target_vocab),
      taps=jax.random.normal(k[1], (B, T, 3 * CFG.target_dim)),
      target_logits=2 * jax.random.normal(k[2], (B, T, CFG.draft_vocab)),
      target_in_vocab=jax.random.uniform(k[3], (B, T)) < 0.8,
      loss_mask=loss_mask)


def test_dense_mask_is_the_ttt_rule():
  """Invariant: at step k, query t sees step-0 keys s <= t and, of steps
  1..k, only the key at its own position t -- nothing else."""
  for k in range(4):
    m = dense_mask(5, k)
    for t in range(5):
      for j in range(k + 1):
        for s in range(5):
          want = (s <= t) if j == 0 else (s == t)
          assert m[t, j * 5 + s] == want


def _loop_loss(params, embed, batch, K, decay=0.8, stop_feedback=False):
  """Reference: explicit Python loop, keys of all steps concatenated and one
  dense mask, inputs shifted by slicing (independent of the scan's code)."""
  head = Eagle3Head(CFG)
  call = lambda m, *a: head.apply({"params": params}, *a, method=m)
  shift = lambda a, s: jnp.concatenate(
      [a[:, s:], jnp.zeros((B, s) + a.shape[2:], a.dtype)], axis=1)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  h = call("features", batch.taps)
  ks, vs, total, accs = [], [], 0.0, []
  for k in range(K):
    tok = shift(batch.tokens, 1 + k)
    tgt = shift(batch.target_logits, 1 + k)
    w = (shift(batch.loss_mask, 2 + k) & shift(batch.target_in_vocab, 1 + k)
         ).astype(jnp.float32)
    q, kk, vv, resid = call("project", tok, h, embed, pos + k)
    ks.append(kk)
    vs.append(vv)
    # Decoding's attention over every step's keys side by side.
    k_BSGH, v_BSGH = jnp.concatenate(ks, 1), jnp.concatenate(vs, 1)
    mask = jnp.repeat(jnp.broadcast_to(dense_mask(T, k), (B, T, (k + 1) * T)),
                      CFG.num_heads // CFG.num_kv_heads, axis=1)
    attn = layers.attention(q, k_BSGH.transpose(0, 2, 3, 1),
                           v_BSGH.transpose(0, 2, 1, 3), mask)
    out = call("finish", resid, attn)
    logits = call("logits", out)
    ce = -jnp.sum(jax.nn.softmax(tgt) * jax.nn.log_softmax(logits), -1)
    n = jnp.maximum(w.sum(), 1.0)
    total = total + decay ** k * (w * ce).sum() / n
    accs.append((w * (logits.argmax(-1) == tgt.argmax(-1))).sum() / n)
    h = jax.lax.stop_gradient(out) if stop_feedback else out
  return total, jnp.stack(accs)


@pytest.mark.long
@pytest.mark.parametrize("K,fused,bucket", [(1, True, None), (7, True, None),
                                            (3, False, None), (7, True, 5)])
def test_scan_equals_explicit_loop(K, fused, bucket):
  """Invariants: the scan-unrolled TTT loss, its per-step accuracies and its
  gradients equal the explicit loop reference (f32, rtol 1e-5), with the
  fused LM-head + soft-CE custom VJP, with plain autodiff, and with the LM
  head run on only the gathered assistant rows (``loss_rows``: 15 of 22
  here, with the zero-weight padding rows a bucket of 5 adds)."""
  params, embed = _init()
  batch = _batch()
  rows = None if bucket is None else loss_rows(batch.loss_mask, bucket)
  assert rows in (None, 15)
  (loss, m), g = jax.value_and_grad(
      lambda p: ttt_loss(p, CFG, embed, batch, K, fused=fused, rows=rows),
      has_aux=True)(params)
  (ref, acc), g_ref = jax.value_and_grad(
      lambda p: _loop_loss(p, embed, batch, K), has_aux=True)(params)
  np.testing.assert_allclose(loss, ref, rtol=1e-5)
  np.testing.assert_allclose(m["acc"], acc, rtol=1e-6)
  assert m["loss"].shape == (K,) and float(m["count"][0]) > 0
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.long
def test_gradients_flow_through_fed_back_features():
  """Invariant: the loss of later steps backpropagates through the head's
  own fed-back output (the point of TTT): cutting that path changes the
  gradient, and the scan's gradient is the uncut one."""
  params, embed = _init()
  batch = _batch()
  g = jax.grad(lambda p: ttt_loss(p, CFG, embed, batch, 3)[0])(params)
  g_cut = jax.grad(lambda p: _loop_loss(p, embed, batch, 3,
                                        stop_feedback=True)[0])(params)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(g), jax.tree.leaves(g_cut)))
  assert diff > 1e-4


def test_draft_vocab_keeps_the_most_frequent_and_forced_ids():
  """Invariant: the Vd most frequent ids (ties by id) plus forced ones,
  sorted, with a matching membership mask."""
  v = build_draft_vocab([[5, 5, 5, 2, 2, 9], [9, 9, 1]], 12, 3, always=(11,))
  np.testing.assert_array_equal(v.ids, [5, 9, 11])
  assert v.in_vocab.sum() == 3 and v.in_vocab[[5, 9, 11]].all()
  with pytest.raises(ValueError, match="draft vocab size"):
    build_draft_vocab([], 12, 13)


def test_head_config_must_fit_the_target():
  """Invariant: a head trained for another target is refused by name."""
  import dataclasses
  from specjax.models.config import ModelConfig
  target = ModelConfig(vocab_size=37, dim=24, num_layers=3, num_heads=6,
                       num_kv_heads=2, head_dim=4, ffn_dim=40)
  CFG.check_fits(target)
  for field, msg in (("dim", "hidden size 24"), ("vocab_size", "vocab 37"),
                     ("num_layers", "layer count 3")):
    bad = dataclasses.replace(target, **{field: getattr(target, field) + 1})
    with pytest.raises(ValueError, match=msg):
      CFG.check_fits(bad)


def _split_layout(params):
  """A head's parameters in format 1's layout (the split kernels HF and the
  EAGLE reference code store)."""
  from specjax.models.decoder import split_qkv
  p = dict(params)
  lay = p.pop("layer")
  wq, wk, wv = split_qkv(lay["wqkv"], CFG.num_kv_heads, CFG.head_dim)
  gate, up = layers.split_gate_up(lay["w_gate_up"])
  p.update({n: {"kernel": w} for n, w in dict(
      wq=wq, wk=wk, wv=wv, wo=lay["wo"], w_gate=gate, w_up=up,
      w_down=lay["w_down"]).items()})
  p["mlp_norm"] = {"scale": lay["mlp_norm"]}
  return p


def test_head_layer_is_the_eagle3_layer_and_old_files_load(tmp_path):
  """Invariants: the head (the decoder's layer in its fused layout) computes
  the EAGLE-3 layer written out here from its definition on the split
  kernels -- z = [in_norm(e), hidden_norm(h)], causal GQA attention with
  RoPE, residual on h, SwiGLU, norm, LM head -- and a format-1 file (split
  kernels: the shipped heads) loads to exactly the same parameters."""
  import json
  from specjax.heads.export import load_head, save_head
  params, embed = _init()
  params = jax.tree.map(lambda x: x * 1.3 + 0.1 if x.ndim == 1 else x, params)
  sp = _split_layout(params)
  k = jax.random.split(jax.random.key(5), 2)
  taps = jax.random.normal(k[0], (B, T, 3 * CFG.target_dim))
  tok = jax.random.randint(k[1], (B, T), 0, CFG.target_vocab)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  got = Eagle3Head(CFG).apply({"params": params}, taps, tok, embed, pos)

  # The reference, in NumPy (f64) on the split kernels.
  w = {n: np.asarray(v.get("kernel", v.get("scale")), np.float64)
       for n, v in sp.items()}
  taps, tok, e_VD = np.asarray(taps, np.float64), np.asarray(tok), np.asarray(
      embed, np.float64)

  def norm(x, scale):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + CFG.norm_eps) * scale

  N, G, H = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
  h = taps @ w["fc"]
  z = np.concatenate([norm(e_VD[tok], w["in_norm"]),
                      norm(h, w["hidden_norm"])], -1)
  inv = 1.0 / CFG.rope_theta ** (np.arange(H // 2) * 2 / H)
  ang = np.arange(T)[:, None] * inv[None, :]
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

  def rot(x):
    x1, x2 = x[..., :H // 2], x[..., H // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

  q = rot((z @ w["wq"]).reshape(B, T, N, H))
  kk = np.repeat(rot((z @ w["wk"]).reshape(B, T, G, H)), N // G, axis=2)
  v = np.repeat((z @ w["wv"]).reshape(B, T, G, H), N // G, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(H)
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  a = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)
  r = h + a.reshape(B, T, N * H) @ w["wo"]
  x = norm(r, w["mlp_norm"])
  g = x @ w["w_gate"]
  out = r + (g / (1 + np.exp(-g)) * (x @ w["w_up"])) @ w["w_down"]
  want = norm(out, w["norm"]) @ w["lm_head"]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

  path = tmp_path / "old.npz"
  save_head(path, CFG, sp, np.arange(CFG.draft_vocab), dtype=jnp.float32)
  with np.load(path) as z:
    files = {k: z[k] for k in z.files}
  meta = json.loads(bytes(files.pop("meta")).decode())
  meta["format"] = 1
  np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
           **files)
  _, loaded, _ = load_head(path)
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  meta["format"] = 3
  np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
           **files)
  with pytest.raises(ValueError, match="has format 3"):
    load_head(path)


def greedy_batch(tparams, tcfg, hcfg, vocab, prompts, outputs) -> TTTBatch:
  """A training batch of the target's own greedy continuations (prompt +
  output per row, right-padded; the loss on the outputs only)."""
  seqs = [p + o for p, o in zip(prompts, outputs)]
  T = max(map(len, seqs))
  tokens = jnp.asarray([s + [0] * (T - len(s)) for s in seqs], jnp.int32)
  mask = jnp.asarray([[len(p) <= t < len(s) for t in range(T)]
                      for p, s in zip(prompts, seqs)])
  return target_batch(tparams, Decoder(tcfg), hcfg, vocab, tokens, mask)


def greedy_decode(tparams, target, prompts, max_new: int = 24):
  """``run(dcfg, drafter_params=None) -> (new tokens per row, state)``:
  ``engine.generate_jit`` of ``target`` (a ``Target``) on the ragged batch
  ``prompts`` (seed 0)."""
  from specjax.core import bucketing, engine
  prompt_BT, lengths = bucketing.pad_prompts(prompts)

  def run(dcfg, dparams=None):
    st = engine.generate_jit(tparams, prompt_BT, lengths, jax.random.key(0),
                             np.int32(max_new), target=target, dcfg=dcfg,
                             drafter_params=dparams)
    return [st.tokens[b, lengths[b]:st.num_tokens[b]].tolist()
            for b in range(len(prompts))], st
  return run


def overfit(loss_fn, head, lr: float, steps: int):
  """Adam on ``loss_fn(head) -> (loss, metrics)``: ``(head, (loss, metrics)
  at the first step, (loss, metrics) at the last)``."""
  opt = optax.adam(lr)

  @jax.jit
  def fit(head, opt_state):
    (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(head)
    upd, opt_state = opt.update(g, opt_state, head)
    return optax.apply_updates(head, upd), opt_state, (loss, m)

  head, opt_state, first = fit(head, opt.init(head))
  for _ in range(steps):
    head, opt_state, last = fit(head, opt_state)
  return head, first, last


@pytest.mark.long
@pytest.mark.parametrize("variant", ["eagle3", "eagle1", "mtp"])
def test_eagle_chain_drafting_greedy_identity(tmp_path, variant):
  """Invariants with an untrained head on a tiny target, ragged batch, for
  EAGLE-3, EAGLE-1 and MTP heads: (1) T = 0 speculative output equals AR token
  for token -- the head's features, pending pairs and cache rollback cannot
  change what is emitted; (2) the drafter's stable cache length tracks the
  committed tokens; (3) a tiny-budget overfit with ``ttt_loss`` on the
  target's own greedy text halves the loss's gap above its floor (the target
  entropy) and raises the step-0 and step-1 accuracy by > 0.2; (4) the
  over-fitted head then gets most drafts accepted (training and drafting
  pair features, tokens and positions the same way). (1) and (4) hold for
  EAGLE-2 dynamic trees too (width 3 cut to 7 nodes; width 2, all 10
  candidates) and for the static tree 2x2x1: the tree's head blocks,
  ancestor masks and the features gathered along the accepted path."""
  from specjax.core import engine
  from specjax.drafters.eagle import EagleDrafter, EagleParams
  from specjax.training.train import init_head
  from specjax import testing
  tcfg, tparams = testing.tiny("llama_gqa_tied", seed=3)
  taps = (0, 1, 2) if variant == "eagle3" else (3,)
  hcfg = HeadConfig.for_target(tcfg, 37, variant=variant, taps=taps)
  vocab = build_draft_vocab([np.arange(37)], 37, 37)
  head = init_head(jax.random.key(0), hcfg, Decoder(tcfg), tparams, vocab)
  prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 1, 9], [3, 4, 3, 4, 3, 4, 3, 4, 3, 4],
             [20]]
  run = greedy_decode(tparams, Decoder(tcfg), prompts)
  ar, _ = run(engine.DecodeConfig(capacity=64))
  k = 3
  dparams = EagleParams(head=head, draft_ids=jnp.asarray(vocab.ids),
                         embed=tparams.embed)
  spec, st = run(engine.DecodeConfig(capacity=64,
                                     drafter=EagleDrafter(hcfg),
                                     num_draft=k), dparams)
  assert spec == ar
  num = np.asarray(st.num_tokens)
  stable = np.asarray(st.drafter_state.lengths)
  assert ((stable <= num - 1) & (stable >= num - 2 - k)).all()
  # EAGLE-2 dynamic trees: 7 of 21 candidates kept, or all 10 (padded).
  tree_cfg = lambda width, nodes: engine.DecodeConfig(
      capacity=64, drafter=EagleDrafter(hcfg, tree_width=width), num_draft=k,
      tree_nodes=nodes)
  assert run(tree_cfg(3, 7), dparams)[0] == ar
  static_cfg = engine.DecodeConfig(
      capacity=64, drafter=EagleDrafter(hcfg, tree_shape=SHAPE_2X2X1),
      num_draft=k, tree_nodes=len(SHAPE_2X2X1) - 1)
  assert run(static_cfg, dparams)[0] == ar

  # Overfit the head on the target's own greedy continuations: if training
  # and drafting paired features, tokens and positions differently, drafts
  # would still be rejected.
  batch = greedy_batch(tparams, tcfg, hcfg, vocab, prompts, ar)
  mask, T = batch.loss_mask, batch.tokens.shape[1]
  head, (loss0, m0), (loss, m) = overfit(
      lambda p: ttt_loss(p, hcfg, tparams.embed, batch, k), head, 3e-3, 150)
  if variant != "eagle1":  # soft CE cannot go below the target's entropy
    floor = 0.0
    for j in range(k):
      p = jax.nn.softmax(jnp.concatenate(
          [batch.target_logits[:, 1 + j:],
           jnp.zeros((4, 1 + j, 37), jnp.float32)], 1))
      w = jnp.concatenate([mask[:, 2 + j:] & batch.target_in_vocab[:, 1 + j:
                                                                    T - 1],
                           jnp.zeros((4, 2 + j), bool)], 1)
      ent = -jnp.sum(p * jnp.log(p + 1e-30), -1)
      floor += 0.8 ** j * float(jnp.sum(w * ent) / jnp.maximum(w.sum(), 1))
    assert float(loss) - floor < 0.5 * (float(loss0) - floor)
  else:
    assert float(loss) < 0.5 * float(loss0)
  assert float(m["acc"][0]) > float(m0["acc"][0]) + 0.2
  assert float(m["acc"][1]) > float(m0["acc"][1]) + 0.2
  trained, st = run(engine.DecodeConfig(capacity=64,
                                        drafter=EagleDrafter(hcfg),
                                        num_draft=k),
                    dparams.replace(head=head))
  assert trained == ar
  acc = np.asarray(st.accepted_at).sum(0) / np.asarray(st.num_forwards).sum()
  assert acc[0] > 0.8 and acc[k - 1] > 0.5, acc
  for dcfg in (tree_cfg(2, 12), static_cfg):
    tree, st = run(dcfg, dparams.replace(head=head))
    assert tree == ar
    acc = (np.asarray(st.accepted_at).sum(0)
           / np.asarray(st.num_forwards).sum())
    assert acc[0] > 0.8 and acc[k - 1] > 0.5, acc


SHAPE_2X2X1 = (0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6)  # tree.parse_shape("2x2x1")


@pytest.mark.long
@pytest.mark.parametrize("variant", ["eagle3", "eagle1", "mtp"])
def test_static_trees_match_dynamic_and_chain_drafts(tmp_path, variant):
  """Invariants, on a tiny target with an untrained head after a ragged
  prefill: the static tree 2x2 is the dynamic tree of width 2 keeping all 6
  candidates, node for node (same tokens and parents: the root's two best,
  then each one's two best); the static spine 1x1x1 drafts the greedy
  chain's 3 tokens, and a 4-deep spine writes the head entries a chain
  writes (positions, scratch slots and visibility of static levels agree
  with the chain's); a shape deeper than K is refused."""
  from specjax.core import bucketing, engine, tree
  from specjax.core.sampling import SamplingParams
  from specjax.drafters.eagle import EagleDrafter, EagleParams
  from specjax.heads.base import HeadConfig as HC
  from specjax.training.train import init_head
  from specjax import testing
  assert tuple(tree.parse_shape("2x2x1")) == SHAPE_2X2X1
  tcfg, tparams = testing.tiny("llama_gqa_tied", seed=3)
  hcfg = HC.for_target(tcfg, 37, variant=variant,
                       taps=(0, 1, 2) if variant == "eagle3" else (3,))
  vocab = build_draft_vocab([np.arange(37)], 37, 37)
  dparams = EagleParams(head=init_head(jax.random.key(1), hcfg, Decoder(tcfg), tparams,
                                       vocab),
                        draft_ids=jnp.asarray(vocab.ids), embed=tparams.embed)
  prompt_BT, lengths = bucketing.pad_prompts([[5, 6, 7, 8, 5], [9, 1]])

  def propose(drafter, k, nodes):
    dcfg = engine.DecodeConfig(capacity=64, drafter=drafter, num_draft=k,
                               tree_nodes=nodes)
    st = engine.prefill(tparams, prompt_BT, lengths, jax.random.key(0), 8,
                        target=Decoder(tcfg), dcfg=dcfg, drafter_params=dparams)
    args = (dparams, st.drafter_state, st.context, jax.random.key(1), k)
    if nodes:
      return drafter.propose_tree(*args, nodes, SamplingParams())
    return drafter.propose(*args, SamplingParams())

  static = propose(EagleDrafter(hcfg, tree_shape=tuple(tree.parse_shape(
      "2x2"))), 2, 6).tree
  dynamic = propose(EagleDrafter(hcfg, tree_width=2), 2, 6).tree
  np.testing.assert_array_equal(static.tokens, dynamic.tokens)
  np.testing.assert_array_equal(static.parents, dynamic.parents)
  assert bool(jnp.all(dynamic.valid))
  spine = propose(EagleDrafter(hcfg, tree_shape=(0, 0, 1, 2)), 3, 3)
  chain = propose(EagleDrafter(hcfg), 3, 0)
  np.testing.assert_array_equal(spine.tree.tokens[:, 1:], chain.tokens)
  # A 4-deep spine's head entries (scratch slots stable .. stable + 2, one
  # per static level) equal feeding its first three drafts to the head one
  # at a time, as the chain does: keys carry the positions, values the
  # features fed along, which depend on what each node saw.
  drafter = EagleDrafter(hcfg, tree_shape=(0, 0, 1, 2, 3))
  dcfg = engine.DecodeConfig(capacity=64, drafter=drafter, num_draft=4,
                             tree_nodes=4)
  st = engine.prefill(tparams, prompt_BT, lengths, jax.random.key(0), 8,
                      target=Decoder(tcfg), dcfg=dcfg, drafter_params=dparams)
  state, stable, a = drafter._start(dparams, st.drafter_state, st.context, 4)
  root = st.context.newest()
  spine_tree, static_state = drafter._expand_static(
      dparams, state, stable, a, root, tree.Shape(drafter.tree_shape))
  seq, feat = state.with_lengths(stable), a
  for d in (1, 2, 3):
    out, seq = drafter._run(dparams, seq, spine_tree.tokens[:, d:d + 1],
                            feat[:, None])
    seq, feat = seq.with_lengths(seq.lengths + 1), out[:, 0]
  for b in range(2):
    slots = np.arange(int(stable[b]), int(stable[b]) + 3)
    for name, slot_axis in (("k", -1), ("v", -2)):  # [G, H, S], [G, S, H]
      got, want = (np.take(np.asarray(getattr(s.cache, name)[0][b]), slots,
                           axis=slot_axis) for s in (static_state, seq))
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="depth 3"):
    propose(EagleDrafter(hcfg, tree_shape=(0, 0, 1, 2)), 2, 3)


@pytest.mark.long
def test_leviathan_with_real_head_draft_probabilities(tmp_path):
  """Invariant: with the draft distributions an EAGLE-3 head really proposes
  from (T = 1, draft vocabulary 29 of 37 tokens: zero mass outside) and the
  tiny target's distributions, the first emitted token of 50,000 chain
  verifications follows the target (chi-square below the 99.9% critical
  value; tests/test_verify.py shows the same check failing for wrong
  verifiers)."""
  from specjax.core import verify
  from specjax.core.sampling import SamplingParams, warp
  from specjax.drafters.eagle import EagleDrafter, EagleParams
  from tests.test_verify import N, _chi2_ok, _draft
  from specjax import testing
  tcfg, tparams = testing.tiny("llama_gqa_tied", seed=3)
  vocab = build_draft_vocab([np.arange(29)], 37, 29)
  hcfg = HeadConfig.for_target(tcfg, 29, taps=(0, 1, 2))
  head = Eagle3Head(hcfg).init(
      jax.random.key(2), jnp.zeros((1, 4, 72)), jnp.zeros((1, 4), jnp.int32),
      tparams.embed, jnp.zeros((1, 4), jnp.int32))["params"]
  dparams = EagleParams(head=head, draft_ids=jnp.asarray(vocab.ids),
                         embed=tparams.embed)
  k, sampling = 3, SamplingParams(1.0)
  prompt = jnp.array([[4, 8, 15, 16, 23, 30]], jnp.int32)
  out = decoder.forward(tparams, tcfg, prompt,
                      decoder.init_cache(tcfg, 1, 16), taps=hcfg.taps)
  drafter = EagleDrafter(hcfg)
  state = drafter.init(dparams, Context(prompt, jnp.array([6])), 16, k,
                       jnp.concatenate(list(out.taps), -1))
  tokens = jnp.zeros((1, 16), jnp.int32).at[0, :7].set(
      jnp.array([4, 8, 15, 16, 23, 30, 31]))
  prop = drafter.propose(dparams, state, Context(tokens, jnp.array([7])),
                         jax.random.key(5), k, sampling)
  p_KV = np.asarray(prop.probs[0])
  assert np.allclose(p_KV.sum(-1), 1, atol=1e-5)
  assert (p_KV[:, 29:] == 0).all() and (p_KV[:, :29] > 0).all()
  full = decoder.forward(tparams, tcfg, tokens[:, :10],
                       decoder.init_cache(tcfg, 1, 16)).logits[0, 6:10]
  q_K1V = np.asarray(warp(full, sampling))
  drafts = _draft(jax.random.key(11), jnp.asarray(p_KV))
  res = jax.jit(verify.verify_chain)(
      drafts, jnp.broadcast_to(jnp.asarray(p_KV), (N,) + p_KV.shape),
      jnp.broadcast_to(jnp.asarray(q_K1V), (N, k + 1, 37)),
      jnp.full((N,), k, jnp.int32), jax.random.key(12))
  stat, crit = _chi2_ok(res.tokens[:, 0], q_K1V[0])
  assert stat < crit, (stat, crit)


@pytest.mark.long
def test_warm_layer_starts_as_the_target_layer_the_high_tap_feeds(tmp_path):
  """Invariant (the warm start): with the high tap feeding the
  target's last layer, a warm-started EAGLE-3 head over a causal sequence
  reads out exactly the target's logits (restricted to Vd), whatever tokens
  it is given -- its layer is that target layer on the tapped stream, the
  token half of q/k/v is zero, ``fc`` passes the high tap through; packed
  target weights give the same head."""
  from specjax.training.train import init_head, warm_layer
  from specjax import testing
  tcfg, tparams = testing.tiny("llama_gqa_tied", seed=3)
  hcfg = HeadConfig.for_target(tcfg, 30, taps=(0, 1, 2))
  vocab = build_draft_vocab([np.arange(37)], 37, 30)
  head = warm_layer(init_head(jax.random.key(0), hcfg, Decoder(tcfg), tparams, vocab), hcfg,
                    Decoder(tcfg), tparams)
  tok = jax.random.randint(jax.random.key(1), (2, 9), 0, 37)
  out = decoder.forward(tparams, tcfg, tok, decoder.init_cache(tcfg, 2, 16,
                                                           jnp.float32),
                      taps=(0, 1, 2))
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
  for given in (tok, jnp.zeros_like(tok)):
    logits = Eagle3Head(hcfg).apply({"params": head},
                                    jnp.concatenate(list(out.taps), -1),
                                    given, tparams.embed, pos)
    np.testing.assert_allclose(logits, out.logits[..., vocab.ids],
                               rtol=1e-4, atol=1e-4)
  packed = warm_layer(head, hcfg, Decoder(tcfg), decoder.pack_params(tparams))
  for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(head)):
    np.testing.assert_array_equal(a, b)


def _eagle_joint_first_three(tparams, tcfg, hcfg, dparams, n=60_000,
                             seed=0):
  """n rows of one prompt through the engine at T = 1 with an EAGLE-3
  drafter (K = 2, dynamic K at 0.1): the histogram of the first three
  generated tokens (the prefill's, then the first verify step's: draft
  positions 0 and 1), the target's exact joint q(t1) q(t2|t1) q(t3|t1 t2)
  and each row's drafted count."""
  from specjax.core import engine
  from specjax.core.sampling import SamplingParams
  from specjax.drafters.eagle import EagleDrafter
  prompt = [4, 8, 15, 16]
  V = tcfg.vocab_size
  dcfg = engine.DecodeConfig(capacity=16, sampling=SamplingParams(1.0),
                             drafter=EagleDrafter(hcfg, min_confidence=0.1),
                             num_draft=2)
  st = engine.generate_jit(tparams, jnp.tile(jnp.array([prompt]), (n, 1)),
                           jnp.full((n,), 4, jnp.int32), jax.random.key(seed),
                           np.int32(3), target=Decoder(tcfg), dcfg=dcfg,
                           drafter_params=dparams)
  t = np.asarray(st.tokens[:, 4:7])
  counts = np.bincount((t[:, 0] * V + t[:, 1]) * V + t[:, 2],
                       minlength=V ** 3)
  fwd = lambda seqs: jax.nn.softmax(decoder.forward(
      tparams, tcfg, seqs, decoder.init_cache(tcfg, len(seqs), 8)).logits[:, -1])
  q1 = fwd(jnp.array([prompt]))[0]
  q2 = fwd(jnp.array([prompt + [a] for a in range(V)]))
  q3 = fwd(jnp.array([prompt + [a, b] for a in range(V) for b in range(V)]))
  joint = (q1[:, None, None] * q2[:, :, None] * q3.reshape(V, V, V))
  return counts, np.asarray(joint).ravel() * n, np.asarray(st.num_drafted)


@pytest.mark.long
def test_eagle_sampling_through_the_engine_is_exact(tmp_path, monkeypatch):
  """Invariant (T = 1, 60,000 rows through the engine, EAGLE-3 head drafting
  K = 2 with dynamic K): the first three generated tokens — the second and
  third verified at draft positions 0 and 1 — follow the target's joint
  distribution (chi-square over cells expecting >= 5, the rest pooled,
  below the 99.9% critical value), and the threshold leaves some rows
  without drafts and not others. The head is untrained: its draft distributions differ from the
  target's, so both acceptance and the residual draws carry the mass.
  Mutation: dynamic K on the drawn token's own probability (the tempting
  rule) must fail."""
  from specjax.drafters import chain
  from specjax.drafters.eagle import EagleParams
  from specjax.training.train import init_head
  from tests.test_speculative import _chi2
  from specjax import testing
  tcfg, tparams = testing.tiny("llama_gqa_tied", seed=4)
  hcfg = HeadConfig.for_target(tcfg, 37, taps=(0, 1, 2))
  vocab = build_draft_vocab([np.arange(37)], 37, 37)
  dparams = EagleParams(head=init_head(jax.random.key(0), hcfg, Decoder(tcfg), tparams,
                                       vocab),
                        draft_ids=jnp.asarray(vocab.ids), embed=tparams.embed)
  counts, expected, drafted = _eagle_joint_first_three(tparams, tcfg,
                                                       hcfg, dparams)
  stat, crit = _chi2(counts, expected)
  assert stat < crit, (stat, crit)
  assert 0 < (drafted == 0).mean() < 1  # ragged: some rows drafted none

  def biased(logits_BV, probs_BV, tok_B, min_confidence):
    return probs_BV[jnp.arange(tok_B.shape[0]), tok_B] >= min_confidence

  monkeypatch.setattr(chain, "keep_drafting", biased)
  jax.clear_caches()
  counts, expected, _ = _eagle_joint_first_three(tparams, tcfg, hcfg, dparams)
  jax.clear_caches()
  stat, crit = _chi2(counts, expected)
  assert stat > crit, (stat, crit)
