"""Real kills: ``specjax train`` (orbax checkpoints, metrics, the exported
head, the feature-cache build) and ``specjax bench --journal`` run as
subprocesses and die by SIGKILL; the reruns must resume and end where an
uninterrupted run ends, and never read a half-written file.

Two kinds of kill, both SIGKILL of the child's whole process group (it is
started in a session of its own, so a ``git`` it spawned dies with it):

* From outside (``os.killpg(pid, SIGKILL)``): at times drawn from a seeded
  RNG over the phase under test (training steps, the feature build, the
  batches of a benchmark), or the moment orbax's temporary checkpoint
  directory (``N.orbax-checkpoint-tmp``) appears in ``ckpt/``: a save in
  flight.
* From inside, at one exact write (``_CHILD``): the child runs the CLI's
  ``main`` behind a hook that, at the n-th write to a file whose path
  matches a pattern, writes the first half (or a given fraction) of the
  data, flushes it to the kernel and SIGKILLs its own process group -- the
  torn file a kill mid-write leaves. It sees writes through Python's
  ``open`` (metric lines, the moved and rewritten ones of a resume, the
  journal, the feature cache's ``meta.json`` temporary, the zip of
  ``head.npz``'s temporary, orbax's checkpoint metadata files inside its
  temporary directory) and ``os.pwrite`` (the feature cache's arrays).
  Orbax's array data (written by tensorstore, in C++) is reached only by
  the outside kills.

The model is a random 3-layer Llama (``tests/tiny_hf.py``) saved as an HF
directory with a 37-token character-level tokenizer and a chat template
that keeps six characters of each turn, so ``--model DIR`` loads it, ShareGPT
tokenizes into it and a whole run takes seconds. Children share the suite's
persistent compilation cache, whose entries JAX writes in place: the
uninterrupted reference run of each test fills it first, so a killed child
only reads it. Each test takes 7-40 s on 2 cores (a child starts in ~4 s).
"""

import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.tiny_hf import make_chat_model

pytestmark = pytest.mark.long

ROOT = pathlib.Path(__file__).parents[1]
TMP = ".orbax-checkpoint-tmp"
STEPS = 10

# The child: the CLI's main behind the tearing hook (module doc). The hook
# is armed by KILLS_TEAR = {"path": regex, "nth": n, "frac": f}; the n-th
# write to a matching path (counted over the process, all threads) is torn
# after its first f of the data (default half).
_CHILD = r'''
import builtins, io, json, os, re, signal, sys, threading
spec = json.loads(os.environ.get("KILLS_TEAR") or "null")
if spec:
  pattern, nth, lock, count = re.compile(spec["path"]), spec["nth"], threading.Lock(), [0]
  frac = spec.get("frac", 0.5)

  def due(path):
    if not pattern.search(path):
      return False
    with lock:
      count[0] += 1
      return count[0] == nth

  def die():
    os.killpg(0, signal.SIGKILL)

  class Torn:
    """A file whose writes count; the due one is cut in half."""
    def __init__(self, f, path):
      self._f, self._path = f, path
    def write(self, data):
      if due(self._path):
        self._f.write(data[:int(len(data) * frac)])
        self._f.flush()
        die()
      return self._f.write(data)
    def __getattr__(self, name):
      return getattr(self._f, name)
    def __enter__(self):
      self._f.__enter__()
      return self
    def __exit__(self, *exc):
      return self._f.__exit__(*exc)

  real_open, real_pwrite = io.open, os.pwrite

  def open_(file, mode="r", *a, **k):
    f = real_open(file, mode, *a, **k)
    if (isinstance(file, int) or not set(mode) & set("wax+")
        or not pattern.search(os.fspath(file))):
      return f
    return Torn(f, os.fspath(file))

  def pwrite(fd, data, offset):
    if due(os.readlink(f"/proc/self/fd/{fd}")):
      real_pwrite(fd, bytes(data)[:int(len(data) * frac)], offset)
      die()
    return real_pwrite(fd, data, offset)

  builtins.open = io.open = open_
  os.pwrite = pwrite
from specjax.cli.main import main
sys.exit(main(sys.argv[1:]))
'''


