"""What a training run depends on, and how a run's config is written.

``TrainConfig`` is frozen and nested: the head trained (``head``), the data
(``data``), the optimizer (``optim``), the training-time test (``ttt``), and
the run's own settings at the top. The trainer reads only this value.

Config files are ml_collections config files, as in Flax's examples: a
Python file whose ``get_config()`` (or ``get_config(arg)``, for
``FILE:ARG``) returns a ``ConfigDict``, usually ``defaults()`` with some
fields set. The command line overrides any field by its dotted path,
``--config.optim.lr=1e-4``, typed by the field (ml_collections' own flag
parser, on a private flag set); a field that does not exist, a value of the
wrong type, or a file that cannot be loaded is one ``ValueError``. A file
may also define ``get_sweep()``: a list of ``{dotted path: value}`` points,
each one run of a sweep (``specjax train --sweep``).

A run records the config it started with (``workdir/config.json``); a resume
whose config differs on anything but the fields in ``FREE_ON_RESUME`` is
refused unless asked for (``config_changes``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import typing
from typing import Any, Mapping, Sequence

from specjax.heads.base import VARIANTS


def _check(obj, group: str, *, positive=(), nonnegative=(), rules=()):
  """Raises ValueError naming ``group.field`` for the first field of
  ``obj`` outside its bound: ``positive`` ints >= 1, ``nonnegative`` ints
  >= 0, ``rules`` (field, predicate, what it must be) for floats."""
  name = lambda f: f"{group}.{f}" if group else f
  for f in positive:
    if getattr(obj, f) < 1:
      raise ValueError(f"{name(f)} must be >= 1, got {getattr(obj, f)}")
  for f in nonnegative:
    if getattr(obj, f) < 0:
      raise ValueError(f"{name(f)} must be >= 0, got {getattr(obj, f)}")
  for f, ok, rule in rules:
    if not ok(getattr(obj, f)):  # NaN fails every rule
      raise ValueError(f"{name(f)} must be {rule}, got {getattr(obj, f)}")


_FINITE_POSITIVE = lambda v: 0 < v < math.inf
_FINITE_NONNEGATIVE = lambda v: 0 <= v < math.inf
_FRACTION = lambda v: 0 <= v <= 1


@dataclasses.dataclass(frozen=True)
class HeadRecipe:
  """The head a run trains and where it starts.

  Attributes:
    variant: "eagle3", "eagle1" (the baseline; full vocabulary), "medusa"
      (``medusa_heads`` residual blocks on the last hidden state), "mtp"
      (DeepSeek-V3's multi-token-prediction module: full vocabulary, the
      target's LM head; for a target that ships none) or "peagle" (an
      EAGLE-3 head drafting a block of K in one forward, trained on
      COD-sampled depths).
    medusa_heads: a Medusa head's depths.
    draft_vocab: Vd, the draft vocabulary's size.
    init_layer: "random" (normal(0.02) layer weights) or "target": an
      EAGLE-3 head's layer starts as the target layer its high tap feeds
      (``train.warm_layer``).
    init_head: a head file (``export.save_head``) or an EAGLE-3 head
      directory in the SpecForge or speculators layout to start from, its
      parameters and draft vocabulary: a run continued on another machine
      (a GPU lease returns the head, not the optimizer state). A P-EAGLE
      run may start from an EAGLE-3 head (``train.block_head``).
    mask_token: a P-EAGLE head's placeholder token (-1: the target's last
      token id).
    cod_ratio: P-EAGLE's COD sampling: depth d trains on a random
      ``cod_ratio ** d`` of the positions (``ttt.steps`` depths).
  """
  variant: str = "eagle3"
  medusa_heads: int = 4
  draft_vocab: int = 16384
  init_layer: str = "random"
  init_head: str = ""
  mask_token: int = -1
  cod_ratio: float = 0.5

  def __post_init__(self):
    if self.variant not in VARIANTS:
      raise ValueError(f"head.variant must be one of {', '.join(VARIANTS)}, "
                       f"got {self.variant!r}")
    if self.init_layer not in ("random", "target"):
      raise ValueError(f"head.init_layer must be random or target, got "
                       f"{self.init_layer!r}")
    if self.init_layer == "target" and self.variant != "eagle3":
      raise ValueError("head.init_layer=target is for EAGLE-3 heads")
    _check(self, "head", positive=("medusa_heads", "draft_vocab"),
           rules=[("cod_ratio", lambda v: 0 < v <= 1, "in (0, 1]")])
    if self.mask_token < -1:
      raise ValueError(f"head.mask_token must be a token id or -1, got "
                       f"{self.mask_token}")
    if self.init_head and not os.path.exists(self.init_head):
      raise ValueError(f"head.init_head: no head file or directory "
                       f"{self.init_head!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What the head trains on.

  Attributes:
    num_conversations: ShareGPT conversations read (before the split).
    heldout: conversations kept out for evaluation.
    max_len: tokens per example (truncated / padded).
    regenerate: 0 trains on the dataset's own replies; N > 0 on the first N
      training conversations with their first reply rewritten by the target
      (``regenerate``; the held-out split is rewritten too).
    regen_temperature, regen_max_new_tokens: how the target writes them.
    feature_cache: 0 runs the target on the fly over the whole training
      split; N > 0 runs it once over the first N training examples, caches
      its outputs in ``workdir/features`` (``features``: bf16, 4.6 KB per
      token slot for SmolLM2) and trains epochs over those N.
  """
  num_conversations: int = 4000
  heldout: int = 64
  max_len: int = 512
  regenerate: int = 0
  regen_temperature: float = 0.7
  regen_max_new_tokens: int = 384
  feature_cache: int = 0

  def __post_init__(self):
    _check(self, "data",
           positive=("num_conversations", "max_len", "regen_max_new_tokens"),
           nonnegative=("heldout", "regenerate", "feature_cache"),
           rules=[("regen_temperature", _FINITE_NONNEGATIVE, ">= 0")])


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Clip, then AdamW with a linear warmup and a cosine decay
  (``train.optimizer``); the compiled step's static argument, so each
  distinct value compiles once and no other setting reaches the step.

  Attributes:
    lr: the peak learning rate.
    warmup: steps of linear warmup from 0.
    final_lr_fraction: the cosine ends at ``lr * final_lr_fraction``.
    weight_decay, b2: AdamW's.
    clip_norm: the global gradient norm clipped to.
  """
  lr: float = 3e-4
  warmup: int = 20
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  clip_norm: float = 0.5
  b2: float = 0.95

  def __post_init__(self):
    _check(self, "optim", nonnegative=("warmup",), rules=[
        ("lr", _FINITE_POSITIVE, "> 0"),
        ("clip_norm", _FINITE_POSITIVE, "> 0"),
        ("weight_decay", _FINITE_NONNEGATIVE, ">= 0"),
        ("b2", _FRACTION, "in [0, 1]"),
        ("final_lr_fraction", _FRACTION, "in [0, 1]")])


@dataclasses.dataclass(frozen=True)
class TTTConfig:
  """The training-time test: how many draft steps each example unrolls.

  Attributes:
    steps: TTT length K (unrolled draft steps).
    warm_steps, warm_fraction: a shorter TTT for the first fraction of the
      run's steps (half the cost per step while the head is far from useful).
    rows_bucket: the LM head runs on a batch's assistant positions rounded
      up to ``batch_size * rows_bucket`` rows (``ttt.loss_rows``); each
      distinct count is one compile. ``data.max_len`` means all rows, one
      compile: the choice where the LM head is cheap and compiles are not
      (GPU).
  """
  steps: int = 7
  warm_steps: int = 3
  warm_fraction: float = 0.0
  rows_bucket: int = 64

  def __post_init__(self):
    _check(self, "ttt", positive=("steps", "warm_steps", "rows_bucket"),
           rules=[("warm_fraction", _FRACTION, "in [0, 1]")])


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a run depends on (module doc).

  Attributes:
    model: target model (name, .gguf or HF dir).
    head, data, optim, ttt: the groups above.
    batch_size: examples per step.
    steps: optimizer steps in total.
    seed: data order and init.
    checkpoint_every, keep: orbax checkpoint cadence and retention;
      ``checkpoint_every = 0`` saves none (a run that cannot be resumed
      anyway, like a GPU lease: only the exported head comes back).
    log_every: metrics cadence.
    mesh: "" trains on one device; ``"data=8"`` or ``"data=4,model=2"``
      (``sharding.make_mesh``) trains data-parallel over the mesh: each
      batch split over ``data``, the frozen target laid out as for decoding
      (tensor-parallel over ``model``), the head and optimizer state
      replicated (XLA all-reduces the gradients). Checkpoints restore onto
      whatever mesh the resuming run has.
    export: layouts, comma-separated, the finished head also goes to, in
      ``workdir/head-FORMAT/`` (``heads.export.export_layout``): an EAGLE-3
      head's ``"specforge"`` and ``"speculators"``, for SGLang/SpecForge
      or vLLM; an MTP module's ``"deepseek"``.
  """
  model: str = "smollm2-135m"
  head: HeadRecipe = dataclasses.field(default_factory=HeadRecipe)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  ttt: TTTConfig = dataclasses.field(default_factory=TTTConfig)
  batch_size: int = 2
  steps: int = 1000
  seed: int = 0
  checkpoint_every: int = 50
  keep: int = 3
  log_every: int = 10
  mesh: str = ""
  export: str = ""

  def __post_init__(self):
    from specjax.heads.export import check_layout
    for fmt in filter(None, self.export.split(",")):
      try:
        check_layout(fmt, self.head.variant)
      except ValueError as e:
        raise ValueError(f"export: {e}") from None
    # keep = 0 would let orbax keep no checkpoint: a rerun would start over.
    if self.keep < 1:
      raise ValueError(f"keep must be >= 1 (checkpoints kept), got "
                       f"{self.keep}; checkpoint_every=0 saves none")
    _check(self, "", positive=("batch_size", "steps", "log_every"),
           nonnegative=("checkpoint_every", "seed"))

  def ttt_at(self, step: int) -> int:
    """The TTT length of optimizer step ``step``."""
    warm = step < int(self.ttt.warm_fraction * self.steps)
    return self.ttt.warm_steps if warm else self.ttt.steps

  def updated(self, values: Mapping[str, Any]) -> "TrainConfig":
    """A copy with the fields ``values`` names by dotted path changed:
    ``cfg.updated({"steps": 4, "optim.lr": 1e-3})``."""
    fields = flat(dataclasses.asdict(self))
    unknown = sorted(set(values) - set(fields))
    if unknown:
      raise ValueError(f"{unknown[0]}: no such field; TrainConfig has "
                       f"{', '.join(fields)}")
    nested: dict = {}
    for path, value in {**fields, **values}.items():
      *groups, name = path.split(".")
      inner = nested
      for g in groups:
        inner = inner.setdefault(g, {})
      inner[name] = value
    return TrainConfig.from_dict(nested)

  @classmethod
  def from_dict(cls, values: Mapping) -> "TrainConfig":
    """The config ``values`` (nested, as ``dataclasses.asdict`` writes it,
    or a ``ConfigDict``) describes; a missing field takes its default. An
    unknown field or a value of the wrong type is a ValueError naming its
    dotted path."""
    if hasattr(values, "to_dict"):  # an ml_collections ConfigDict
      values = values.to_dict()
    return _build(cls, values, "")


