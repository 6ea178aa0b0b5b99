"""The tuner: theory + a cost curve + acceptance priors -> method and K."""

import pytest

from specjax.measure import theory, tuner
from specjax.models.decoder import Decoder

# A memory-bound curve: a verify over t tokens costs barely more than one.
FLAT = tuner.CostCurve(forward=(0.0,) + tuple(0.030 + 0.001 * t
                                                for t in range(1, 10)),
                       rest=0.002, num_layers=30)
# A compute-bound curve: every extra token costs most of a forward.
STEEP = tuner.CostCurve(forward=(0.0,) + tuple(0.030 * t for t in range(1, 10)),
                        rest=0.002, num_layers=30)


@pytest.fixture
def priors(monkeypatch):
  table = {("ngram", "chat"): {0.0: 0.8, 1.0: 0.4},
           ("layerskip", "chat"): {0.0: 0.3, 1.0: 0.2}}
  monkeypatch.setattr(tuner, "PRIORS", table)
  monkeypatch.setattr(tuner, "DRAFT_COST", {})
  monkeypatch.setattr(tuner, "DRAFT_RATE", {})
  monkeypatch.setattr(tuner, "CONFIG_PRIORS", [])
  return table


def test_a_configuration_measured_whole_pays_for_what_it_scores(
    priors, monkeypatch):
  """Invariant: a lookahead configuration is scored from its measured τ
  and the verify forward over every token it scores (trie and window) on
  this machine's curve, its τ interpolated in temperature; on a steep
  curve a wide window loses to the same τ scored narrower, and a task it
  was not measured on borrows chat and says so."""
  spec = "lookahead:k=3:nodes=6:window=3"
  monkeypatch.setattr(tuner, "CONFIG_PRIORS", [
      dict(method="lookahead", spec=spec, task="chat", temperature=t, k=3,
           tau=tau, verify_width=16, draft_cost=0.05)
      for t, tau in ((0.0, 2.0), (1.0, 1.6))])
  for curve in (FLAT, STEEP):
    rec = tuner.recommend(tuner.Workload(temperature=0.5), curve,
                          methods=("ngram",))
    opt = next(o for o in rec.options if o.method == spec)
    step = 0.05 * curve.forward[1] + curve.forward_at(16) + curve.rest
    assert opt.expected_tokens == pytest.approx(1.8)
    assert opt.speedup == pytest.approx(curve.ar_step * 1.8 / step)
  assert opt.speedup < 1 and rec.method != spec  # STEEP: 16 tokens cost 16
  rec = tuner.recommend(tuner.Workload(task="code"), FLAT,
                        methods=("layerskip",))
  assert rec.method == spec and rec.options[0].alpha is None
  assert any("borrowed from chat" in line for line in rec.reasoning)


def test_picks_the_theory_optimum(priors):
  """Invariant: with a flat verify curve and α = 0.8 the pick is n-gram at
  the K that maximises theory's speedup under the same costs, and the
  predicted speedup equals that maximum."""
  rec = tuner.recommend(tuner.Workload(), FLAT, methods=("ngram",))
  def gain(k):
    step = FLAT.forward[k + 1] + FLAT.rest
    return FLAT.ar_step * theory.expected_tokens(0.8, k) / step
  best = max(range(1, tuner.K_MAX + 1), key=gain)
  assert (rec.method, rec.num_draft) == ("ngram", best)
  assert rec.expected_speedup == pytest.approx(gain(best))
  assert rec.expected_speedup > 2


def test_head_drafts_pay_their_measured_cost(priors, monkeypatch):
  """Invariant: a trained head's K drafts add K x its measured per-token
  cost (a fraction of a one-token forward) to the step; a table drafter
  with the same α adds nothing, so it predicts the larger speedup."""
  priors[("eagle3", "chat")] = priors[("ngram", "chat")]
  monkeypatch.setattr(tuner, "DRAFT_COST", {"eagle3": 0.1})
  rec = tuner.recommend(tuner.Workload(), FLAT, methods=("ngram", "eagle3"))
  by = {o.method: o for o in rec.options}
  k = by["eagle3"].num_draft
  step = 0.1 * k * FLAT.forward[1] + FLAT.forward[k + 1] + FLAT.rest
  assert by["eagle3"].speedup == pytest.approx(
      FLAT.ar_step * theory.expected_tokens(0.8, k) / step)
  assert by["ngram"].speedup > by["eagle3"].speedup
  assert rec.method == "ngram"