class World:
  """What every test here shares: the model directory, a training config
  file, benchmark prompts, a HOME for the children (ShareGPT's tokenized
  cache goes under it) and the uninterrupted reference runs."""

  def __init__(self, root: pathlib.Path):
    self.root, self.model = root, root / "model"
    self.model.mkdir()
    make_chat_model(self.model)
    self.home = root / "home"
    self.home.mkdir()
    self.config = root / "config.py"
    self.config.write_text(
        "from specjax.training.config import defaults\n"
        "def get_config():\n"
        "  c = defaults()\n"
        f"  c.model = {str(self.model)!r}\n"
        "  c.data.update(num_conversations=12, heldout=2, max_len=24)\n"
        "  c.head.draft_vocab = 30\n"
        "  c.ttt.steps = 2\n"
        "  c.optim.update(lr=3e-3, warmup=2)\n"
        f"  c.update(batch_size=2, steps={STEPS}, checkpoint_every=2, "
        "keep=2, log_every=1)\n"
        "  return c\n")
    self.prompts = root / "prompts.jsonl"
    self.prompts.write_text("".join(
        json.dumps(dict(prompt=p)) + "\n" for p in
        ("abab ab", "hello world", "the cat sat", "aaaa aa", "one two",
         "xyzxyz", "no, no, no", "to be or")))
    self._runs = 0
    self.references = {}

  def run(self, args, *, tear=None, kill_when=None, timeout=240):
    """Runs the CLI with ``args`` in a process group of its own; SIGKILLs
    the group when ``kill_when()`` turns true (polled every millisecond).
    Returns ``(returncode, stdout, stderr)``; -9 is a SIGKILL."""
    self._runs += 1
    out, err = (self.root / f"run{self._runs}.{s}" for s in ("out", "err"))
    env = dict(os.environ, HOME=str(self.home),
               KILLS_TEAR=json.dumps(tear) if tear else "")
    with open(out, "w") as fo, open(err, "w") as fe:
      p = subprocess.Popen([sys.executable, "-c", _CHILD, *map(str, args)],
                           cwd=ROOT, env=env, stdout=fo, stderr=fe,
                           start_new_session=True)
      deadline = time.monotonic() + timeout
      try:
        while p.poll() is None:
          if kill_when is not None and kill_when():
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            break
          if time.monotonic() > deadline:
            raise AssertionError(f"{args[0]} ran past {timeout} s")
          time.sleep(0.001)
      finally:
        if p.poll() is None:
          os.killpg(p.pid, signal.SIGKILL)
          p.wait()
    return p.returncode, out.read_text(), err.read_text()

  def reference(self, name, make_args, watch):
    """The uninterrupted run of ``make_args(its directory)``, once per
    module: ``dict(dir=, out=stdout, gap=)``, ``gap`` the mean seconds
    between two changes of the file ``watch`` in its directory (a step, a
    batch: what random kills are drawn over)."""
    if name not in self.references:
      d = self.root / f"reference-{name}"
      d.mkdir()
      seen = AfterChange(d / watch, math.inf)  # never fires: a stopwatch
      rc, out, err = self.run(make_args(d), kill_when=seen)
      assert rc == 0 and seen.since, err[-3000:]
      assert seen.changes > 2, seen.changes
      self.references[name] = dict(dir=d, out=out, gap=(
          seen.last - seen.since) / (seen.changes - 1))
    return self.references[name]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return World(tmp_path_factory.mktemp("kills"))


def _survived(rc, err, *, killed):
  """A rerun never crashes: it ends by our SIGKILL (``killed``: it must) or
  succeeds."""
  assert rc in ((-9,) if killed else (0, -9)), (
      f"exit {rc}, not a kill: {err[-4000:]}")


def _train_args(world, workdir, *sets):
  return ["train", "--config", world.config, "--workdir", workdir,
          *[f"--config.{s}" for s in sets]]


def _lines(path: pathlib.Path) -> list[dict]:
  """The complete JSON lines of ``path`` (a torn one is skipped)."""
  rows = []
  if path.is_file():
    for line in path.read_text().splitlines():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  return rows