def _build(cls, values, path: str):
  if not isinstance(values, Mapping):
    raise ValueError(f"{path or 'the config'} must be a mapping of fields, "
                     f"got {type(values).__name__}")
  kinds = typing.get_type_hints(cls)
  unknown = sorted(set(values) - set(kinds))
  if unknown:
    raise ValueError(f"{path + '.' if path else ''}{unknown[0]}: no such "
                     f"field; {cls.__name__} has {', '.join(kinds)}")
  kw = {}
  for name, value in values.items():
    kind, where = kinds[name], f"{path}.{name}" if path else name
    if dataclasses.is_dataclass(kind):
      kw[name] = _build(kind, value, where)
    elif kind is float and type(value) in (int, float):
      kw[name] = float(value)
    elif type(value) is kind:
      kw[name] = value
    else:
      raise ValueError(f"{where}: {value!r} is not a {kind.__name__}")
  return cls(**kw)


def defaults():
  """An ml_collections ``ConfigDict`` of ``TrainConfig``'s defaults, locked
  (assigning a field it does not have raises): what config files start
  from."""
  import ml_collections
  return ml_collections.ConfigDict(dataclasses.asdict(TrainConfig())).lock()


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A config file read with overrides: ``config`` as a ``ConfigDict``
  (for sweeps), ``train`` the typed ``TrainConfig`` it gives, ``origin``
  what to record (the file, its sha256, the overrides)."""
  config: Any
  train: TrainConfig
  origin: dict


def load(spec: str, overrides: Sequence[str] = ()) -> Loaded:
  """Reads the config file ``spec`` (``PATH`` or ``PATH:ARG``, ARG passed
  to ``get_config``) and applies ``overrides``, each ``--config.PATH=VALUE``
  or ``--config.PATH VALUE``, through ml_collections' flag parser. Raises
  ValueError with one line for anything wrong."""
  from absl import flags
  from ml_collections import config_flags
  path = spec.split(":", 1)[0]
  if not os.path.isfile(path):
    raise ValueError(f"--config {path!r} is not a file")
  _get_config(path)  # a file that cannot give a config fails here, named
  fv = flags.FlagValues()
  argv = ["specjax", f"--config={spec}", *overrides]
  config_flags.DEFINE_config_file("config", None, flag_values=fv,
                                  sys_argv=argv, lock_config=True)
  try:
    rest = fv(argv)
    config = fv.config
  except flags.Error as e:
    raise ValueError(f"--config {spec!r}: {_one_line(e)}") from None
  except (AttributeError, KeyError) as e:  # a path the config lacks
    raise ValueError(f"--config {spec!r}: an override names no field: "
                     f"{_one_line(e)}") from None
  except Exception as e:  # get_config(arg) or an override's assignment
    raise ValueError(f"--config {spec!r}: {type(e).__name__}: "
                     f"{_one_line(e)}") from None
  if rest[1:]:
    raise ValueError(f"unrecognized arguments: {' '.join(rest[1:])}")
  train = _typed(config, spec)
  with open(path, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  return Loaded(config, train, dict(
      config_file=os.path.abspath(path), config_arg=spec[len(path) + 1:],
      config_sha256=digest, overrides=list(overrides)))


def _get_config(path: str):
  """The file's module namespace, checked to define ``get_config``."""
  import runpy
  try:
    module = runpy.run_path(path)
  except Exception as e:
    raise ValueError(f"cannot load --config {path!r}: {type(e).__name__}: "
                     f"{_one_line(e)}") from None
  if not callable(module.get("get_config")):
    raise ValueError(f"--config {path!r} defines no get_config() function "
                     "(an ml_collections config file)")
  return module


