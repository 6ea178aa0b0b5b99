"""Sampled speculative decoding through the engine follows the target exactly,
judged by a reference nobody here wrote.

The reference is transformers: its logits on a tiny random Llama (V = 16,
``tests.tiny_hf.SAMPLING_CONFIGS``) and its own warpers (temperature, then
top-k, then top-p) give the exact joint law of the first four generated
tokens. 50,000 rows of one prompt go through ``engine.generate`` at T = 0.7,
top-k 6, top-p 0.9 (both cut: the warped supports hold 2 to 6 tokens) with a
drafter at K = 2: token 1 is the prefill's sample, tokens 2 and 3 the first
verify's drafts or its correction, token 4 that verify's bonus after both
drafts were accepted, or a later step's token. The check is a chi-square
over the cells expecting >= 5 draws (the rest pooled into one cell), passing
below the 99.9% critical value; a draw outside the warped support fails
outright. Each drafter must also really have drafted, had drafts accepted
and emitted bonuses (the check is not vacuous).

Fast stage: a sampled chain whose draft vocabulary is smaller than V (an
EAGLE-3 head, Vd = 10), a deterministic chain (n-gram), a model tree (EAGLE-2
dynamic) and a static tree (the head's 2x2). Long stage: AR (the reference
agrees with specjax's sampler), the other drafters (draft model, layer-skip,
CLaSp chain and tree, lookahead, a P-EAGLE block chain and tree, Medusa
chain and tree, an MTP module's chain and dynamic tree, retrieval, the
head's tree merged with the lookup trie), PEARL with the draft model on one
device and on two device groups, and the mutations the check must catch.

The other sampling options the same way, the law from transformers'
processors (repetition penalty, sequence bias, min-p) and the OpenAI
formula for presence and frequency penalties: all at once and each alone,
an allowed-token hook, and stop sequences (the law pushed through the cut
at the first stop), with the EAGLE-3 chain and the EAGLE-2 tree.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from transformers.generation import logits_process

from specjax.core import engine
from specjax.core.sampling import RowSampling, SamplingParams
from specjax.models.decoder import Decoder
from specjax.models.hf_loader import load_hf
from tests.run_bound import generate_o1
from tests.tiny_hf import make_tiny

N = 50_000
SAMPLING = SamplingParams(0.7, top_k=6, top_p=0.9)
K = 2
NEW = 4  # tokens checked: the prefill's sample and one full verify block
VD = 10  # the EAGLE head's draft vocabulary, < V
# Every token of the vocabulary once, then a repeat: the n-gram drafter
# finds a continuation after any first token.
PROMPT = [2, 11, 3, 10, 0, 4, 7, 5, 14, 12, 6, 9, 13, 8, 1, 15, 2, 11, 3, 10,
          0]


def no_repeat_no_five(tokens_BS, num_tokens_B, prompt_lengths_B):
  """An allowed-token hook: never the context's last token again, never
  token 5."""
  last_B = jnp.take_along_axis(tokens_BS, (num_tokens_B - 1)[:, None], 1)
  v_1V = jnp.arange(16)[None, :]
  return (v_1V != last_B) & (v_1V != 5)


def _reference_warp(logits, sp, ids, num_generated, hook=False):
  """transformers' processors and warpers, in the order generate applies
  them, with presence and frequency penalties (which transformers lacks)
  as the OpenAI API documents them: ``logit -= frequency * count +
  presence * (count > 0)`` over the generated tokens, and (``hook``)
  ``no_repeat_no_five`` written out here. ``ids``: ``[N, T]`` each row's
  context, its last ``num_generated`` tokens generated."""
  scores = torch.as_tensor(logits, dtype=torch.float32)
  ids = torch.as_tensor(ids, dtype=torch.long)
  if sp.repetition_penalty != 1:
    scores = logits_process.RepetitionPenaltyLogitsProcessor(
        sp.repetition_penalty)(ids, scores)
  if num_generated:
    counts = torch.nn.functional.one_hot(
        ids[:, -num_generated:], scores.shape[-1]).sum(1).float()
    scores = (scores - sp.frequency_penalty * counts
              - sp.presence_penalty * (counts > 0).float())
  if sp.logit_bias:
    scores = logits_process.SequenceBiasLogitsProcessor(
        {(t,): b for t, b in sp.logit_bias})(ids, scores)
  if hook:
    banned = torch.nn.functional.one_hot(ids[:, -1], scores.shape[-1]).bool()
    banned[:, 5] = True
    scores = scores.masked_fill(banned, -float("inf"))
  warpers = [logits_process.TemperatureLogitsWarper(sp.temperature)]
  if sp.top_k:
    warpers.append(logits_process.TopKLogitsWarper(sp.top_k))
  if sp.top_p < 1:
    warpers.append(logits_process.TopPLogitsWarper(sp.top_p))
  if sp.min_p:
    warpers.append(logits_process.MinPLogitsWarper(sp.min_p))
  for warper in warpers:
    scores = warper(ids, scores)
  return torch.softmax(scores.double(), -1).numpy()


def _joint_law(logits, sp, hook=False):
  """``expected[a, b, c, d]``: the probability that the first four
  generated tokens are a, b, c, d, from ``logits[a, b, c, t]`` (position t
  after the prompt and the first t of a, b, c)."""
  V = logits.shape[-1]
  grid = np.stack(np.meshgrid(*[np.arange(V)] * 3, indexing="ij"),
                  -1).reshape(-1, 3)
  q = np.stack([_reference_warp(
      logits[:, :, :, t].reshape(-1, V), sp,
      np.concatenate([np.tile(PROMPT, (V ** 3, 1)), grid[:, :t]], 1), t,
      hook) for t in range(4)], 1).reshape(V, V, V, 4, V)
  return (q[0, 0, 0, 0][:, None, None, None]
          * q[:, 0, 0, 1][:, :, None, None]
          * q[:, :, 0, 2][:, :, :, None]
          * q[:, :, :, 3])


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  """(config, params, expected, logits): ``expected`` the joint law of
  the first four generated tokens under ``SAMPLING`` (``_joint_law``) and
  ``logits[a, b, c, t]`` transformers' after the prompt and every three
  tokens (one forward over each)."""
  d = tmp_path_factory.mktemp("v16")
  model = make_tiny("llama_v16", d, seed=0)
  cfg, params = load_hf(d)
  V, L = cfg.vocab_size, len(PROMPT)
  grid = np.stack(np.meshgrid(*[np.arange(V)] * 3, indexing="ij"), -1)
  seqs = np.concatenate([np.tile(PROMPT, (V ** 3, 1)),
                         grid.reshape(-1, 3)], 1)
  with torch.no_grad():
    logits = model(torch.as_tensor(seqs)).logits[:, L - 1:].numpy()
  logits = logits.reshape(V, V, V, 4, V)
  return cfg, params, _joint_law(logits, SAMPLING), logits


def generate(target, drafter=None, drafter_params=None, seed=0,
             sampling=SAMPLING, rows=None, check_len=True,
             run=generate_o1, **kw):
  """The first NEW generated tokens of N rows as one cell index each, and
  the final state (``run``: the engine's ``generate`` jitted, or another
  loop's with its signature)."""
  cfg, params = target[:2]
  L, V = len(PROMPT), cfg.vocab_size
  dcfg = engine.DecodeConfig(capacity=32, sampling=sampling, drafter=drafter,
                             num_draft=K if drafter else 0, **kw)
  st = run(params, jnp.tile(jnp.asarray([PROMPT], jnp.int32), (N, 1)),
           jnp.full((N,), L, jnp.int32), jax.random.key(seed),
           np.int32(NEW), target=Decoder(cfg), dcfg=dcfg,
           drafter_params=drafter_params, sampling=rows)
  if check_len:
    assert (np.asarray(st.num_tokens) == L + NEW).all()
  tokens = np.asarray(st.tokens[:, L:L + NEW])
  return np.ravel_multi_index(tokens.T, (V,) * NEW), st


def chi_square(cells, expected):
  """(statistic, 99.9% critical value) over the cells expecting >= 5 draws,
  the rest pooled; inf when a draw lands where the target has no mass."""
  counts = np.bincount(cells, minlength=expected.size)
  exp = expected.ravel() * cells.size
  if counts[exp == 0].any():
    return np.inf, 0.0
  big = exp >= 5
  obs, exp_ = counts[big], exp[big]
  if (~big & (exp > 0)).any():
    obs = np.append(obs, counts[~big].sum())
    exp_ = np.append(exp_, exp[~big].sum())
  stat = ((obs - exp_) ** 2 / exp_).sum()
  return stat, scipy.stats.chi2.ppf(0.999, len(obs) - 1)


def _head(target, variant="eagle3", **overrides):
  """An untrained head over the VD most frequent ids of a random stream
  (ids outside it are never drafted), warm-started from the target."""
  from specjax.heads.base import HeadConfig
  from specjax.heads.vocab import build_draft_vocab
  from specjax.training.train import init_head
  cfg, params = target[:2]
  V = cfg.vocab_size
  taps = (dict(taps=(0, 1, 2)) if variant in ("eagle3", "peagle")
          else {})  # L = 2
  hcfg = HeadConfig.for_target(cfg, VD, variant=variant, **taps, **overrides)
  stream = np.random.default_rng(1).zipf(1.5, 400) % V
  vocab = build_draft_vocab([stream], V, hcfg.draft_vocab)
  head = init_head(jax.random.key(2), hcfg, Decoder(cfg), params, vocab)
  return hcfg, head, jnp.asarray(vocab.ids)


def _eagle(target, variant="eagle3", **overrides):
  from specjax.drafters.eagle import EagleParams
  hcfg, head, ids = _head(target, variant, **overrides)
  cfg, params = target[:2]
  return hcfg, EagleParams(head=head, draft_ids=ids,
                           embed=Decoder(cfg).embedding(params))


def fast_drafters(target):
  """{name: (drafter, drafter params, DecodeConfig kwargs)}."""
  from specjax.core import tree
  from specjax.drafters import LookaheadDrafter, NGramDrafter
  from specjax.drafters.eagle import EagleDrafter
  hcfg, eagle = _eagle(target)
  pcfg, peagle = _eagle(target, "peagle", mask_token=15)
  return {
      "peagle_block_chain": (EagleDrafter(pcfg), peagle, {}),
      "peagle_block_tree": (EagleDrafter(pcfg, tree_width=2), peagle,
                            dict(tree_nodes=4)),
      "peagle_pearl": (EagleDrafter(pcfg), peagle, dict(pearl=True)),
      "lookahead_trie": (LookaheadDrafter(window=3, width=2), None,
                         dict(tree_nodes=4)),
      "eagle3_chain_small_vocab": (EagleDrafter(hcfg), eagle, {}),
      "ngram_chain": (NGramDrafter(), None, {}),
      "eagle2_dynamic_tree": (EagleDrafter(hcfg, tree_width=2), eagle,
                              dict(tree_nodes=4)),
      "eagle_static_tree_2x2": (EagleDrafter(hcfg, tree_shape=tuple(
          tree.parse_shape("2x2"))), eagle, dict(tree_nodes=6)),
  }


def long_drafters(target, tmp_path_factory):
  from specjax.core import tree
  from specjax.drafters import (ClaspDrafter, DraftModelDrafter,
                                LayerSkipDrafter, LookupDrafter,
                                RetrievalDrafter)
  from specjax.drafters.eagle import EagleDrafter, EagleParams
  from specjax.drafters.medusa import MedusaDrafter, MedusaParams
  from specjax.drafters.retrieval import build_datastore
  from specjax.drafters.union import TreeUnion, UnionParams
  cfg, params = target[:2]
  d = tmp_path_factory.mktemp("v16_draft")
  make_tiny("llama_v16", d, seed=1)
  draft_cfg, draft_params = load_hf(d)
  mcfg, mhead, ids = _head(target, "medusa", medusa_heads=K)
  medusa = MedusaParams(head=mhead, draft_ids=ids)
  rng = np.random.default_rng(3)
  store = jax.device_put(build_datastore(
      [PROMPT + rng.integers(0, cfg.vocab_size, 12).tolist()
       for _ in range(20)], num_slots=1024))
  hcfg, eagle = _eagle(target)
  tcfg, thead, tids = _head(target, "mtp")
  mtp = EagleParams(head=thead, draft_ids=tids,
                    embed=Decoder(cfg).embedding(params))
  return {
      "mtp_chain": (EagleDrafter(tcfg), mtp, {}),
      "mtp_dynamic_tree": (EagleDrafter(tcfg, tree_width=2), mtp,
                           dict(tree_nodes=4)),
      "draft_model_chain": (DraftModelDrafter(Decoder(draft_cfg)),
                            draft_params, {}),
      "layer_skip_chain": (LayerSkipDrafter.from_target(Decoder(cfg), 1),
                           params, {}),
      "clasp_chain": (ClaspDrafter.from_target(Decoder(cfg), 1), params, {}),
      "clasp_tree": (ClaspDrafter.from_target(Decoder(cfg), 1, tree_width=2),
                     params, dict(tree_nodes=4)),
      "medusa_chain": (MedusaDrafter(mcfg), medusa, {}),
      "medusa_static_tree_2x2": (MedusaDrafter(mcfg, tree_shape=tuple(
          tree.parse_shape("2x2"))), medusa, dict(tree_nodes=6)),
      "retrieval_trie": (RetrievalDrafter(), store, dict(tree_nodes=4)),
      "eagle_tree_with_lookup_trie": (
          TreeUnion(EagleDrafter(hcfg, tree_width=2), LookupDrafter(), 2),
          UnionParams(head=eagle, table=store), dict(tree_nodes=5)),
  }


def _check(target, drafter, dparams, kw, sampling=SAMPLING, expected=None):
  cells, st = generate(target, drafter, dparams, sampling=sampling, **kw)
  stat, crit = chi_square(cells, target[2] if expected is None else expected)
  assert stat < crit, (stat, crit)
  accepted = np.asarray(st.accepted_at)  # [N, K]: accepted at each depth
  assert (np.asarray(st.num_drafted) > 0).mean() > 0.9
  assert (accepted[:, K - 1] > 0).mean() > 0.002, accepted.mean(0)
  return st


@pytest.mark.long
def test_plain_sampling_is_the_reference(target):
  """Invariant: AR decoding under the same warping passes the same check
  (the reference and the check agree with specjax's sampler)."""
  cells, _ = generate(target)
  stat, crit = chi_square(cells, target[2])
  assert stat < crit, (stat, crit)


@pytest.mark.parametrize("name", [
    "eagle3_chain_small_vocab", "ngram_chain", "eagle2_dynamic_tree",
    # verify_tree as the dynamic tree; its own case is in the long stage.
    pytest.param("eagle_static_tree_2x2", marks=pytest.mark.long),
    pytest.param("peagle_block_chain", marks=pytest.mark.long),
    pytest.param("peagle_block_tree", marks=pytest.mark.long),
    pytest.param("peagle_pearl", marks=pytest.mark.long)])
def test_fast_drafters_sample_the_target_exactly(target, name):
  """Invariant: each drafter's first four generated tokens follow
  transformers' warped joint law (module doc)."""
  _check(target, *fast_drafters(target)[name])


@pytest.mark.long
def test_lookahead_samples_the_target_exactly(target):
  """Invariant: lookahead's trie (the context's continuations and the
  target's own Jacobi n-grams, its window scored in the same forward)
  follows the law; the window's n-grams depend only on earlier steps."""
  _check(target, *fast_drafters(target)["lookahead_trie"])


@pytest.mark.long
@pytest.mark.parametrize("name", ["draft_model_chain", "layer_skip_chain",
                                  "clasp_chain", "clasp_tree",
                                  "medusa_chain", "medusa_static_tree_2x2",
                                  "retrieval_trie",
                                  "eagle_tree_with_lookup_trie", "mtp_chain",
                                  "mtp_dynamic_tree"])
def test_other_drafters_sample_the_target_exactly(target, name,
                                                  tmp_path_factory):
  """Invariant: as the fast test, for every other kind of drafter."""
  _check(target, *long_drafters(target, tmp_path_factory)[name])


def _first_new_draft_tested_a_position_early(monkeypatch):
  """PEARL tests its first new draft against the logits of the position
  before its own (the last pending draft's)."""
  from specjax.core import pearl
  tested_at = pearl._tested_at
  monkeypatch.setattr(pearl, "_tested_at", lambda length_B, first_B, K: (
      tested_at(jnp.where(first_B, jnp.maximum(length_B - 1, 1), length_B),
                first_B, K)))


@pytest.mark.long
@pytest.mark.parametrize("mutation", [None, "first_new_draft_tested_early"])
def test_pearl_samples_the_target_exactly(target, mutation, monkeypatch,
                                          tmp_path_factory):
  """Invariant: PEARL (``core.pearl``) with the draft model at K = 2
  follows the law: its pending draft tested a step after it was drawn, its
  first new draft at the bonus position, and both modes within the four
  tokens (counted). Mutation check: it FAILS when the first new draft is
  tested at the position before its own. (Drafts kept pending behind a
  rejected token would still be exact, only wasted: the test uses the
  distribution each was drawn from.)"""
  from specjax.core import pearl
  drafter, dparams, kw = long_drafters(target,
                                       tmp_path_factory)["draft_model_chain"]
  if mutation is None:
    st = _check(target, drafter, dparams, dict(kw, pearl=True))
    pend = st.drafter_state
    assert (np.asarray(pend.post_steps) > 0).mean() > 0.05
    assert (np.asarray(pend.pre_steps) > 0).all()
    return
  _first_new_draft_tested_a_position_early(monkeypatch)
  jax.clear_caches()
  try:
    cells, _ = generate(target, drafter, dparams, pearl=True, **kw)
  finally:
    jax.clear_caches()
  stat, crit = chi_square(cells, target[2])
  assert stat > crit, (stat, crit)


@pytest.mark.long
def test_pearl_on_device_groups_samples_the_target_exactly(target, tmp_path):
  """Invariant: as above with the drafter and the target on disjoint
  device groups of one mesh (``pearl.make_mesh(data=2)`` over 4 forced
  host devices, one key per row), both modes counted."""
  from tests.forced_devices import run_worker
  make_tiny("llama_v16", tmp_path / "target", seed=0)
  make_tiny("llama_v16", tmp_path / "draft", seed=1)
  np.testing.assert_array_equal(load_hf(tmp_path / "target")[1].embed,
                                target[1].embed)  # the fixture's model
  out = run_worker("tests.pearl_worker", 4, "sample", tmp_path / "target",
                   tmp_path / "draft", tmp_path / "cells.npy")
  stat, crit = chi_square(np.load(tmp_path / "cells.npy"), target[2])
  assert stat < crit, (stat, crit)
  assert out["pre_steps"] > 0 and out["post_steps"] > 0, out
  assert out["accepted_last"] > 0.002, out


# Every option at once, each biting within the four tokens: the prompt
# holds every token (repetition), the presence and frequency penalties act
# on the tokens generated before (drafted ones too), min-p cuts after top-p.
OPTIONS = dataclasses.replace(SAMPLING, min_p=0.05, repetition_penalty=1.3,
                              presence_penalty=0.8, frequency_penalty=0.5,
                              logit_bias=((5, 1.5), (9, -2.0)))
ONE_OPTION = {"repetition": dict(repetition_penalty=1.5),
              "presence": dict(presence_penalty=1.0),
              "frequency": dict(frequency_penalty=0.7),
              "min_p": dict(min_p=0.3),
              "logit_bias": dict(logit_bias=((5, 1.5), (9, -2.0)))}
OPTION_DRAFTERS = ["eagle3_chain_small_vocab", "eagle2_dynamic_tree"]


@pytest.fixture(scope="module")
def options_law(target):
  return _joint_law(target[3], OPTIONS)


def _options_check(target, name, sampling, expected, program=None, seed=0):
  """``_check`` with ``sampling`` given as the program's constants, or
  (``program``) as each row's values in that program."""
  drafter, dparams, kw = fast_drafters(target)[name]
  if program is not None:
    kw = dict(kw, rows=RowSampling.build(program, [sampling] * N))
    sampling = program
  return _check(target, drafter, dparams, dict(kw, seed=seed), sampling,
                expected)


def test_sampling_options_are_exact_under_speculation(target, options_law):
  """Invariant: with the penalties (along each drafted prefix), a logit
  bias and min-p as constants of the program, a sampled chain samples the
  joint law transformers' processors give (module doc)."""
  _options_check(target, OPTION_DRAFTERS[0], OPTIONS, options_law)


@pytest.mark.long
@pytest.mark.parametrize("name", [OPTION_DRAFTERS[1], "ar"])
def test_sampling_options_other_forms(target, options_law, name):
  """Invariant: as the fast test, with a tree (the penalties along each
  tree path), and AR (the reference agrees with the sampler)."""
  if name == "ar":
    cells, _ = generate(target, sampling=OPTIONS)
    stat, crit = chi_square(cells, options_law)
    assert stat < crit, (stat, crit)
  else:
    _options_check(target, name, OPTIONS, options_law)


@pytest.mark.long
@pytest.mark.parametrize("name", OPTION_DRAFTERS)
def test_each_sampling_option_is_exact(target, options_law, name):
  """Invariant: every option at once and each alone, as each row's values
  in one compiled program (the canonical program of all of them, as
  ``runner.generate_ids`` builds for rows that differ), with a sampled
  chain and a tree: each setting's 50,000 rows pass the check against its
  own law."""
  program = OPTIONS.program()
  settings = [(OPTIONS, options_law)] + [
      (sp, _joint_law(target[3], sp)) for sp in (
          dataclasses.replace(SAMPLING, **ONE_OPTION[option])
          for option in sorted(ONE_OPTION))]
  for seed, (sp, law) in enumerate(settings):
    _options_check(target, name, sp, law, program, seed)


@pytest.mark.long
@pytest.mark.parametrize("name", OPTION_DRAFTERS)
def test_allowed_tokens_hook_is_exact(target, name):
  """Invariant: with an allowed-token hook that reads the context (no
  repeat of the last token: each drafted position's differs), a sampled
  chain and a tree sample the masked joint law."""
  drafter, dparams, kw = fast_drafters(target)[name]
  _check(target, drafter, dparams, dict(kw, allowed_tokens=no_repeat_no_five),
         expected=_joint_law(target[3], SAMPLING, hook=True))


def _report_raw_draft_probs(monkeypatch):
  """A chain drafter that draws from the warped distribution but reports
  the unwarped softmax as the distribution it drew from."""
  from specjax.drafters import chain
  from specjax.core import sampling
  monkeypatch.setattr(chain, "warp", lambda logits, sp: jax.nn.softmax(logits))
  monkeypatch.setattr(chain, "draw", lambda p, sp, key: sampling.draw(
      sampling.warp(jnp.log(p), sp), sp, key))


def _verify_against_unwarped_target(monkeypatch):
  """Verification against the target at the temperature alone (top-k and
  top-p dropped), while the prefill still samples the warped target."""
  from specjax.core import sampling
  monkeypatch.setattr(engine, "warp", lambda logits, sp: sampling.warp(
      logits, SamplingParams(sampling.as_sampler(sp).params.temperature)))


def _index_positions(monkeypatch):
  """RoPE positions from a node's index in the block, not its depth."""
  from specjax.core import tree
  monkeypatch.setattr(tree, "positions", lambda lengths_B, anc_BMM: (
      lengths_B[:, None] + jnp.arange(anc_BMM.shape[1])[None, :]))


def _penalties_from_committed_tokens(monkeypatch):
  """The verify block's penalties from the committed tokens alone, not
  along each position's drafted prefix."""
  from specjax.core import sampling
  monkeypatch.setattr(sampling.History, "along",
                      lambda self, block_BW, anc_BWW: self)


def _hook_reads_the_committed_context(monkeypatch):
  """The allowed-token hook at each verify position fed the committed
  tokens, not the drafts before the position."""
  from specjax.core import sampling

  def committed(self, block_BW, anc_BWW):
    (B, W), S = block_BW.shape, self.tokens.shape[1]
    return self.replace(
        tokens=jnp.broadcast_to(self.tokens[:, None], (B, W, S)),
        num_tokens=jnp.broadcast_to(self.num_tokens[:, None], (B, W)))
  monkeypatch.setattr(sampling.Allowed, "along", committed)


def _min_p_in_the_draft_only(monkeypatch):
  """min-p applied to the drafter's distributions (and the prefill's) but
  not to the target's at the verify block."""
  from specjax.core import sampling
  along = sampling.Sampler.along
  monkeypatch.setattr(sampling.Sampler, "along", lambda self, b, a: along(
      self, b, a).replace(params=dataclasses.replace(self.params, min_p=0.0)))


def _candidate_after_the_draw(monkeypatch):
  """The root's first child takes the target's draw at the root as its
  token after the forward scored the child's own token: a candidate
  chosen by looking at the draw."""
  from specjax.core import tree as trees
  from specjax.core.rows import set_at_rows
  verify = trees.verify_tree

  def peeking(tree, anc_BMM, probs_BMV, key, sampling, max_depth):
    draws_BM = trees.draw(probs_BMV.astype(jnp.float32), sampling, key)
    child_BM = (tree.parents == 0) & tree.valid & (
        jnp.arange(tree.tokens.shape[1]) > 0)[None, :]
    first_B = jnp.argmax(child_BM, axis=1)
    token_B = jnp.where(jnp.any(child_BM, axis=1), draws_BM[:, 0],
                        trees.at_rows(tree.tokens, first_B))
    tokens = set_at_rows(tree.tokens, first_B, token_B)
    return verify(tree.replace(tokens=tokens), anc_BMM, probs_BMV, key,
                  sampling, max_depth)
  monkeypatch.setattr(trees, "verify_tree", peeking)


def _slot_after_the_draw_before(monkeypatch):
  """A P-EAGLE block's slot 1 takes slot 0's drawn token half the time,
  its reported distribution unchanged: a slot sampled conditioned on
  another slot's sample."""
  from specjax.drafters.eagle import EagleDrafter
  block = EagleDrafter._propose_block

  def leaning(self, params, state, stable_B, a_BD, key, num_draft, sampling):
    prop = block(self, params, state, stable_B, a_BD, key, num_draft,
                 sampling)
    copy_B = jax.random.bernoulli(jax.random.fold_in(key, 7), 0.5,
                                  prop.tokens.shape[:1])
    return prop.replace(tokens=prop.tokens.at[:, 1].set(
        jnp.where(copy_B, prop.tokens[:, 0], prop.tokens[:, 1])))
  monkeypatch.setattr(EagleDrafter, "_propose_block", leaning)


MUTATIONS = {  # name: (drafter, mutation[, sampling])
    "peagle_slot_after_the_draw_before": ("peagle_block_chain",
                                          _slot_after_the_draw_before),
    "lookahead_candidate_after_the_draw": ("lookahead_trie",
                                           _candidate_after_the_draw),
    "draft_probs_reported_unwarped": ("eagle3_chain_small_vocab",
                                      _report_raw_draft_probs),
    "target_unwarped_in_verify": ("ngram_chain",
                                  _verify_against_unwarped_target),
    "tree_positions_by_index": ("eagle2_dynamic_tree", _index_positions),
    "penalties_from_committed_tokens": (
        "eagle3_chain_small_vocab", _penalties_from_committed_tokens,
        dataclasses.replace(SAMPLING, **ONE_OPTION["presence"])),
    "min_p_in_the_draft_only": (
        "eagle3_chain_small_vocab", _min_p_in_the_draft_only,
        dataclasses.replace(SAMPLING, **ONE_OPTION["min_p"])),
    "hook_reads_the_committed_context": (
        "eagle3_chain_small_vocab", _hook_reads_the_committed_context,
        SAMPLING, True),
}


@pytest.mark.long
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_check_catches_mutations(target, mutation, monkeypatch):
  """Invariant (mutation check): the same check FAILS for a drafter that
  reports a distribution other than the one it drew from, for a P-EAGLE
  slot drawn conditioned on the slot before it, for a lookahead
  candidate chosen after the target's draw at its position, for a verifier
  that drops top-k/top-p, for tree nodes at index positions, for penalties
  that miss the drafted tokens, for min-p left off the target and for an
  allowed-token hook fed the committed context at drafted positions."""
  name, mutate, sampling, hook = (MUTATIONS[mutation] + (SAMPLING,
                                                         False))[:4]
  drafter, dparams, kw = fast_drafters(target)[name]
  expected = (target[2] if sampling is SAMPLING and not hook
              else _joint_law(target[3], sampling, hook))
  if hook:
    kw = dict(kw, allowed_tokens=no_repeat_no_five)
  mutate(monkeypatch)
  jax.clear_caches()  # re-trace with the mutation in place
  try:
    cells, _ = generate(target, drafter, dparams, sampling=sampling, **kw)
  finally:
    jax.clear_caches()  # never let a mutated trace serve another test
  stat, crit = chi_square(cells, expected)
  assert stat > crit, (stat, crit)


def _cut_at_stops(expected, stops):
  """``(law of the output cut at the first stop, cell of each 4-tuple)``:
  the joint law of the first four tokens pushed through the cut (a stop
  sequence ends the output where it ends, kept); outputs are padded with
  V and numbered base V + 1."""
  V = expected.shape[0]
  tuples = np.stack(np.unravel_index(np.arange(V ** 4), (V,) * 4), 1)
  ends = np.full(len(tuples), 4)
  for stop in stops:
    for j in range(len(stop) - 1, 4):
      hit = np.all(tuples[:, j - len(stop) + 1:j + 1] == stop, axis=1)
      ends = np.where(hit & (ends > j + 1), j + 1, ends)
  cut = np.where(np.arange(4)[None, :] < ends[:, None], tuples, V)
  cells = np.ravel_multi_index(cut.T, (V + 1,) * 4)
  return np.bincount(cells, weights=expected.ravel(),
                     minlength=(V + 1) ** 4), cells


@pytest.mark.long
@pytest.mark.parametrize("name", ["ar", *OPTION_DRAFTERS])
def test_stop_position_follows_the_target(target, name):
  """Invariant: with stop sequences (one token; two tokens, which can span
  the prefill's token and a verify block) at T > 0, the output cut at the
  first stop follows the joint law pushed through the cut (chi-square as
  the module's): where a stop lands, including inside an accepted block
  or at a tree node, is the target's."""
  stat, crit, stopped, early = _stop_check(target, name)
  assert stat < crit, (stat, crit)
  assert 0.1 < stopped < 0.9 and early > 0.1, (stopped, early)


@pytest.mark.long
def test_the_stop_check_catches_a_stop_seen_only_at_block_ends(
    target, monkeypatch):
  """Invariant (mutation check): the stop check FAILS for an engine that
  sees a stop only where it ends a verify block (one inside an accepted
  block goes on)."""
  seen = engine._stop_ends

  def at_block_end(state, tokens_BT, dcfg):
    last_1T = jnp.arange(tokens_BT.shape[1])[None, :] == tokens_BT.shape[1] - 1
    return seen(state, tokens_BT, dcfg) & last_1T
  monkeypatch.setattr(engine, "_stop_ends", at_block_end)
  jax.clear_caches()
  try:
    stat, crit, _, _ = _stop_check(target, OPTION_DRAFTERS[0])
  finally:
    jax.clear_caches()
  assert stat > crit, (stat, crit)


def _stop_check(target, name):
  """(statistic, critical value) of the stop-position check, the fraction
  of rows a stop ended and, of those, the fraction ended before token 4."""
  cfg, params, expected = target[:3]
  V = cfg.vocab_size
  second = expected.sum(axis=(0, 2, 3))  # token 2's marginal
  pair = np.unravel_index(np.argmax(expected.sum(axis=(2, 3))), (V, V))
  stops = ((int(np.argmax(second)),), tuple(map(int, pair)))
  law, _ = _cut_at_stops(expected, stops)
  drafter, dparams, kw = ((None, None, {}) if name == "ar"
                          else fast_drafters(target)[name])
  L = len(PROMPT)
  dcfg = engine.DecodeConfig(capacity=32, sampling=SAMPLING, drafter=drafter,
                             num_draft=K if drafter else 0,
                             stop_sequences=stops, **kw)
  st = generate_o1(params, jnp.tile(jnp.asarray([PROMPT], jnp.int32), (N, 1)),
                   jnp.full((N,), L, jnp.int32), jax.random.key(5),
                   np.int32(NEW), target=Decoder(cfg), dcfg=dcfg,
                   drafter_params=dparams)
  num = np.asarray(st.num_tokens) - L
  tokens = np.where(np.arange(NEW)[None, :] < num[:, None],
                    np.asarray(st.tokens[:, L:L + NEW]), V)
  stopped = np.asarray(st.stop_reason) == engine.STOP_SEQUENCE
  cells = np.ravel_multi_index(tokens.T, (V + 1,) * NEW)
  return (*chi_square(cells, law / law.sum()), stopped.mean(),
          (num[stopped] < NEW).mean())


def _closes_after(token):
  """An allowed-token hook that allows nothing after ``token`` (everything
  elsewhere): a row ends right after generating it."""
  def hook(tokens_BS, num_tokens_B, prompt_lengths_B):
    last_B1 = jnp.take_along_axis(tokens_BS, (num_tokens_B - 1)[:, None], 1)
    return jnp.broadcast_to(last_B1 != token, (len(num_tokens_B), 16))
  return hook


def _closing_check(target, name):
  """(statistic, critical value, fraction of rows the hook ended) for the
  EAGLE chain or tree under a hook that closes after the most likely
  second token: the law is the stop law of that one token (a row ends
  right after it)."""
  cfg, params, expected = target[:3]
  token = int(np.argmax(expected.sum(axis=(0, 2, 3))))
  law, _ = _cut_at_stops(expected, ((token,),))
  drafter, dparams, kw = fast_drafters(target)[name]
  L, V = len(PROMPT), cfg.vocab_size
  cells, st = generate(target, drafter, dparams,
                       allowed_tokens=_closes_after(token), check_len=False,
                       **kw)
  num = np.asarray(st.num_tokens) - L
  tokens = np.where(np.arange(NEW)[None, :] < num[:, None],
                    np.asarray(st.tokens[:, L:L + NEW]), V)
  closed = np.asarray(st.stop_reason) == engine.STOP_NONFINITE
  cells = np.ravel_multi_index(tokens.T, (V + 1,) * NEW)
  return (*chi_square(cells, law / law.sum()), closed.mean())


@pytest.mark.long  # fast: test_engine's hook cases, deterministic
@pytest.mark.parametrize("name", OPTION_DRAFTERS)
def test_a_hook_that_closes_after_a_token_ends_rows_exactly(target, name):
  """Invariant: where the hook allows nothing after a drafted token, the
  draft is still verified (accepted: the row ends after it; rejected: the
  target's correction), so the output follows the target cut right after
  that token -- with a sampled chain, whose drafts would be biased if the
  closed position's draft were dropped untested, and with a tree."""
  stat, crit, closed = _closing_check(target, name)
  assert stat < crit, (stat, crit)
  assert 0.1 < closed < 0.9, closed


@pytest.mark.long
def test_the_closing_check_catches_a_draft_dropped_untested(
    target, monkeypatch):
  """Invariant (mutation check): the check FAILS for a chain step that
  ends its drafts before a closed position (the draft there dropped
  without its acceptance test, the bonus taken from the position
  before)."""
  cut = engine._chain_cut

  def early(logits_BTV, num_draft_B):
    usable, num_B, first_bad_B = cut(logits_BTV, num_draft_B)
    return usable, jnp.minimum(num_B, jnp.maximum(first_bad_B - 1, 0)), \
        first_bad_B
  monkeypatch.setattr(engine, "_chain_cut", early)
  jax.clear_caches()
  try:
    stat, crit, _ = _closing_check(target, OPTION_DRAFTERS[0])
  finally:
    jax.clear_caches()
  assert stat > crit, (stat, crit)