def _assert_metrics_agree(workdir, want_dir, *, complete=False):
  """The metric lines on disk are steps 1..m, each once, in order, with m
  at least the newest complete checkpoint's step (no line a resume starts
  after is lost), and each is the reference run's line for its step (loss
  to rtol 1e-6; accuracies, TTT length and gradient norm as logged);
  ``complete``: m is the run's last step and no torn line is left."""
  path = workdir / "metrics.jsonl"
  got = (_lines(path) if not complete else
         [json.loads(l) for l in path.read_text().splitlines()])
  want = {r["step"]: r for r in _lines(want_dir / "metrics.jsonl")}
  assert sorted(want) == list(range(1, STEPS + 1))
  steps = [g["step"] for g in got]
  assert steps == list(range(1, len(steps) + 1)), steps
  newest = max(_finalized(workdir / "ckpt"), default=0)
  assert len(steps) >= newest, (
      f"metric lines lost: {steps}, yet checkpoint {newest} is complete")
  for g in got:
    w = want[g["step"]]
    np.testing.assert_allclose(g["loss"], w["loss"], rtol=1e-6)
    np.testing.assert_allclose(g["acc"], w["acc"], rtol=1e-6)
    np.testing.assert_allclose(g["grad_norm"], w["grad_norm"], rtol=1e-6)
    assert g["ttt"] == w["ttt"]
  if complete:
    assert steps == list(range(1, STEPS + 1))
  return len(steps)


def _assert_same_head(workdir, want_dir):
  with np.load(workdir / "head.npz") as a, np.load(want_dir / "head.npz") as b:
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
      np.testing.assert_array_equal(a[k], b[k])


def _saving(ckpt: pathlib.Path, min_step: int = 0):
  """True while orbax has a temporary checkpoint directory of a step >=
  ``min_step`` in ``ckpt`` (a save in flight)."""
  def fired():
    try:
      names = os.listdir(ckpt)
    except FileNotFoundError:
      return False
    return any(TMP in n and int(n.split(".")[0]) >= min_step for n in names)
  return fired


class AfterChange:
  """Fires ``delay`` seconds after the ``count``-th change of ``path`` (it
  appears, or its size or mtime moves; polled, so changes within one poll
  count once; ``os.replace`` counts too). ``since``, ``last``: when it first and last changed
  (monotonic; None before); ``changes``: how many times."""

  def __init__(self, path: pathlib.Path, delay: float, count: int = 1):
    self.path, self.delay, self.count = path, delay, count
    self.since = self.last = self.fire_from = None
    self.changes, self.seen = 0, self._stat()

  def _stat(self):
    try:
      s = os.stat(self.path)
      return s.st_ino, s.st_size, s.st_mtime_ns
    except FileNotFoundError:
      return None

  def __call__(self) -> bool:
    now, seen = time.monotonic(), self._stat()
    if seen != self.seen:
      self.seen, self.last, self.changes = seen, now, self.changes + 1
      self.since = self.since or now
      if self.changes == self.count:
        self.fire_from = now + self.delay
    return self.fire_from is not None and now >= self.fire_from


def _finalized(ckpt: pathlib.Path) -> list[int]:
  """The steps of the checkpoints orbax has renamed into place."""
  if not ckpt.is_dir():
    return []
  return sorted(int(n) for n in os.listdir(ckpt) if n.isdigit())


def _tmp_dirs(ckpt: pathlib.Path) -> list[str]:
  return [n for n in os.listdir(ckpt) if TMP in n] if ckpt.is_dir() else []