def _typed(config, spec: str) -> TrainConfig:
  """The ``TrainConfig`` a loaded ``ConfigDict`` describes."""
  import ml_collections
  if not isinstance(config, (ml_collections.ConfigDict, dict)):
    raise ValueError(f"--config {spec!r}: get_config() must return a "
                     f"ConfigDict (start from specjax.training.config."
                     f"defaults()), got {type(config).__name__}")
  try:
    return TrainConfig.from_dict(config)
  except ValueError as e:
    raise ValueError(_one_line(e)) from None


def sweep(loaded: Loaded, spec: str) -> list[tuple[str, TrainConfig, dict]]:
  """The points of the sweep the file ``spec`` defines (``get_sweep()``: a
  list of ``{dotted path: value}``), each applied over ``loaded.config``
  (the file with the command line's overrides): ``(name, config, point)``,
  the name a directory name unique to the point."""
  module = _get_config(spec.split(":", 1)[0])
  if not callable(module.get("get_sweep")):
    raise ValueError(f"--config {spec!r} defines no get_sweep() function")
  try:
    points = module["get_sweep"]()
  except Exception as e:
    raise ValueError(f"--config {spec!r}: get_sweep() raised "
                     f"{type(e).__name__}: {_one_line(e)}") from None
  if (not isinstance(points, (list, tuple)) or not points
      or not all(isinstance(p, Mapping) for p in points)):
    raise ValueError(f"--config {spec!r}: get_sweep() must return a "
                     "non-empty list of {dotted path: value} dicts")
  out = []
  for i, point in enumerate(points):
    config = copy.deepcopy(loaded.config)
    try:
      config.update_from_flattened_dict(dict(point))
    except Exception as e:
      raise ValueError(f"--config {spec!r}: sweep point {i} {dict(point)!r}: "
                       f"{type(e).__name__}: {_one_line(e)}") from None
    words = ",".join(f"{k}={v}" for k, v in point.items())
    name = f"{i:02d}-" + "".join(c if c.isalnum() or c in "=.,-_" else "_"
                                 for c in words)[:80]
    out.append((name, _typed(config, spec), dict(point)))
  return out