def test_steps_without_drafts_cost_one_token_forward(priors, monkeypatch):
  """Invariant: a drafter that drafts on a share w of steps (the others run
  a one-token forward and emit one token, the engine's adaptive verify width)
  is scored as that mixture, which on a steep verify curve beats drafting on
  every step with the same α."""
  monkeypatch.setattr(tuner, "DRAFT_RATE", {("ngram", "chat"): {0.0: 0.5}})
  rec = tuner.recommend(tuner.Workload(), STEEP, methods=("ngram",))
  opt = rec.options[0]
  k = opt.num_draft
  e = 0.5 + 0.5 * theory.expected_tokens(0.8, k)
  step = STEEP.rest + 0.5 * STEEP.forward[1] + 0.5 * STEEP.forward[k + 1]
  assert opt.expected_tokens == pytest.approx(e)
  assert opt.speedup == pytest.approx(STEEP.ar_step * e / step)
  assert any("drafting on 50% of steps" in line for line in rec.reasoning)
  monkeypatch.setattr(tuner, "DRAFT_RATE", {})
  always = tuner.recommend(tuner.Workload(), STEEP, methods=("ngram",))
  assert always.options[0].speedup < opt.speedup


def test_scores_every_table_drafter_by_default(priors):
  """Invariant: without ``methods`` the tuner scores each measured drafter,
  the n-gram-then-retrieval lookup included, at its own α."""
  priors[("ngram+retrieval", "chat")] = {0.0: 0.6}
  rec = tuner.recommend(tuner.Workload(), FLAT)
  by = {o.method: o for o in rec.options}
  assert set(by) == {"ngram", "ngram+retrieval", "layerskip"}
  assert by["ngram+retrieval"].alpha == pytest.approx(0.6)


def test_falls_back_to_ar_where_speculation_cannot_pay(priors):
  """Invariant: when every verify token costs a forward, low α cannot
  pay for it and the tuner says AR, with the reason."""
  rec = tuner.recommend(tuner.Workload(temperature=1.0), STEEP)
  assert rec.method == "ar" and rec.num_draft == 0
  assert rec.expected_speedup == 1.0
  assert any("beat AR" in line for line in rec.reasoning)


def test_temperature_interpolates_and_tasks_borrow(priors):
  """Invariants: α is linear in temperature between the measured points and
  clamped outside; an unmeasured task borrows and says so."""
  assert tuner.alpha_for("ngram", "chat", 0.5)[0] == pytest.approx(0.6)
  assert tuner.alpha_for("ngram", "chat", 1.7)[0] == pytest.approx(0.4)
  alpha, why = tuner.alpha_for("ngram", "summarize", 0.0)
  assert alpha == pytest.approx(0.8) and "borrowed from chat" in why
  assert tuner.alpha_for("retrieval", "chat", 0.0)[0] is None


def test_latency_target_is_judged(priors):
  """Invariant: the latency verdict compares predicted ms/token to the target."""
  rec = tuner.recommend(tuner.Workload(latency_target_ms=1.0), FLAT)
  assert rec.meets_latency_target is False
  rec = tuner.recommend(tuner.Workload(latency_target_ms=1e4), FLAT)
  assert rec.meets_latency_target is True


def test_workload_validation():
  with pytest.raises(ValueError, match="unknown task"):
    tuner.Workload(task="poetry")
  with pytest.raises(ValueError, match="temperature"):
    tuner.Workload(temperature=-1)
  with pytest.raises(ValueError, match="new tokens >= 1"):
    tuner.Workload(prompt_tokens=-1)
  with pytest.raises(ValueError, match="new tokens >= 1"):
    tuner.Workload(new_tokens=0)


def test_a_prefill_is_counted_in_the_requests_speedup(priors):
  """Invariants: with a measured prefill the recommendation gives its time
  to first token and the request's speedup (prefill + n AR steps over
  prefill + n steps at the decode speedup), which lies between 1 and the
  decode speedup and falls as the prefill grows; without one, neither."""
  import dataclasses
  plain = tuner.recommend(tuner.Workload(), FLAT, methods=("ngram",))
  assert plain.ttft_ms is None and plain.speedup_with_prefill is None
  gains = []
  for seconds in (0.5, 5.0):
    curve = dataclasses.replace(FLAT, prefill=(2000, seconds))
    rec = tuner.recommend(tuner.Workload(prompt_tokens=2000, new_tokens=100),
                          curve, methods=("ngram",))
    assert rec.ttft_ms == pytest.approx(seconds * 1e3)
    steps = seconds / curve.ar_step
    want = (steps + 100) / (steps + 100 / rec.expected_speedup)
    assert rec.speedup_with_prefill == pytest.approx(want)
    assert 1 < rec.speedup_with_prefill < rec.expected_speedup
    assert any("2000 prompt tokens" in line for line in rec.reasoning)
    gains.append(rec.speedup_with_prefill)
  assert gains[0] > gains[1]