def test_train_torn_at_each_write_resumes_exactly(world, tmp_path):
  """Invariants: ``specjax train`` killed mid-write at each file it writes
  -- a metric line (step 5's append), the append to metrics.dropped.jsonl
  and the rewrite of metrics.jsonl a resume does (``_truncate_metrics``),
  orbax's checkpoint metadata inside the temporary directory of a save in
  flight, the zip of ``head.npz``'s temporary -- never crashes a rerun (no
  torn file is read); after each kill the metric lines on disk are the
  uninterrupted run's and reach the newest complete checkpoint; every whole
  line any run wrote, and the torn one, ends as a line of metrics.jsonl or
  metrics.dropped.jsonl (moved, never lost); the run finally ends with
  exactly the uninterrupted run's metrics (each step once, loss rtol 1e-6)
  and head. Mutations caught: the metrics rewrite done in place
  (``path.write_text``: the kept lines are lost when it is torn), the
  dropped lines appended after a torn one without ending it first (the
  next line is glued to it)."""
  want = world.reference("train", lambda d: _train_args(world, d),
                         "metrics.jsonl")["dir"]
  work = tmp_path / "w"
  args = _train_args(world, work)
  metrics, dropped = work / "metrics.jsonl", work / "metrics.dropped.jsonl"
  plans = [
      # Steps 1-4 logged, step 5's line torn; checkpoint 2 is complete
      # (orbax finishes a save before it starts the next, step 4's).
      dict(path=r"/metrics\.jsonl$", nth=5),
      # The resume moving the torn line (and any past its checkpoint), cut
      # inside the first line it moves.
      dict(path=r"/metrics\.dropped\.jsonl$", nth=1, frac=0.1),
      # A checkpoint save in flight: the second metadata file orbax writes
      # into the temporary directory of this run's first save. (This
      # run's resume moves the lines again, after the torn append, and
      # completes: they are only there now.)
      dict(path=re.escape(TMP) + "/", nth=2),
      # The resume's rewrite of metrics.jsonl (its first write there).
      dict(path=r"/metrics\.jsonl", nth=1),
      # The head exported with a checkpoint, mid-zip.
      dict(path=r"/head\.tmp\.npz$", nth=3),
  ]
  written = set()  # every line seen in metrics.jsonl, whole or torn
  for i, tear in enumerate(plans):
    rc, _, err = world.run(args, tear=tear)
    _survived(rc, err, killed=True)
    _assert_metrics_agree(work, want)
    written |= set(metrics.read_text().splitlines())
    if i == 2:
      assert _tmp_dirs(work / "ckpt"), "the kill did not land mid-save"
  torn = [l for l in written if not _lines_of(l)]
  assert len(torn) == 1  # plan 1's half line
  rc, out, err = world.run(args)
  _survived(rc, err, killed=False)
  assert rc == 0 and json.loads(out.splitlines()[-1])["step"] == STEPS
  _assert_metrics_agree(work, want, complete=True)
  _assert_same_head(work, want)
  assert _finalized(work / "ckpt")[-1] == STEPS
  kept = set(metrics.read_text().splitlines()) | set(
      dropped.read_text().splitlines())
  assert written <= kept, sorted(written - kept)


def _lines_of(line: str) -> list:
  """``[record]`` for a whole JSON line, ``[]`` for a torn one."""
  try:
    return [json.loads(line)]
  except json.JSONDecodeError:
    return []


def test_train_killed_mid_save_and_at_random_times_resumes_exactly(
    world, tmp_path):
  """Invariants: ``specjax train`` SIGKILLed from outside -- the moment
  orbax's temporary directory of a save appears (the first save, then one
  of step >= 6), then at two points drawn from a seeded RNG (1 or 2
  metric lines into the run, then a uniform part of a step: steps, metric
  appends, async checkpoint saves and the deletion of old ones, head
  exports) -- is resumed by each rerun without a crash, every metric line
  on disk after each kill is the uninterrupted run's, and the run ends with
  exactly its metrics (each step once, loss rtol 1e-6) and head."""
  ref = world.reference("train", lambda d: _train_args(world, d),
                        "metrics.jsonl")
  want, work = ref["dir"], tmp_path / "w"
  args, ckpt = _train_args(world, work), work / "ckpt"
  landed = []
  for min_step in (0, 6):  # a save always comes: the run is killed
    rc, _, err = world.run(args, kill_when=_saving(ckpt, min_step))
    _survived(rc, err, killed=True)
    landed.append(bool(_tmp_dirs(ckpt)))  # False: orbax finished first
    _assert_metrics_agree(work, want)
  outcomes = _random_kills(world, args, work / "metrics.jsonl", ref["gap"],
                           seed=20240611, n=2,
                           check=lambda: _assert_metrics_agree(work, want))
  _assert_metrics_agree(work, want, complete=True)
  _assert_same_head(work, want)
  assert _finalized(ckpt)[-1] == STEPS
  print(f"kills landing mid-save: {landed}; random: {outcomes}")


