"""A GPU lease, planned before it comes: which device call carries
which part of the kit, what each runs, how long each should take, and
whether the whole sequence fits the lease with time to spare.

A lease is 15 minutes of device time counted from the asking for a machine
until it is given back, idle or busy; a command runs at most 10 minutes and
carries at most 64 MiB (working tree included); the machine goes back after
~30 s idle, so the calls are made back to back. ``DEVICE_S`` states what each
phase is expected to cost on the H200; a lease's log (``first_contact.json``
and ``result.json`` timings) replaces the guesses with measurements.
"""

from __future__ import annotations

import dataclasses

MIB = 1 << 20
LEASE_S = 900  # device time of a session
SPARE_S = 90  # never planned: a slow start or a retried call
COMMAND_S = 600  # one command's limit
CALL_BYTES = 64 * MIB  # working tree + carried paths, per call
MIN_TRAIN_S = 120  # a lease that leaves less for training is not worth it
TIMEOUT_MARGIN_S = 30  # timeout_s above what a command plans to take

# Seconds on the device, stated (no lease has measured them yet): the
# README's "a minute or more" to start, XLA GPU compiles of seconds each.
DEVICE_S = dict(
    start=90,  # a fresh machine, from the asking
    gap=20,  # from one reply to the next call
    transfer_per_mib=0.2,  # the tree and the carried part, every call
    first_contact=45,  # versions, backend, wheels, imports, smoke child
    cost_curve=100,  # 48 programs lowered, compiled on 16 threads, timed
    probe=90,  # random SmolLM2: features + TTT step compiled, 8 steps, score
    check=5,  # sha256 of a part
    unpack=20,  # join ~100 MB, extract, pip install the wheels
    load=15,  # the target's GGUF, the data
    warmup=20,  # 3 steps of the real run: trace + persistent-cache hits
    score=40,  # held-out scoring at K = 7 (cached compiles), export, writes
    decode=150,  # AR vs EAGLE-3 chain and trees, bf16, batch 1 and 8
    give_back=10,
)


@dataclasses.dataclass(frozen=True)
class Call:
  """One device call: carry, command, timeout (None for the last: B + the
  margin) and the seconds it should run (the command's own work, without
  start or transfer)."""
  n: int
  role: str
  carry: tuple[str, ...]
  command: str
  timeout_s: int | None
  expect_s: float


def command(role: str, platform: str = "cuda", extra: str = "") -> str:
  """The shell command of a call: output unbuffered and teed into $OUT (the
  whole log comes back even when the command is cut), JAX held to
  ``platform`` (a CUDA plugin that fails must not fall back to the CPU)."""
  kit = f"JAX_PLATFORMS={platform} python3 -m benchmarks.gpu"
  if role == "check":
    return f"{kit} check"
  args = {"first": "first --out $OUT", "train": "train --out $OUT --budget B"
          }[role]
  return (f"set -o pipefail; PYTHONUNBUFFERED=1 {kit} {args}"
          f"{' ' + extra if extra else ''} 2>&1 | tee $OUT/{role}.log")


def calls(parts: list[int], platform: str = "cuda",
          extra: dict | None = None, costs: dict = DEVICE_S) -> list[Call]:
  """The call sequence for parts of ``parts`` bytes: call 1 first contact
  (carrying part 1, whose loose wheels it needs), then one ``check`` call
  per middle part, then ``train`` with the last. A one-part kit still makes
  two calls: first contact must not wait for training."""
  extra = extra or {}
  n = len(parts)
  seq = [Call(1, "first", (".devkit/p1",), command(
      "first", platform, extra.get("first", "")), 0, sum(
          costs[k] for k in ("first_contact", "cost_curve", "probe")))]
  for i in range(2, n):
    seq.append(Call(i, "check", (f".devkit/p{i}",),
                    command("check", platform), 0, costs["check"]))
  last = (f".devkit/p{n}",) if n > 1 else ()
  seq.append(Call(max(n, 2), "train", last, command(
      "train", platform, extra.get("train", "")), 0, 0.0))
  # Twice the stated time: a stated cost is a guess, a cut call returns
  # only what it wrote. The last call's timeout (None here) is B + the
  # margin, B read off the reply before it (last_budget_rule).
  return [dataclasses.replace(c, timeout_s=None if c.role == "train" else int(
      min(2 * c.expect_s + TIMEOUT_MARGIN_S, COMMAND_S - TIMEOUT_MARGIN_S)))
          for c in seq]


def time_plan(parts: list[int], tree: int, costs: dict = DEVICE_S) -> dict:
  """Seconds of each call (start, transfer, command, gap) and what is left
  for training in the last: the lease minus the spare and everything else,
  capped so the last command fits its own limit. ``ok`` is False, with
  ``problems`` saying why, when a call carries too much, a command
  outlasts its limit, or training gets under ``MIN_TRAIN_S``."""
  seq = calls(parts, costs=costs)
  problems, rows, spent = [], [], 0.0
  for c, size in zip(seq, _carried(parts, len(seq))):
    carried = tree + size
    if carried > CALL_BYTES:
      problems.append(f"call {c.n} carries {carried / MIB:.1f} MiB (tree "
                      f"{tree / MIB:.1f} + part {size / MIB:.1f}) > 64 MiB")
    if c.expect_s > COMMAND_S - TIMEOUT_MARGIN_S:
      problems.append(f"call {c.n} ({c.role}) expects {c.expect_s:.0f} s, "
                      f"over a command's {COMMAND_S} s less the margin")
    wait = costs["start"] if c.n == 1 else costs["gap"]
    s = wait + carried / MIB * costs["transfer_per_mib"] + c.expect_s
    rows.append(dict(n=c.n, role=c.role, carried_mib=round(carried / MIB, 1),
                     seconds=round(s, 1)))
    spent += s
  fixed = sum(costs[k] for k in ("unpack", "load", "warmup", "score",
                                  "decode"))
  left = LEASE_S - SPARE_S - spent - costs["give_back"] - fixed
  train_s = max(min(left, COMMAND_S - TIMEOUT_MARGIN_S - fixed), 0.0)
  if train_s < MIN_TRAIN_S:
    problems.append(f"{train_s:.0f} s left for training < {MIN_TRAIN_S} s")
  rows[-1]["seconds"] = round(rows[-1]["seconds"] + fixed + train_s, 1)
  planned = spent + fixed + train_s + costs["give_back"]
  return dict(ok=not problems, problems=problems, calls=rows,
              planned_s=round(planned, 1), spare_s=round(LEASE_S - planned, 1),
              train_s=round(train_s, 1), budget_s=round(fixed + train_s, 1))


def _carried(parts: list[int], ncalls: int) -> list[int]:
  """Bytes of the part each call carries (a one-part kit: none on the last)."""
  return [parts[i] if i < len(parts) else 0 for i in range(ncalls)]


def last_budget_rule() -> str:
  """How to size the last call from the reply before it."""
  after = SPARE_S + DEVICE_S["gap"] + DEVICE_S["give_back"] + 30
  return (f"B = min({COMMAND_S - TIMEOUT_MARGIN_S}, lease.budget_left_s of "
          f"the reply before - {after}); timeout_s = B + {TIMEOUT_MARGIN_S}")