def _one_line(e: Exception) -> str:
  """``e``'s message on one line: the innermost of wrapped exceptions, a
  KeyError's without the quotes its ``str`` adds, of a traceback quoted in
  the message only its last line (what was raised)."""
  while e.args and isinstance(e.args[0], Exception):
    e = e.args[0]
  text = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
  if "Traceback (most recent call last)" in text:
    text = text.strip().splitlines()[-1]
  return " ".join(text.split()) or type(e).__name__


# Fields a resume may change freely: where the run computes (its mesh) and
# its bookkeeping (how often it logs and saves, how many checkpoints it
# keeps, which layouts it exports). Any other field changes what is trained.
FREE_ON_RESUME = frozenset({"mesh", "log_every", "checkpoint_every", "keep",
                            "export"})


class ConfigChanged(ValueError):
  """A resume whose config differs from the run's: ``changes`` maps each
  dotted field to (the run's value, the new one)."""

  def __init__(self, workdir, changes: dict):
    self.workdir, self.changes = str(workdir), changes
    super().__init__(f"{self.summary()}; pass allow_config_change=True to "
                     "go on with the new ones")

  def summary(self) -> str:
    fields = ", ".join(f"{k} {a!r} -> {b!r}"
                       for k, (a, b) in self.changes.items())
    return (f"{self.workdir!r} holds a run started with other settings: "
            f"{fields}")