_FEATURES = ("taps.bin", "hidden.bin", "in_vocab.bin")


def _assert_done_rows_agree(feats: pathlib.Path, want: pathlib.Path):
  """``meta.json``, when there is one, is whole, and the rows its ``done``
  counter claims are byte for byte the reference cache's (a torn batch is
  never counted). Returns ``done`` (None: no meta.json yet)."""
  if not (feats / "meta.json").is_file():
    return None
  text = (feats / "meta.json").read_text()
  try:
    meta = json.loads(text)
  except json.JSONDecodeError:
    raise AssertionError(f"torn meta.json: {text!r}") from None
  ref = json.loads((want / "meta.json").read_text())
  assert meta["fingerprint"] == ref["fingerprint"]
  n, done = meta["examples"], meta["done"]
  for name in _FEATURES:
    a, b = (feats / name).read_bytes(), (want / name).read_bytes()
    row = len(b) // n
    assert len(a) == len(b), name
    bad = [i for i in range(done) if a[i * row:(i + 1) * row]
           != b[i * row:(i + 1) * row]]
    assert not bad, f"{name}: rows {bad} counted done differ"
  return done


def _random_kills(world, args, watch: pathlib.Path, gap: float, seed: int,
                  check, n: int = 3, most: int = 2) -> list:
  """Up to ``n`` runs of ``args``, each SIGKILLed from outside at a point
  drawn from ``seed``'s RNG: 1 to ``most`` changes of ``watch`` into the
  run, then a uniform part of ``gap`` (the reference's mean seconds between
  changes: a step or batch computed, written, checkpointed), so the kill
  lands somewhere in the next one; then one run to the end. None may
  crash, and ``check()`` holds after each. Returns ``(exit status,
  check())`` per killed run."""
  rng, outcomes = np.random.default_rng(seed), []
  for _ in range(n):
    kill_when = AfterChange(watch, rng.uniform(0.0, gap),
                            count=int(rng.integers(1, most + 1)))
    rc, _, err = world.run(args, kill_when=kill_when)
    _survived(rc, err, killed=False)
    outcomes.append((rc, check()))
    if rc == 0:
      return outcomes
  rc, out, err = world.run(args)
  _survived(rc, err, killed=False)
  assert rc == 0, err[-3000:]
  check()
  return outcomes


# 16 batches of 2 examples (of a training split of 38), 10 steps over them.
_CACHED = ("data.num_conversations=40", "data.feature_cache=32")


def _assert_cached_run_agrees(work, want):
  feats = work / "features"
  assert _assert_done_rows_agree(feats, want / "features") == 32
  for name in _FEATURES:
    assert (feats / name).read_bytes() == (want / "features" / name
                                           ).read_bytes()
  _assert_metrics_agree(work, want, complete=True)
  _assert_same_head(work, want)


def test_feature_cache_build_torn_resumes_to_the_same_files(world, tmp_path):
  """Invariants: the feature-cache build of ``specjax train
  --config.data.feature_cache=32`` (16 batches of 2 examples) killed mid-write -- the first
  ``meta.json`` temporary (no cache recorded yet), batch 2's taps
  (``pwrite``, half written), batch 2's ``done`` counter, batch 3's
  in-vocab flags -- never crashes a rerun; after each kill meta.json is
  whole and counts exactly the batches written before the torn one, and
  those rows are the uninterrupted build's bytes (a torn batch is redone,
  never read); the cache ends byte for byte the uninterrupted one and
  training on it gives the uninterrupted run's metrics (loss rtol 1e-6) and
  head. Mutations caught: ``meta.json`` written in place (a torn counter
  crashes the rerun), the counter recorded before its batch's rows."""
  want = world.reference("features", lambda d: _train_args(world, d, *_CACHED),
                         "features/meta.json")["dir"]
  work = tmp_path / "w"
  args = _train_args(world, work, *_CACHED)
  # meta.json's writes, wherever they go (its temporary, or the file
  # itself in the mutation the test catches).
  tears = [(r"/features/meta\.", 1, None),
           (r"/features/taps\.bin$", 2, 2), (r"/features/meta\.", 1, 2),
           (r"/features/in_vocab\.bin$", 2, 4)]
  for path, nth, done in tears:
    rc, _, err = world.run(args, tear=dict(path=path, nth=nth))
    _survived(rc, err, killed=True)
    assert _assert_done_rows_agree(work / "features", want / "features"
                                   ) == done
  rc, out, err = world.run(args)
  _survived(rc, err, killed=False)
  assert rc == 0 and json.loads(out.splitlines()[-1])["step"] == STEPS
  _assert_cached_run_agrees(work, want)


