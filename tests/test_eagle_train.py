"""EAGLE-3 trainer: checkpoints round-trip and an interrupted run resumes
with exactly the losses of an uninterrupted one."""

import dataclasses
import json
import pathlib
import re

import numpy as np
import pytest

from specjax.models.decoder import Decoder
from specjax.models.registry import Model
from specjax.training import data as edata
from specjax.training import train as etrain


def make_tiny_model() -> Model:
  """A random 3-layer Llama (EAGLE-3 taps {2, L//2, L-3} need L >= 3: it
  has exactly 3), EOS 36."""
  from specjax import testing
  cfg, params = testing.tiny("llama_gqa_tied", seed=4)
  return Model(target=Decoder(dataclasses.replace(cfg, eos_ids=(36,))),
               params=params, tokenizer=None)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  return make_tiny_model()


def _examples(n=10, T=12, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, 37, (n, T)).astype(np.int32)
  mask = np.arange(T)[None, :] >= rng.integers(2, 6, (n, 1))
  return edata.Examples(ids, mask, np.full((n,), T, np.int32))


CFG = etrain.TrainConfig().updated({
    "data.heldout": 2, "data.max_len": 12, "batch_size": 2, "steps": 6,
    "ttt.steps": 2, "head.draft_vocab": 30, "optim.lr": 3e-3,
    "optim.warmup": 2, "checkpoint_every": 2, "keep": 2, "log_every": 1})


@pytest.mark.long
@pytest.mark.parametrize("variant,feature_cache", [
    ("eagle3", 0), ("eagle3", 5), ("peagle", 0)])