def _with_wide(curve, per_token):
  """``curve`` timed out to the tree widths, ``per_token`` s per extra token."""
  last = curve.forward[-1]
  return tuner.CostCurve(
      forward=curve.forward, rest=curve.rest, num_layers=curve.num_layers,
      wide=tuple((t, last + per_token * (t - tuner.K_MAX - 1))
                 for t in tuner.TREE_WIDTHS))


def test_cost_curve_interpolates_tree_widths():
  """Invariant: ``forward_at`` is the measured forward where there is one,
  linear between measured widths, and extends the last segment."""
  c = _with_wide(FLAT, 0.002)
  assert c.forward_at(5) == FLAT.forward[5]
  assert c.forward_at(16) == pytest.approx(FLAT.forward[9] + 0.002 * 7)
  assert c.forward_at(14) == pytest.approx(FLAT.forward[9] + 0.002 * 5)
  assert c.forward_at(40) == pytest.approx(FLAT.forward[9] + 0.002 * 31)


def test_tree_is_sized_by_the_verify_curve(monkeypatch):
  """Invariants: with per-rank acceptance measured, ``recommend_tree``
  returns a static tree whose shape parses to its node count, whose
  predicted speedup is theory's E over (rest + one head call per level +
  the verify forward over nodes + 1), and which is larger on a flat verify
  curve than on a steep one; without a measurement there is none."""
  from specjax.core import tree
  monkeypatch.setattr(tuner, "DRAFT_COST", {"eagle3": 0.05})
  monkeypatch.setattr(tuner, "TREE_PRIORS", {})
  assert tuner.recommend_tree(tuner.Workload(), FLAT) is None
  p = [[0.55, 0.15, 0.08, 0.05]] * 5
  monkeypatch.setattr(tuner, "TREE_PRIORS", {("eagle3", "chat"): {0.0: p}})
  flat = _with_wide(FLAT, 0.001)
  steep = _with_wide(STEEP, 0.030)
  wide = tuner.recommend_tree(tuner.Workload(), flat)
  narrow = tuner.recommend_tree(tuner.Workload(), steep)
  assert wide.num_nodes > narrow.num_nodes >= 1
  for opt, curve in ((wide, flat), (narrow, steep)):
    assert len(tree.parse_shape(opt.shape)) == opt.num_nodes + 1
    paths = [tuple(map(int, q.split("."))) for q in opt.shape.split(",")]
    e = theory.tree_expected_tokens(paths, p)
    assert opt.expected_tokens == pytest.approx(e)
    step = (curve.rest + opt.depth * 0.05 * curve.forward[1]
            + curve.forward_at(opt.num_nodes + 1))
    assert opt.speedup == pytest.approx(curve.ar_step * e / step)


@pytest.mark.long
def test_measure_costs_times_the_tree_widths(tmp_path):
  """Invariant: the measured curve has every chain width 1..K_MAX + 1 and
  the tree widths, all positive, on a tiny model; and the prefill of a
  request's prompt when asked."""
  from specjax.models.registry import Model
  from specjax import testing
  cfg, params = testing.tiny("llama_gqa_tied", seed=1)
  costs = tuner.measure_costs(Model(target=Decoder(cfg), params=params, tokenizer=None),
                              1, progress=False, context=40, rounds=1)
  assert len(costs.forward) == tuner.K_MAX + 2
  assert [t for t, _ in costs.wide] == list(tuner.TREE_WIDTHS)
  assert min(costs.forward[1:]) > 0 and min(s for _, s in costs.wide) > 0
  assert costs.forward_at(tuner.TREE_WIDTHS[-1]) == costs.wide[-1][1]
  assert costs.prefill is None
  costs = tuner.measure_costs(Model(target=Decoder(cfg), params=params, tokenizer=None),
                              1, progress=False, context=40, rounds=1,
                              prompt_tokens=30, new_tokens=8)
  assert costs.prefill[0] == 30 and costs.prefill[1] > 0