def test_feature_cache_build_killed_at_random_times_resumes(world, tmp_path):
  """Invariants: the feature-cache build (16 batches) SIGKILLed from
  outside at three points drawn from a seeded RNG (1 to 5 batches into the
  run, then a uniform part of a batch: the target forward, the ``pwrite``
  and ``fsync`` of its rows, the counter's replace) never crashes a rerun; after each
  kill meta.json is whole and the rows it counts are the uninterrupted
  build's bytes; the cache ends byte for byte the uninterrupted one, and
  training on it gives the uninterrupted run's metrics and head."""
  ref = world.reference("features", lambda d: _train_args(world, d, *_CACHED),
                        "features/meta.json")
  want, work = ref["dir"], tmp_path / "w"
  outcomes = _random_kills(
      world, _train_args(world, work, *_CACHED), work / "features" /
      "meta.json", ref["gap"], seed=7, most=5,
      check=lambda: (_assert_metrics_agree(work, want),
                     _assert_done_rows_agree(work / "features",
                                             want / "features"))[1])
  _assert_cached_run_agrees(work, want)
  print(f"outside kills (exit, rows done): {outcomes}")


_TIMINGS = ("tokens_per_s", "ar_tokens_per_s", "speedup", "predicted_speedup",
            "speedup_vs_predicted", "time_split", "ttft_ms", "costs_ms",
            "git_sha")


def _records(journal: pathlib.Path) -> dict:
  """The journal's readable records, ``{(repeat, batch): [runs without
  their timings]}``; asserts none is there twice."""
  out = {}
  for rec in _lines(journal):
    where = rec["repeat"], rec["batch"]
    assert where not in out, f"batch {where} recorded twice"
    out[where] = [{k: v for k, v in r.items()
                   if k not in ("wall_s", "compile_s")} for r in rec["runs"]]
  return out


def test_bench_journal_killed_resumes_the_same_rows(world, tmp_path):
  """Invariants: ``specjax bench --journal`` (8 prompts, batch 1: 8 records
  of AR + n-gram) killed mid-append -- batch 1's record torn in a fresh
  run, then the first record appended after that torn line, then the
  second one of a third run -- never crashes a rerun; after each kill
  every readable record is the uninterrupted run's
  (same tokens, steps, acceptance), each batch is there once, and a kill
  at a run's n-th append leaves its n - 1 earlier ones readable; the final
  result row equals the uninterrupted one in everything but timings.
  Mutation caught: appending without first ending a torn last line glues
  the next record to it and loses it."""
  make = lambda d: ["bench", "--model", world.model, "--method", "ngram",
                    "--num-draft", 3, "--dataset", world.prompts,
                    "--max-new-tokens", 16, "--journal", d / "bench.journal"]
  ref = world.reference("bench", make, "bench.journal")
  want = _records(ref["dir"] / "bench.journal")
  assert len(want) == 8
  work = tmp_path / "w"
  work.mkdir()
  journal = work / "bench.journal"
  args = make(work)
  have = 0
  for nth, new in ((2, 1), (2, 1), (3, 2)):
    rc, _, err = world.run(args, tear=dict(path=r"/bench\.journal$",
                                           nth=nth))
    _survived(rc, err, killed=True)
    got = _records(journal)
    assert len(got) == have + new and all(got[k] == want[k] for k in got)
    have = len(got)
  rc, out, err = world.run(args)
  _survived(rc, err, killed=False)
  assert rc == 0 and _records(journal) == want
  [row], [ref_row] = ([json.loads(l) for l in o.splitlines()
                       if l.startswith("{")] for o in (out, ref["out"]))
  assert {k: v for k, v in row.items() if k not in _TIMINGS} == {
      k: v for k, v in ref_row.items() if k not in _TIMINGS}
  assert row["greedy_identical"] is True