def test_resume_after_interruption_matches_uninterrupted(tiny_model,
                                                         tmp_path, variant,
                                                         feature_cache):
  """Invariants: (1) a run stopped after step 3 (last checkpoint: step 2)
  and restarted continues from step 2 with the same per-step losses as an
  uninterrupted run (data order is a function of the step; params and
  optimizer state round-trip through orbax exactly); (2) the metrics log
  holds each step once; (3) orbax keeps only ``keep`` checkpoints. Also
  for training epochs over cached target features (5 examples), and for a
  P-EAGLE head (its COD depths drawn from the step's own key)."""
  ex = _examples()
  CFG = globals()["CFG"].updated({"data.feature_cache": feature_cache,
                                  "head.variant": variant})
  full = etrain.train(CFG, tmp_path / "a", model=tiny_model, examples=ex,
                      progress=False)
  part = etrain.train(CFG, tmp_path / "b", model=tiny_model, examples=ex,
                      stop_after=3, progress=False)
  assert sorted(part.losses) == [0, 1, 2]
  rest = etrain.train(CFG, tmp_path / "b", model=tiny_model, examples=ex,
                      progress=False)
  assert sorted(rest.losses) == [2, 3, 4, 5]  # resumed from checkpoint 2
  for s in range(6):
    got = part.losses[s] if s < 2 else rest.losses[s]
    np.testing.assert_allclose(got, full.losses[s], rtol=1e-6)
  for a, b in zip(jax_leaves(full.params), jax_leaves(rest.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  steps = [json.loads(l)["step"] for l in
           (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4, 5, 6]
  kept = sorted(int(p.name) for p in (tmp_path / "b" / "ckpt").iterdir()
                if p.name.isdigit())
  assert kept == [4, 6]
  assert full.losses[5] < full.losses[0]


@pytest.mark.long
def test_deadline_stops_with_a_checkpoint_and_resumes(tiny_model, tmp_path):
  """Invariant: a run past its deadline stops after the step in flight with
  a checkpoint at that step (unlike a kill, which loses the steps since the
  last one), logs that step, and a rerun continues with the uninterrupted
  run's losses."""
  ex = _examples()
  full = etrain.train(CFG, tmp_path / "a", model=tiny_model, examples=ex,
                      progress=False)
  cut = etrain.train(CFG, tmp_path / "b", model=tiny_model, examples=ex,
                     deadline=0.0, progress=False)
  assert cut.step == 1 and sorted(cut.losses) == [0]
  assert etrain.checkpoints(tmp_path / "b").latest_step() == 1
  rest = etrain.train(CFG, tmp_path / "b", model=tiny_model, examples=ex,
                      progress=False)
  assert sorted(rest.losses) == [1, 2, 3, 4, 5]
  for s in range(1, 6):
    np.testing.assert_allclose(rest.losses[s], full.losses[s], rtol=1e-6)
  steps = [json.loads(l)["step"] for l in
           (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.long
def test_init_head_continues_from_an_exported_head(tiny_model, tmp_path):
  """Invariants: a run started from an exported head begins at that head's
  (bf16-stored) parameters and draft vocabulary, whatever its own Vd
  setting says, and trains on from there; a head of the other variant is
  refused by name. With ``export`` the run also writes the head in the
  SpecForge and speculators layouts, and a run started from either
  directory begins at the trained (f32) parameters exactly."""
  import jax
  from specjax.heads.export import load_head
  ex = _examples()
  first = etrain.train(CFG.updated({"steps": 2,
                                    "export": "specforge,speculators"}),
                       tmp_path / "a", model=tiny_model, examples=ex,
                       progress=False)
  head = tmp_path / "a" / "head.npz"
  _, saved, ids = load_head(head)
  for fmt in ("specforge", "speculators"):
    s = etrain.setup(CFG.updated({
        "steps": 2, "head.init_head": str(tmp_path / "a" / f"head-{fmt}")}),
        model=tiny_model, examples=ex, progress=False)
    np.testing.assert_array_equal(s.vocab.ids, ids)
    jax.tree.map(np.testing.assert_array_equal, s.params,
                 jax.device_get(first.params))
  cfg = CFG.updated({"steps": 2, "head.draft_vocab": 20,
                     "head.init_head": str(head)})
  s = etrain.setup(cfg, model=tiny_model, examples=ex, progress=False)
  np.testing.assert_array_equal(s.vocab.ids, ids)
  np.testing.assert_array_equal(s.vocab.ids, first.setup.vocab.ids)
  assert s.vocab.in_vocab.sum() == 30
  for a, b in zip(jax.tree.leaves(s.params), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(a, b)
  run = etrain.train(cfg, tmp_path / "b", model=tiny_model, examples=ex,
                     progress=False)
  assert run.step == 2 and not np.allclose(run.params["fc"]["kernel"],
                                           saved["fc"]["kernel"])
  with pytest.raises(ValueError, match="is an eagle3 head; this run trains "
                     "eagle1"):
    etrain.setup(cfg.updated({"head.variant": "eagle1"}), model=tiny_model,
                 examples=ex, progress=False)
  # A P-EAGLE run warm-starts from the EAGLE-3 head: its parameters as they
  # are, a fresh mask_hidden, the placeholder the target's last token, the
  # depths it trains on recorded.
  pe = etrain.setup(cfg.updated({"head.variant": "peagle"}),
                    model=tiny_model, examples=ex, progress=False)
  assert (pe.hcfg.variant, pe.hcfg.mask_token, pe.hcfg.block_depths) == (
      "peagle", 36, cfg.ttt.steps)
  for name in saved:
    jax.tree.map(np.testing.assert_array_equal, pe.params[name], saved[name])
  assert pe.params["mask_hidden"].shape == (3 * pe.hcfg.target_dim,)


@pytest.mark.long
def test_feature_cache_equals_on_the_fly_and_resumes(tiny_model, tmp_path):
  """Invariants: (1) a float32 cache gives the batch the target gives on
  the fly (argmax-in-Vd equal; taps, and Vd logits recomputed from the
  cached hidden, to 1e-5: separately compiled programs); (2) bfloat16 keeps
  taps to one bf16 ulp (2^-7 relative); (3) a
  build killed after one batch resumes to the same files as an unbroken
  one; (4) a cache of other examples is rebuilt, never reused."""
  from specjax.heads.vocab import draft_rows
  from specjax.training import features as efeat
  from specjax.training.ttt import target_batch
  ex = _examples(n=5)
  s = etrain.setup(CFG, model=tiny_model, examples=_examples(), progress=False)
  tp, tcfg = tiny_model.params, tiny_model.config
  build = lambda d, **kw: efeat.build(tiny_model, "tiny", s.hcfg, s.vocab, ex,
                                      tmp_path / d, progress=False, **kw)
  idx = np.array([4, 1])
  want = target_batch(tp, Decoder(tcfg), s.hcfg, s.vocab, ex.ids[idx], ex.mask[idx])
  rows = draft_rows(tiny_model.target.lm_head(tp), s.vocab)
  for dtype, rtol, atol in (("float32", 1e-5, 1e-5), ("bfloat16", 2 ** -7, 0)):
    got = efeat.cached_batch(build(dtype, dtype=dtype), rows, idx, ex)
    np.testing.assert_allclose(got.taps, want.taps, rtol=rtol, atol=atol)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
    if dtype == "float32":
      np.testing.assert_allclose(got.target_logits, want.target_logits,
                                 rtol=1e-5, atol=1e-5)
      np.testing.assert_array_equal(got.target_in_vocab, want.target_in_vocab)
  build("killed", stop_after=1)
  assert not efeat.is_complete(tmp_path / "killed")
  meta = json.loads((tmp_path / "killed" / "meta.json").read_text())
  assert meta["done"] == 2  # the resume starts mid-way
  resumed = build("killed")
  full = build("bfloat16")
  assert efeat.is_complete(tmp_path / "killed")
  for a, b in zip(dataclasses.astuple(resumed), dataclasses.astuple(full)):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))
  other = dataclasses.replace(ex, ids=(ex.ids + 1) % 37)
  got = efeat.cached_batch(efeat.build(tiny_model, "tiny", s.hcfg, s.vocab,
                                       other, tmp_path / "killed",
                                       progress=False), rows, idx, other)
  np.testing.assert_allclose(
      got.taps, target_batch(tp, Decoder(tcfg), s.hcfg, s.vocab, other.ids[idx],
                             other.mask[idx]).taps, rtol=2 ** -7)


def jax_leaves(tree):
  import jax
  return jax.tree.leaves(tree)


def test_tokens_seen_counts_only_the_cached_rows():
  """Invariant: a run over cached features draws its batches from the first
  ``feature_cache`` training rows, and ``tokens_seen`` counts those (it once
  counted rows of the whole split)."""
  from specjax.training.evaluate import tokens_seen
  ex = _examples()
  ex = edata.Examples(ex.ids, ex.mask, np.arange(1, 11, dtype=np.int32))
  train_ex, _ = edata.split(ex, CFG.data.heldout, CFG.seed)
  cfg = CFG.updated({"data.feature_cache": 3})
  first3 = train_ex.lengths[:3]
  want = sum(int(first3[edata.batch_indices(i, 3, cfg.batch_size,
                                            cfg.seed)].sum())
             for i in range(4))
  assert tokens_seen(cfg, train_ex, 4) == want
  assert tokens_seen(cfg.updated({"data.feature_cache": 0}), train_ex,
                     4) != want


def test_config_paths_types_and_errors(tmp_path):
  """Invariants: a config file's overrides set fields by dotted path, typed
  by the field (ml_collections' flags); ``updated`` and ``from_dict`` do the
  same in Python; a field that does not exist, a wrong type or a bad value
  is a ValueError naming its path; a sweep's points are the file's
  overrides plus each point."""
  from specjax.training import config as tconfig
  f = tmp_path / "exp.py"
  f.write_text("from specjax.training.config import defaults\n"
               "def get_config():\n  c = defaults()\n  c.steps = 7\n"
               "  return c\n"
               "def get_sweep():\n"
               "  return [{'optim.lr': 1e-3}, {'optim.lr': 3e-3, 'seed': 2}]\n")
  loaded = tconfig.load(str(f), ["--config.optim.lr=1e-4",
                                 "--config.model", "x.gguf",
                                 "--config.data.max_len=64"])
  cfg = loaded.train
  assert (cfg.steps, cfg.optim.lr, cfg.model, cfg.data.max_len) == (
      7, 1e-4, "x.gguf", 64)
  assert CFG.updated(tconfig.flat(dataclasses.asdict(cfg))) == cfg
  assert cfg.updated({"optim.lr": 2e-4}).optim.lr == 2e-4
  assert loaded.origin["overrides"][0] == "--config.optim.lr=1e-4"
  points = tconfig.sweep(loaded, str(f))
  assert [(c.optim.lr, c.seed, c.data.max_len, c.steps)
          for _, c, _ in points] == [(1e-3, 0, 64, 7), (3e-3, 2, 64, 7)]
  assert points[1][0] == "01-optim.lr=0.003,seed=2"
  for bad, words in ((["--config.nope=1"], "no field: 'nope'"),
                     (["--config.steps=many"], "--config.steps=many"),
                     (["--config.ttt.steps=0"], "ttt.steps must be >= 1"),
                     (["--steps=1"], "Unknown command line flag 'steps'")):
    with pytest.raises(ValueError, match=re.escape(words)):
      tconfig.load(str(f), bad)
  for bad, words in (({"nope": 1}, "nope: no such field"),
                     ({"steps": "many"}, "steps: 'many' is not a int"),
                     ({"optim": 3}, "optim must be a mapping")):
    with pytest.raises(ValueError, match=re.escape(words)):
      tconfig.TrainConfig.from_dict(bad)
  with pytest.raises(ValueError, match="optim.nope: no such field"):
    CFG.updated({"optim.nope": 1})


def test_batches_are_a_function_of_the_step():
  """Invariant: batch rows depend only on (seed, step), cover each example
  once per epoch, and differ between epochs."""
  a = [edata.batch_indices(s, 7, 3, seed=1) for s in range(7)]
  b = [edata.batch_indices(s, 7, 3, seed=1) for s in range(7)]
  assert all((x == y).all() for x, y in zip(a, b))
  flat = np.concatenate(a)
  assert sorted(flat[:7]) == list(range(7))
  assert not (flat[:7] == flat[7:14]).all()


def test_conversation_mask_covers_assistant_output_only(smollm2):
  """Invariant: the ids decode to exactly the rendered chat, and the masked
  tokens decode to each assistant reply followed by its <|im_end|> -- the
  header, system prompt and user turns are context only."""
  turns = [("user", "Hi there"), ("assistant", "Hello! How can I help?"),
           ("user", "Say bye"), ("assistant", "Bye.")]
  ids, mask = edata.encode_conversation(smollm2.tokenizer, turns)
  tok = smollm2.tokenizer
  messages = [{"role": r, "content": t} for r, t in turns]
  assert tok.decode(ids) == tok.render_chat(messages, False)
  runs, cur = [], []
  for i, m in zip(ids, mask):
    if m:
      cur.append(i)
    elif cur:
      runs.append(tok.decode(cur))
      cur = []
  assert not cur  # the template's trailing newline is context
  assert runs == ["Hello! How can I help?<|im_end|>",
                                       "Bye.<|im_end|>"]


@pytest.mark.parametrize("variant", ["eagle1", "mtp"])
def test_target_copies_stay_frozen(tiny_model, tmp_path, variant):
  """Invariant: training an EAGLE-1 or MTP head leaves its copies of the
  target's final norm and LM head exactly as initialized, while the rest
  moves."""
  import jax
  from specjax.heads.base import HeadConfig
  from specjax.heads.vocab import build_draft_vocab
  cfg = CFG.updated({"head.variant": variant, "ttt.steps": 1, "steps": 3,
                     "head.draft_vocab": 37})
  run = etrain.train(cfg, tmp_path, model=tiny_model, examples=_examples(),
                     progress=False)
  tcfg, tparams = tiny_model.config, tiny_model.params
  hcfg = HeadConfig.for_target(tcfg, 37, variant=variant)
  vocab = build_draft_vocab([np.arange(37)], 37, 37)
  init = etrain.init_head(jax.random.key(cfg.seed), hcfg, tiny_model.target, tparams, vocab)
  for name in ("lm_head", "feature_norm"):
    for a, b in zip(jax.tree.leaves(run.params[name]),
                    jax.tree.leaves(init[name])):
      np.testing.assert_array_equal(a, b)
  assert not np.allclose(run.params["fc"]["kernel"], init["fc"]["kernel"])


@pytest.mark.long
def test_heldout_accuracy_ignores_batch_padding(tiny_model, tmp_path):
  """Invariants: held-out acceptance does not depend on the batch size (the
  last, wrapped batch is masked out); with Vd = the whole vocabulary every
  position is covered; expected τ of a constant α is the closed form
  (1 - α^(K+1)) / (1 - α)."""
  from specjax.measure import theory
  from specjax.training import evaluate
  cfg = CFG.updated({"data.heldout": 5, "head.draft_vocab": 37})
  s = etrain.setup(cfg, model=tiny_model, examples=_examples(n=12),
                   progress=False)
  etrain.train(cfg, tmp_path, model=tiny_model, examples=_examples(n=12),
               progress=False)
  params = etrain.restore_params(tmp_path, cfg.steps, s, cfg)
  a = evaluate.heldout_accuracy(s, params, num_steps=3, batch_size=5)
  b = evaluate.heldout_accuracy(s, params, num_steps=3, batch_size=2)
  assert a == b
  assert a["coverage"] == 1.0 and a["positions"] > 0
  assert all(0.0 <= x <= 1.0 for x in a["acc"])
  np.testing.assert_allclose(evaluate.expected_tau([0.6] * 4),
                             theory.expected_tokens(0.6, 4))


def test_regenerate_keeps_context_and_resumes(tiny_model, tmp_path,
                                              monkeypatch):
  """Invariants: (1) every row keeps its tokens before its first assistant
  token; (2) what follows is exactly the target's own greedy reply to that
  context (the runner, one row alone), masked as output; (3) a run
  interrupted after its first batch resumes from the saved batches and
  returns the same arrays as an uninterrupted one."""
  from specjax.core import runner
  from specjax.core.sampling import SamplingParams
  from specjax.training.regenerate import regenerate
  ex = _examples(n=5)
  kw = dict(max_new_tokens=6, sampling=SamplingParams(), batch_size=2,
            progress=False)
  full = regenerate(tiny_model, ex, cache_dir=tmp_path / "a", **kw)
  start = ex.mask.argmax(axis=1)
  for r, s in enumerate(start):
    reply = runner.generate_ids(tiny_model, [ex.ids[r, :s].tolist()],
                                max_new_tokens=6).rows[0].output_ids
    n = full.lengths[r]
    assert n == s + len(reply)
    np.testing.assert_array_equal(full.ids[r, :n], [*ex.ids[r, :s], *reply])
    pos = np.arange(12)
    np.testing.assert_array_equal(full.mask[r], (pos >= s) & (pos < n))

  class Killed(Exception):
    pass
  real, calls, kill_at = runner.generate_ids, [], [2]
  def flaky(*a, **k):
    calls.append(1)
    if len(calls) in kill_at:
      kill_at.clear()
      raise Killed
    return real(*a, **k)
  monkeypatch.setattr(runner, "generate_ids", flaky)
  with pytest.raises(Killed):
    regenerate(tiny_model, ex, cache_dir=tmp_path / "b", **kw)
  calls.clear()
  again = regenerate(tiny_model, ex, cache_dir=tmp_path / "b", **kw)
  assert len(calls) == 2  # 3 batches of 2 rows, the first one kept
  for a, b in zip((full.ids, full.mask, full.lengths),
                  (again.ids, again.mask, again.lengths)):
    np.testing.assert_array_equal(a, b)


def test_schedule_as_data_matches_optax_warmup_cosine():
  """Invariant: the learning rate computed from a traced run length equals
  optax's warmup-cosine schedule that the trainer used to build with the
  length baked in (so making the length data changed no run)."""
  import jax
  import jax.numpy as jnp
  import optax
  ocfg = etrain.OptimizerConfig(lr=1e-3, warmup=5, final_lr_fraction=0.1)
  lr = jax.jit(lambda c, n: etrain.lr_at(ocfg, c, n))
  for total in (3, 6, 40):
    ref = optax.warmup_cosine_decay_schedule(
        0.0, ocfg.lr, ocfg.warmup, max(total, ocfg.warmup + 1),
        end_value=ocfg.lr * ocfg.final_lr_fraction)
    for c in (0, 1, 4, 5, 6, 20, 39, 40, 60):
      np.testing.assert_allclose(lr(jnp.int32(c), jnp.int32(total)), ref(c),
                                 rtol=1e-6, atol=1e-12)


def test_a_second_run_of_another_length_reuses_the_compiled_step(
    tiny_model, tmp_path):
  """Invariant: the compiled optimizer step depends on shapes and optimizer
  settings, not on the run's length or logging: a timing probe's compile
  serves the run it sizes (gpu_kit)."""
  ex = _examples()
  etrain.train(CFG.updated({"steps": 2}), tmp_path / "probe",
               model=tiny_model, examples=ex, progress=False)
  # Other tests in this process may have compiled other programs already.
  compiled = etrain.train_step._cache_size()
  etrain.train(CFG.updated({"steps": 5, "log_every": 2,
                            "checkpoint_every": 0}),
               tmp_path / "run", model=tiny_model, examples=ex,
               progress=False)
  assert etrain.train_step._cache_size() == compiled


@pytest.mark.parametrize("mutation", [None, "no_guard"])
def test_non_finite_loss_stops_and_keeps_the_last_good_head(
    tiny_model, tmp_path, mutation, monkeypatch):
  """Invariant: the first step whose loss is not finite is not applied: the
  run ends at the step before, says why, saves no checkpoint, and the
  exported head is that step's (its parameters rounded to bf16, exactly).
  Mutation caught: without the guard (``train.applies`` always true) the
  NaN step is applied and the run goes on."""
  import jax
  import jax.numpy as jnp
  from specjax.heads.export import load_head
  if mutation:
    monkeypatch.setattr(etrain, "applies", lambda loss: True)
  n, heldout = 10, CFG.data.heldout
  bad = tiny_model.config.vocab_size  # out of range: its embedding is NaN
  ex = _examples(n)
  # The bad token appears only in a row first drawn at step 4 (index 3),
  # after three finite steps.
  train_rows = np.random.default_rng(CFG.seed).permutation(n)[heldout:]
  seen = {int(r) for s in range(3) for r in
          edata.batch_indices(s, n - heldout, CFG.batch_size, CFG.seed)}
  fresh = [int(r) for r in
           edata.batch_indices(3, n - heldout, CFG.batch_size, CFG.seed)
           if int(r) not in seen]
  ex.ids[train_rows[fresh[0]], 1] = bad  # a prompt token: not in Vd's count
  run = etrain.train(CFG, tmp_path / "w", model=tiny_model, examples=ex,
                     progress=False)
  if mutation:
    assert run.step > 3 and not run.stopped
    return
  assert run.step == 3 and sorted(run.losses) == [0, 1, 2]
  assert "non-finite loss at step 4" in run.stopped
  assert all(np.isfinite(v) for v in run.losses.values())
  assert etrain.checkpoints(tmp_path / "w").latest_step() == 2
  _, head, _ = load_head(tmp_path / "w" / "head.npz")
  for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(run.params)):
    assert np.all(np.isfinite(a))
    np.testing.assert_array_equal(
        a, np.asarray(jnp.asarray(b, jnp.bfloat16), np.float32))


def test_a_resume_with_another_config_is_refused_unless_asked_for(
    tiny_model, tmp_path):
  """Invariants: rerun in a run's workdir with fields changed that change
  what is trained, ``train`` raises ConfigChanged naming each field with
  both values before anything runs (no file in the workdir touched); the
  mesh and the bookkeeping fields may change; with ``allow_config_change``
  the run goes on under the new config, ``config.json`` holds it, and
  ``provenance.jsonl`` has one line per start (its step, the change, the
  origin given, the code's commit, the package versions)."""
  import subprocess
  import jax
  ex, w = _examples(), tmp_path / "w"
  cfg = CFG.updated({"steps": 2})
  run = lambda c, **kw: etrain.train(c, w, model=tiny_model, examples=ex,
                                     progress=False, **kw)
  run(cfg, origin=dict(config_file="exp.py", overrides=["--config.steps=2"]))
  files = {f: f.read_bytes() for f in w.rglob("*") if f.is_file()}
  with pytest.raises(etrain.ConfigChanged) as e:
    run(cfg.updated({"steps": 4, "optim.lr": 1e-3}))
  assert e.value.changes == {"steps": (2, 4), "optim.lr": (3e-3, 1e-3)}
  assert "optim.lr 0.003 -> 0.001, steps 2 -> 4" in str(e.value)
  assert {f: f.read_bytes() for f in w.rglob("*") if f.is_file()} == files
  assert etrain.config_changes(cfg.updated(dict(
      mesh="data=1", log_every=3, checkpoint_every=1, keep=1)), w) == {}
  assert run(cfg.updated({"steps": 4}),
             allow_config_change=True).step == 4
  assert json.loads((w / "config.json").read_text())["steps"] == 4
  starts = [json.loads(l) for l in
            (w / "provenance.jsonl").read_text().splitlines()]
  assert [(s["start_step"], s["changed"], s["config"]["steps"])
          for s in starts] == [(0, {}, 2), (2, {"steps": [2, 4]}, 4)]
  assert starts[0]["config_file"] == "exp.py" and "config_file" not in starts[1]
  assert starts[1]["versions"]["jax"] == jax.__version__
  root = pathlib.Path(etrain.__file__).resolve().parents[2]
  if (root / ".git").exists():
    assert starts[1]["code"]["commit"] == subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
        text=True).stdout.strip()
  else:
    assert starts[1]["code"] is None


def test_a_checkpoint_that_does_not_fit_is_named(tiny_model, tmp_path):
  """Resuming in a workdir whose checkpoint holds another head (here a
  different draft vocabulary) or a damaged one fails with one ValueError
  naming the checkpoint, before any step runs."""
  ex = _examples()
  cfg = CFG.updated({"steps": 2})
  etrain.train(cfg, tmp_path / "w", model=tiny_model, examples=ex,
               progress=False)
  other = cfg.updated({"steps": 4, "head.draft_vocab": 20})
  with pytest.raises(ValueError, match=r"checkpoint '.*w/ckpt/2' does not "
                                       r"fit this run"):
    etrain.train(other, tmp_path / "w", model=tiny_model, examples=ex,
                 progress=False, allow_config_change=True)
  for f in (tmp_path / "w" / "ckpt" / "2").rglob("*"):
    if f.is_file() and f.stat().st_size > 64:
      f.write_bytes(f.read_bytes()[:16])
  with pytest.raises(ValueError, match=r"checkpoint '.*w/ckpt/2'"):
    etrain.train(cfg.updated({"steps": 4}), tmp_path / "w",
                 model=tiny_model, examples=ex, progress=False,
                 allow_config_change=True)


def test_resume_keeps_metrics_up_to_the_checkpoint_and_moves_the_rest(
    tmp_path):
  """Invariant: resuming at step 20 keeps the metric lines up to it; the
  lines past it (to be redone) and a torn last line (a kill mid-write, which
  used to crash every resume) move to metrics.dropped.jsonl, so nothing an
  earlier run wrote is lost."""
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (10, 20, 30)]
  path.write_text("\n".join(lines) + '\n{"step": 40, "lo')
  etrain._truncate_metrics(path, 20)
  assert path.read_text().splitlines() == lines[:2]
  assert (tmp_path / "metrics.dropped.jsonl").read_text().splitlines() == [
      lines[2], '{"step": 40, "lo']