def flat(values: Mapping, prefix: str = "") -> dict:
  """``{dotted path: value}`` of a nested mapping."""
  out = {}
  for k, v in values.items():
    if isinstance(v, Mapping):
      out.update(flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _renamed() -> dict:
  """Where each field of the flat ``TrainConfig`` that runs before the
  nested one wrote to ``config.json`` lives now: a group's field by its
  own name or with the group's name before it (``ttt_steps``)."""
  top = {f.name for f in dataclasses.fields(TrainConfig)}
  out = {}
  for group in dataclasses.fields(TrainConfig):
    if dataclasses.is_dataclass(group.default_factory):
      for f in dataclasses.fields(group.default_factory):
        for old in (f.name, f"{group.name}_{f.name}"):
          if old not in top:
            out[old] = f"{group.name}.{f.name}"
  return out


def saved(workdir) -> dict | None:
  """``{dotted field: value}`` of the config the run in ``workdir`` started
  with (its ``config.json``), None for a new run. A file written before
  the config nested is read through ``_renamed``."""
  path = pathlib.Path(workdir) / "config.json"
  if not path.is_file():
    return None
  try:
    values = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise ValueError(f"{str(path)!r} is not a run's config: {e}") from None
  if not isinstance(values, dict):
    raise ValueError(f"{str(path)!r} is not a run's config: a JSON "
                     f"{type(values).__name__}")
  renamed = _renamed()
  return {renamed.get(k, k): v for k, v in flat(values).items()}


def run_config(workdir) -> TrainConfig:
  """The config the run in ``workdir`` started with."""
  values = saved(workdir)
  if values is None:
    raise ValueError(f"{str(workdir)!r} holds no run (no config.json)")
  return TrainConfig().updated(values)


def config_changes(cfg: TrainConfig, workdir) -> dict:
  """``{dotted field: (the run's value, cfg's)}`` for each field outside
  ``FREE_ON_RESUME`` on which ``cfg`` differs from the config the run in
  ``workdir`` started with (``saved``); empty for a new run. A field the
  file predates counts as its default."""
  before = saved(workdir)
  if before is None:
    return {}
  defaults = flat(dataclasses.asdict(TrainConfig()))
  return {k: (before.get(k, defaults[k]), v)
          for k, v in flat(dataclasses.asdict(cfg)).items()
          if k not in FREE_ON_RESUME and before.get(k, defaults[k]) != v}
