"""Decoding methods by name: what the CLI, the benchmarks and the tuner share.

A method is written in one grammar, ``NAME[:key=value...]`` (``KNOBS``),
parsed once into a ``MethodSpec`` that checks its values. Each method has
its own frozen config (``_OWN``: ``_NGram``, ``_Head``, ...): the spec's
fields it reads, so which method reads which knob is one table derived
from them (``readers``), the rules between its knobs, and how it builds its
drafter. ``build`` turns a spec into the ``Method`` (drafter, parameters,
K, tree nodes) the engine takes; bad combinations raise ``MethodError``
with a one-line message the CLI prints as is.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Optional

if TYPE_CHECKING:
  from specjax.drafters.base import Method
  from specjax.models.registry import Model

METHODS = ("ar", "ngram", "draft", "layerskip", "retrieval", "ngram+retrieval",
           "lookahead", "clasp", "eagle", "eagle3", "medusa", "mtp", "peagle")
# Methods that draft with a trained head, and the head variant each loads.
HEADS = {"eagle": "eagle1", "eagle3": "eagle3", "medusa": "medusa",
         "mtp": "mtp", "peagle": "peagle"}
# Heads shipped inside the package, by (target model name, method).
SHIPPED_HEADS = {("smollm2-135m", "eagle3"): "heads/smollm2-135m-eagle3.npz",
                 ("smollm2-135m", "medusa"): "heads/smollm2-135m-medusa.npz"}


class MethodError(ValueError):
  """A method name or knob that cannot work with this model."""


# The method grammar, ``NAME[:key=value...]`` (e.g. ``eagle3:k=5:shape=2x2x1:
# lookup=8``): each key and the ``MethodSpec`` field it sets.
KNOBS = {"k": "num_draft", "nodes": "tree_nodes", "width": "tree_width",
         "shape": "tree_shape", "lookup": "lookup_nodes", "layers": "layers",
         "conf": "min_confidence", "draft": "draft_model", "head": "head",
         "conversations": "datastore_conversations", "window": "window",
         "levels": "levels", "refresh": "refresh", "pearl": "pearl"}


def parse_knobs(text: str) -> tuple[str, dict]:
  """``(name, {field: value})`` of a method in the grammar (``KNOBS``),
  each value typed as its field; ``MethodError`` names what is wrong."""
  name, *knobs = text.strip().split(":")
  if name not in METHODS:
    where = f" in {text!r}" if knobs else ""
    raise MethodError(f"unknown method {name!r}{where} (choose from "
                      f"{', '.join(METHODS)})")
  kinds = _field_kinds()
  fields = {}
  for knob in knobs:
    key, sep, value = knob.partition("=")
    if not sep or key not in KNOBS:
      raise MethodError(f"method {text!r}: expected key=value with key one "
                        f"of {', '.join(KNOBS)}, got {knob!r}")
    if KNOBS[key] in fields:
      raise MethodError(f"method {text!r}: {key} given twice")
    users = readers(KNOBS[key])
    if name not in users:
      raise MethodError(f"method {text!r}: {key} is for "
                        f"{', '.join(sorted(users))}; {name} would ignore it")
    kind = kinds[KNOBS[key]]
    try:
      fields[KNOBS[key]] = kind(value)
    except ValueError:
      what = {int: "an integer", float: "a number"}[kind]
      raise MethodError(f"method {text!r}: {key} must be {what}, got "
                        f"{value!r}") from None
  return name, fields


def readers(field: str) -> frozenset:
  """The methods that read the ``MethodSpec`` field ``field`` (their own
  config's ``READS``, ``_OWN``): a knob is refused for any other."""
  return frozenset(name for name, own in _OWN.items() if field in own.READS)


def knobs_of(name: str) -> list[str]:
  """The grammar's keys (``KNOBS``) the method ``name`` reads."""
  return [key for key, field in KNOBS.items() if name in readers(field)]


def _field_kinds() -> dict:
  """Each ``MethodSpec`` field's value type (``Optional[int]`` -> int)."""
  import typing
  hints = typing.get_type_hints(MethodSpec)
  return {f: next((a for a in typing.get_args(t) if a is not type(None)), t)
          for f, t in hints.items()}


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  """A method and its knobs.

  Attributes:
    name: one of ``METHODS``.
    num_draft: K, drafts per verify step (ignored for "ar").
    layers: layer-skip depth, or the layers a CLaSp draft runs (None = 80%
      of the target's layers, rounded).
    refresh: "clasp": steps between two choices of the skipped layers.
    min_confidence: dynamic K threshold for model and EAGLE drafters
      (0 = fixed K).
    draft_model: the "draft" method's model (a name, .gguf or HF dir).
    datastore_conversations: ShareGPT conversations behind "retrieval" and
      "ngram+retrieval".
    head: the "eagle" (EAGLE-1) / "eagle3" / "medusa" / "mtp" / "peagle" head
      file or directory (None = the one shipped for the model).
    tree_nodes: 0 for chains; else draft trees of up to this many nodes,
      ``num_draft`` deep (drafters with ``propose_tree``: "ngram",
      "retrieval", "ngram+retrieval", "lookahead", "clasp", "eagle",
      "eagle3", "mtp", and "medusa" with a ``tree_shape``).
    tree_width: a tree's branching: n-gram matches merged into the trie,
      or EAGLE's and CLaSp's top-k per expanded node and nodes expanded
      per level.
    tree_shape: EAGLE and Medusa heads: a static tree (``tree.parse_shape``:
      ``"2x2x1"`` or rank paths); it sets ``tree_nodes`` and ``num_draft``.
    window: "lookahead": the Jacobi window's columns W. The method drafts
      trees only: ``tree_nodes`` 0 means ``num_draft * tree_width``.
    levels: "lookahead": the window's levels L, at most ``num_draft``; its
      n-grams are L + 1 tokens (0: ``num_draft``). Fewer levels than the
      trie's depth keep the verify narrow while the context's matches
      still draft ``num_draft`` deep.
    pearl: 1: draft while verifying (PEARL, ``core.pearl``): chains of
      "draft", "layerskip" and "ngram", which read only tokens, and of
      "peagle", whose block drafts behind unscored tokens.
    lookup_nodes: EAGLE and Medusa trees: this many of the ``tree_nodes``
      come from the n-gram-then-retrieval trie ("ngram+retrieval"), merged
      with the head's tree (``drafters.union``); with a ``tree_shape`` they
      come on top of its nodes, and ``num_draft`` (at least the shape's
      depth) bounds the trie's.
  """
  name: str = "ar"
  num_draft: int = 4
  layers: Optional[int] = None
  min_confidence: float = 0.0
  draft_model: Optional[str] = None
  datastore_conversations: Optional[int] = None
  head: Optional[str] = None
  tree_nodes: int = 0
  tree_width: int = 4
  tree_shape: str = ""
  lookup_nodes: int = 0
  window: int = 4
  levels: int = 0
  refresh: int = 1
  pearl: int = 0

  def __post_init__(self):
    from specjax.core.sampling import require_int
    if self.name not in METHODS:
      raise MethodError(f"unknown method {self.name!r} (choose from "
                        f"{', '.join(METHODS)})")
    for field in ("num_draft", "tree_nodes", "tree_width", "lookup_nodes",
                  "window", "levels", "refresh", "pearl"):
      require_int(field, getattr(self, field))
    if not isinstance(self.min_confidence, (int, float)) or isinstance(
        self.min_confidence, bool):
      raise TypeError(f"min_confidence must be a number, got "
                      f"{self.min_confidence!r}")
    for field, ok, rule in (
        ("num_draft", self.name == "ar" or self.num_draft >= 1, ">= 1"),
        ("tree_nodes", self.tree_nodes >= 0, ">= 0"),
        ("tree_width", self.tree_width >= 1, ">= 1"),
        ("lookup_nodes", self.lookup_nodes >= 0, ">= 0"),
        ("window", self.window >= 1, ">= 1"),
        ("levels", 0 <= self.levels <= max(self.num_draft, 1),
         f"in [0, num_draft={self.num_draft}]"),
        ("refresh", self.refresh >= 1, ">= 1"),
        ("pearl", self.pearl in (0, 1), "0 or 1"),
        ("min_confidence", 0 <= self.min_confidence < 1, "in [0, 1)")):
      if not ok:  # NaN fails its rule
        raise MethodError(f"{field} must be {rule}, got "
                          f"{getattr(self, field)}")
    if self.name == "lookahead" and not self.tree_nodes:
      object.__setattr__(self, "tree_nodes", self.num_draft * self.tree_width)
    if self.tree_shape:  # the shape fixes the node count and the depth
      from specjax.core import tree
      try:
        shape = tree.Shape(tree.parse_shape(self.tree_shape))
      except ValueError as e:
        raise MethodError(str(e)) from None
      nodes = shape.num_nodes + self.lookup_nodes
      if self.tree_nodes not in (0, nodes):
        raise MethodError(f"tree_nodes {self.tree_nodes} disagrees with "
                          f"tree_shape {self.tree_shape!r} ({nodes} nodes "
                          f"with the lookup's); give one of them")
      object.__setattr__(self, "tree_nodes", nodes)
      object.__setattr__(self, "num_draft", max(
          shape.max_depth, self.num_draft if self.lookup_nodes > 0 else 0))

  @classmethod
  def parse(cls, text: str) -> "MethodSpec":
    """The spec written ``text`` in the method grammar (``KNOBS``)."""
    name, fields = parse_knobs(text)
    return cls(name=name, **fields)

  def text(self) -> str:
    """This spec in the method grammar: its name and each knob that differs
    from the default (``MethodSpec.parse(spec.text()) == spec``)."""
    parts = [self.name]
    for key, field in KNOBS.items():
      value = getattr(self, field)
      if value != getattr(MethodSpec, field):
        if ":" in str(value):
          raise MethodError(f"{field} {value!r} holds a ':', which the "
                            "method grammar cannot write")
        parts.append(f"{key}={value}")
    return ":".join(parts)

  @property
  def k(self) -> int:
    return 0 if self.name == "ar" else self.num_draft

  @property
  def block(self) -> int:
    """Tokens one verify forward scores (``engine.block_width``)."""
    from specjax.core.engine import block_width
    return block_width(self.k, self.tree_nodes if self.k else 0)

  def label(self) -> str:
    if self.name == "ar":
      return self.name
    tree = (f", tree {self.tree_shape}" if self.tree_shape else
            f", tree {self.tree_nodes}" if self.tree_nodes else "")
    lookup = f", lookup {self.lookup_nodes}" if self.lookup_nodes else ""
    pearl = ", PEARL" if self.pearl else ""
    return f"{self.name}(K={self.k}{tree}{lookup}{pearl})"


def default_layers(model: Model) -> int:
  return max(1, min(model.config.num_layers - 1,
                    round(0.8 * model.config.num_layers)))


def build(model: Model, spec: MethodSpec) -> Method:
  """The ``Method`` (drafter, its parameters, K, tree nodes) ``spec``
  names, on the target ``model``: the method's own config (``_OWN``)
  checks what only it can, then builds its drafter."""
  own = _OWN[spec.name](spec)
  own.check()
  drafter, params = own.build(model)
  from specjax.drafters.base import AR, Method
  if drafter is None:
    return AR
  return Method(drafter, params, spec.k, spec.tree_nodes,
                pearl=bool(spec.pearl))


# Each method's own config: the ``MethodSpec`` fields it reads (``READS``:
# a field not there is one the method would ignore; they read through to
# the spec), the rules between them, and how it builds its drafter. A field
# the method does not read but the spec sets is refused by ``check``.
@dataclasses.dataclass(frozen=True)
class _Own:
  spec: MethodSpec
  READS: ClassVar[frozenset] = frozenset()

  def __getattr__(self, field: str):
    if field == "name" or field in self.READS:
      return getattr(self.spec, field)
    raise AttributeError(f"{type(self).__name__} does not read {field}")

  def check(self) -> None:
    """Refuses what this method would ignore or cannot draft."""
    mine = self.READS
    if self.spec.tree_shape and "tree_shape" not in mine:
      raise MethodError(f"tree_shape is for EAGLE, MTP and Medusa heads "
                        f"(eagle, eagle3, mtp, medusa), not {self.name}")
    if self.spec.tree_nodes and "tree_nodes" not in mine:
      trees = [m for m in METHODS if m in readers("tree_nodes")]
      raise MethodError(f"method {self.name} drafts chains only; trees "
                        f"(tree_nodes) work with: {', '.join(trees)}")
    if self.spec.lookup_nodes and "lookup_nodes" not in mine:
      raise MethodError(f"lookup_nodes merges the n-gram/retrieval trie "
                        f"into a head's tree (eagle, eagle3, mtp, medusa), not "
                        f"{self.name}'s; for the trie alone use method "
                        "ngram+retrieval")
    if self.spec.min_confidence and (self.spec.tree_nodes
                                     or "min_confidence" not in mine):
      raise MethodError(
          f"min_confidence (dynamic K) is for chains of "
          f"{', '.join(DYNAMIC_K)}; {self.spec.label()} would ignore it")
    if self.spec.pearl and self.spec.tree_nodes:
      raise MethodError(f"pearl drafts chains; {self.spec.label()} is a "
                        "tree")
    if self.spec.tree_width != _DEFAULT_WIDTH and not self.widens():
      raise MethodError(
          f"tree_width is for dynamic trees and a head's lookup trie "
          f"({', '.join(sorted(readers('tree_width')))}); "
          f"{self.spec.label()} would ignore it")

  def widens(self) -> bool:
    """Whether ``tree_width`` shapes this method's trees."""
    return False

  def build(self, model: Model) -> tuple[Any, Any]:
    raise NotImplementedError


class _AR(_Own):
  """No drafter: the knobs a list of methods shares (``bench``) are
  nothing to it."""

  def check(self):
    pass

  def build(self, model):
    return None, None


class _NGram(_Own):
  READS = frozenset({"num_draft", "tree_nodes", "tree_width", "pearl"})

  def widens(self):
    return bool(self.tree_nodes)

  def build(self, model):
    from specjax.drafters import NGramDrafter
    return NGramDrafter(num_paths=self.tree_width), None


class _Retrieval(_Own):
  READS = frozenset({"num_draft", "tree_nodes", "datastore_conversations"})

  def build(self, model):
    from specjax.drafters import RetrievalDrafter
    return RetrievalDrafter(), _datastore(model, self.datastore_conversations)


class _Lookup(_Own):
  """"ngram+retrieval": n-gram with ``tree_width`` matches, then the
  datastore."""
  READS = frozenset({"num_draft", "tree_nodes", "tree_width",
                     "datastore_conversations"})

  def widens(self):
    return bool(self.tree_nodes)

  def build(self, model):
    return _lookup(model, self.tree_width, self.datastore_conversations)


class _Lookahead(_Own):
  """Jacobi iteration's n-grams and the row's own context: a trie beside
  the window the target scores in the same forward."""
  READS = frozenset({"num_draft", "tree_nodes", "tree_width", "window",
                     "levels"})

  def widens(self):
    return True

  def build(self, model):
    from specjax.drafters import LookaheadDrafter, NGramDrafter
    return LookaheadDrafter(window=self.window, levels=self.levels or None,
                            width=self.tree_width,
                            context=NGramDrafter(num_paths=self.tree_width)
                            ), None


class _DraftModel(_Own):
  READS = frozenset({"num_draft", "min_confidence", "draft_model", "pearl"})

  def build(self, model):
    return _draft_model(model, self.draft_model, self.min_confidence)


class _LayerSkip(_Own):
  READS = frozenset({"num_draft", "min_confidence", "layers", "pearl"})

  def build(self, model):
    from specjax.drafters import LayerSkipDrafter
    layers = self.layers if self.layers is not None else default_layers(model)
    try:
      return (LayerSkipDrafter.from_target(model.target, layers,
                                           self.min_confidence), model.params)
    except ValueError as e:
      raise MethodError(str(e)) from None


class _Clasp(_Own):
  """The target drafting with the layers a dynamic programme skips."""
  READS = frozenset({"num_draft", "tree_nodes", "tree_width",
                     "min_confidence", "layers", "refresh"})

  def widens(self):
    return True

  def build(self, model):
    from specjax.drafters import ClaspDrafter
    layers = self.layers if self.layers is not None else default_layers(model)
    try:
      return (ClaspDrafter.from_target(
          model.target, layers, self.refresh, self.min_confidence,
          self.tree_width), model.params)
    except ValueError as e:
      raise MethodError(str(e)) from None


class _Head(_Own):
  """"eagle" (EAGLE-1), "eagle3", "medusa", "mtp": a trained head (an MTP
  module: one a checkpoint ships or one specjax trained), chains or trees,
  its trees merged with the lookup trie by ``lookup_nodes``."""
  READS = frozenset({"num_draft", "tree_nodes", "tree_width", "tree_shape",
                     "lookup_nodes", "min_confidence", "head",
                     "datastore_conversations"})

  def widens(self):
    return bool(self.tree_nodes) and bool(
        self.lookup_nodes or (self.name != "medusa" and not self.tree_shape))

  def check(self):
    super().check()
    if self.lookup_nodes and self.tree_nodes <= self.lookup_nodes:
      raise MethodError(f"lookup_nodes {self.lookup_nodes} must leave the "
                        f"head some of the tree's nodes (tree_nodes "
                        f"{self.tree_nodes} counts both)")
    if self.name == "medusa" and self.tree_nodes and not self.tree_shape:
      raise MethodError("Medusa trees are static: give tree_shape (e.g. "
                        "2x2x1) instead of tree_nodes")
    if self.name == "peagle" and self.tree_shape:
      raise MethodError("peagle's trees come from its block's marginals: "
                        "give tree_nodes and tree_width, not tree_shape")

  def build(self, model):
    built = _head(model, self)
    if not self.lookup_nodes:
      return built
    from specjax.drafters.union import TreeUnion, UnionParams
    table, store = _lookup(model, self.tree_width,
                           self.datastore_conversations)
    return (TreeUnion(built[0], table, self.lookup_nodes),
            UnionParams(head=built[1], table=store))


class _PEagle(_Head):
  """"peagle": a P-EAGLE block head, which also drafts behind PEARL's
  pending drafts (``pearl``)."""
  READS = _Head.READS | {"pearl"}


_OWN = {"ar": _AR, "ngram": _NGram, "draft": _DraftModel,
        "layerskip": _LayerSkip, "retrieval": _Retrieval,
        "ngram+retrieval": _Lookup, "lookahead": _Lookahead, "clasp": _Clasp,
        "eagle": _Head, "eagle3": _Head, "medusa": _Head, "mtp": _Head,
        "peagle": _PEagle}
# The drafters that stop a chain early on their own confidence (dynamic K).
DYNAMIC_K = tuple(m for m in METHODS if m in readers("min_confidence"))
_DEFAULT_WIDTH = MethodSpec.tree_width


def _lookup(model: Model, width: int, conversations: Optional[int]):
  """The "ngram+retrieval" trie's drafter (n-gram with ``width`` matches,
  then the datastore) and its datastore."""
  from specjax.drafters import LookupDrafter, NGramDrafter
  return (LookupDrafter(ngram=NGramDrafter(num_paths=width)),
          _datastore(model, conversations))


def _datastore(model: Model, conversations: Optional[int]):
  """The ShareGPT datastore "retrieval" reads (``conversations`` of them,
  None: its default): built (or loaded from ~/.cache/specjax) once, then
  kept on the device."""
  import jax
  from specjax.drafters.retrieval import sharegpt_datastore
  kw = ({} if conversations is None
        else dict(num_conversations=conversations))
  return jax.device_put(sharegpt_datastore(model.tokenizer, **kw))


def _draft_model(model: Model, name: Optional[str], min_confidence: float):
  """The "draft" method: the model ``name``, checked to share the
  target's tokenizer."""
  from specjax.drafters import DraftModelDrafter
  from specjax.models.registry import load_model
  if not name:
    raise MethodError("method draft needs draft_model (a .gguf file or HF "
                      "dir whose tokenizer matches the target's)")
  try:
    draft = load_model(name)
  except (ValueError, OSError, RuntimeError) as e:
    raise MethodError(f"cannot load draft model {name!r}: {e}"
                      ) from None
  if draft.config.vocab_size != model.config.vocab_size:
    raise MethodError(
        f"draft model {name!r} has vocab {draft.config.vocab_size}"
        f", the target has {model.config.vocab_size}: they must share a "
        "tokenizer")
  ours = model.tokenizer.token_strings()
  theirs = draft.tokenizer.token_strings()
  if ours != theirs:
    i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    raise MethodError(f"draft model {name!r}: token {i} is "
                      f"{theirs[i]!r}, the target's is {ours[i]!r}: they "
                      "must share a tokenizer")
  probe = "The quick brown fox, 12345 déjà vu!\n"
  if draft.tokenizer.encode(probe) != model.tokenizer.encode(probe):
    raise MethodError(f"draft model {name!r} tokenizes text "
                      "differently from the target: they must share a "
                      "tokenizer")
  try:
    drafter = DraftModelDrafter(draft.target, min_confidence)
  except ValueError as e:
    raise MethodError(str(e)) from None
  return drafter, draft.params


def head_file(model_name: str, spec: MethodSpec) -> str:
  """The head file a head method drafts with: ``spec.head``, else the one
  shipped for the model (``MethodError`` if none)."""
  import pathlib
  if spec.head is not None:
    return spec.head
  shipped = SHIPPED_HEADS.get((model_name, spec.name))
  path = shipped and pathlib.Path(__file__).parents[1] / shipped
  if not path or not path.is_file():
    raise MethodError(
        f"no {spec.name} head ships for {model_name!r} yet: train one "
        f"(specjax train --config configs/{HEADS[spec.name]}_smollm2.py "
        "--workdir DIR) and pass --head DIR/head.npz")
  return str(path)


def head_id(model_name: str, spec: MethodSpec) -> Optional[str]:
  """``name@digest`` of a head method's head file (what a result row was
  measured with), None for other methods."""
  if spec.name not in HEADS:
    return None
  import hashlib
  import pathlib
  path = pathlib.Path(head_file(model_name, spec))
  digest = hashlib.sha256()
  for f in (sorted(p for p in path.iterdir() if p.is_file())
            if path.is_dir() else [path]):  # a head directory: every file
    digest.update(f.read_bytes())
  return f"{path.name}@{digest.hexdigest()[:12]}"


def _head(model: "Model", spec: "_Head"):
  """A head method's drafter: the head file (``head_file``), packed for the
  native CPU path when the target is."""
  import jax.numpy as jnp

  from specjax.heads import with_shared
  from specjax.heads.base import pack_head
  from specjax.heads.export import load_head
  variant = HEADS[spec.name]
  path = head_file(model.config.name, spec)
  try:
    cfg, head, draft_ids = load_head(path, model.config)
  except ValueError as e:
    raise MethodError(str(e)) from None
  if cfg.variant != variant:
    method = {v: m for m, v in HEADS.items()}[cfg.variant]
    raise MethodError(f"head {str(path)!r} is an {cfg.variant} head; use "
                      f"method {method}")
  head = with_shared(cfg, head, model.target, model.params)
  if model.native:  # the target's native CPU path: the head's too
    head = pack_head(head)
  shape = ()
  if spec.tree_shape:
    from specjax.core.tree import parse_shape
    shape = tuple(int(p) for p in parse_shape(spec.tree_shape))
  if variant == "medusa":
    from specjax.drafters.medusa import MedusaDrafter, MedusaParams
    if spec.num_draft > cfg.medusa_heads:
      raise MethodError(f"num_draft {spec.num_draft} exceeds the Medusa "
                        f"head's {cfg.medusa_heads} depths")
    return (MedusaDrafter(cfg, spec.min_confidence, shape),
            MedusaParams(head=head, draft_ids=draft_ids))
  from specjax.drafters.eagle import EagleDrafter, EagleParams, behind_slots
  if variant == "peagle":
    try:
      cfg.check_block(behind_slots(spec.num_draft) if spec.pearl
                      else spec.num_draft)
    except ValueError as e:
      raise MethodError(str(e)) from None
  if spec.tree_width > cfg.draft_vocab:
    raise MethodError(f"tree_width {spec.tree_width} exceeds the head's "
                      f"draft vocabulary ({cfg.draft_vocab})")
  return (EagleDrafter(cfg, spec.min_confidence, spec.tree_width, shape),
          EagleParams(head=head, draft_ids=draft_ids,
                      embed=jnp.asarray(model.target.embedding(model.params))))