def test_bench_journal_killed_at_random_times_resumes(world, tmp_path):
  """Invariants: ``specjax bench --journal`` SIGKILLed from outside at three
  points drawn from a seeded RNG (1 or 2 appends into the run, then a
  uniform part of a batch: AR and n-gram decoding, the append) never
  crashes a rerun; after each kill every readable record is the
  uninterrupted run's, each batch once, and no rerun loses one; the
  journal ends holding exactly the uninterrupted run's records."""
  make = lambda d: ["bench", "--model", world.model, "--method", "ngram",
                    "--num-draft", 3, "--dataset", world.prompts,
                    "--max-new-tokens", 16, "--journal", d / "bench.journal"]
  ref = world.reference("bench", make, "bench.journal")
  want = _records(ref["dir"] / "bench.journal")
  work = tmp_path / "w"
  work.mkdir()
  counts = [0]

  def check():
    got = _records(work / "bench.journal")
    assert len(got) >= counts[-1] and all(got[k] == want[k] for k in got)
    counts.append(len(got))
    return len(got)
  outcomes = _random_kills(world, make(work), work / "bench.journal",
                           ref["gap"], seed=11, check=check)
  assert _records(work / "bench.journal") == want
  print(f"outside kills (exit, records): {outcomes}")


def test_a_sweep_trains_each_point_and_resumes_each(world, tmp_path):
  """Invariants: ``specjax train --sweep`` trains one run per point of the
  file's ``get_sweep()`` in ``WORKDIR/NAME`` (the command line's overrides
  under each point's), each recording its point; a killed sweep's rerun
  leaves the finished points as they are and finishes the rest with the
  losses an uninterrupted one has; a rerun whose overrides change what the
  points train is refused, naming a point's directory, before anything
  trains."""
  sweep = tmp_path / "sweep.py"
  sweep.write_text(
      "import runpy\n"
      f"get_config = runpy.run_path({str(world.config)!r})['get_config']\n"
      "def get_sweep():\n"
      "  return [{'optim.lr': 1e-3}, {'optim.lr': 3e-3, 'seed': 1}]\n")
  work = tmp_path / "w"
  args = ["train", "--config", sweep, "--workdir", work, "--sweep",
          "--config.steps=4", "--config.log_every=1"]
  rc, out, err = world.run(args)
  assert rc == 0, err[-3000:]
  names = ["00-optim.lr=0.001", "01-optim.lr=0.003,seed=1"]
  assert sorted(p.name for p in work.iterdir()) == names
  for name, (lr, seed) in zip(names, ((1e-3, 0), (3e-3, 1))):
    saved = json.loads((work / name / "config.json").read_text())
    assert (saved["optim"]["lr"], saved["seed"], saved["steps"]) == (
        lr, seed, 4)
    start = _lines(work / name / "provenance.jsonl")[-1]
    assert start["sweep_point"] == ({"optim.lr": lr, "seed": 1} if seed
                                    else {"optim.lr": lr})
  want = {n: _lines(work / n / "metrics.jsonl") for n in names}
  assert [len(v) for v in want.values()] == [4, 4]
  assert want[names[0]][-1]["loss"] != want[names[1]][-1]["loss"]
  # Killed after the first point ended: the rerun finishes the second.
  again = tmp_path / "again"
  again_args = [again if a == work else a for a in args]
  done = lambda: (again / names[1] / "metrics.jsonl").is_file()
  rc, _, _ = world.run(again_args, kill_when=done)
  rc, out, err = world.run(again_args)
  assert rc == 0, err[-3000:]
  for n in names:
    loss = lambda rows: [(r["step"], r["loss"]) for r in rows]
    assert loss(_lines(again / n / "metrics.jsonl")) == loss(want[n])
  rc, out, err = world.run([*args, "--config.optim.warmup=3"])
  assert rc == 2 and "00-optim.lr=0.001" in err and (
      "optim.warmup 2 -> 3" in err), err
  assert [len(_lines(work / n / "metrics.jsonl")) for n in names] == [4, 4]
