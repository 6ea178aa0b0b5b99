"""``drafters.methods``: names and knobs to drafters, with named errors."""

import dataclasses

import pytest

from specjax.drafters import methods
from specjax.models import registry
from specjax.models.decoder import Decoder


class _OtherTokenizer:
  """The same token strings, another encoding (other merges, say)."""
  def __init__(self, real):
    self.token_strings = real.token_strings

  def encode(self, text):
    return [1, 2, 3]


class _SwappedTokenizer:
  """The same encoding of the probe, two ids' strings swapped."""
  def __init__(self, real):
    self.encode = real.encode
    self._strings = real.token_strings()
    a, b = 1000, 1001
    self._strings[a], self._strings[b] = self._strings[b], self._strings[a]

  def token_strings(self):
    return list(self._strings)


@pytest.mark.parametrize("change,needle", [
    (dict(vocab=37), "vocab 37"),
    (dict(tokenizer=_OtherTokenizer), "tokenizes text differently"),
    (dict(tokenizer=_SwappedTokenizer), "token 1000 is"),
])
def test_draft_model_must_share_the_tokenizer(smollm2, monkeypatch, change,
                                              needle):
  """Invariant: a draft model with another vocabulary size, the same size
  but another tokenizer, or the same encoding of a probe but two token
  strings swapped, is refused with a message naming the mismatch."""
  cfg = smollm2.config
  if "vocab" in change:
    cfg = dataclasses.replace(cfg, vocab_size=change["vocab"])
  tokenizer = change.get("tokenizer")
  draft = registry.Model(target=Decoder(cfg), params=None,
                         tokenizer=tokenizer(smollm2.tokenizer) if tokenizer
                         else smollm2.tokenizer)
  monkeypatch.setattr(registry, "load_model", lambda name: draft)
  with pytest.raises(methods.MethodError, match=needle):
    methods.build(smollm2, methods.MethodSpec("draft", draft_model="d.gguf"))


def test_unknown_method_and_bad_knobs(smollm2):
  """Invariants: unknown names and values out of range are MethodErrors
  naming the field when the spec is made (one place for its checks), an
  impossible layer-skip depth when it is built; "ar" builds no drafter."""
  assert methods.build(smollm2, methods.MethodSpec("ar")).drafter is None
  for kw, needle in ((dict(name="medusa9"), "unknown method"),
                     (dict(name="ngram", num_draft=0), "num_draft must be"),
                     (dict(name="ngram", tree_nodes=-1), "tree_nodes must be"),
                     (dict(name="eagle3", tree_width=0), "tree_width must be"),
                     (dict(name="eagle3", lookup_nodes=-2), "lookup_nodes"),
                     (dict(name="eagle3", min_confidence=1.0),
                      r"min_confidence must be in \[0, 1\)")):
    with pytest.raises(methods.MethodError, match=needle):
      methods.MethodSpec(**kw)
  with pytest.raises(TypeError, match="num_draft must be an int"):
    methods.MethodSpec("ngram", num_draft=4.0)
  with pytest.raises(methods.MethodError, match="< 30"):
    methods.build(smollm2, methods.MethodSpec("layerskip", layers=30))


def test_static_tree_shape_sets_nodes_and_depth(smollm2):
  """Invariants: ``tree_shape`` fixes the node count and K (the shape's
  depth, whatever K was passed), reaches the EAGLE drafter as parents, and
  is refused for table drafters; a node count that disagrees with it is
  refused, not dropped."""
  spec = methods.MethodSpec("eagle3", num_draft=7, tree_shape="2x2x1")
  assert (spec.tree_nodes, spec.k) == (10, 3)
  assert methods.MethodSpec("eagle3", tree_nodes=10,
                            tree_shape="2x2x1").tree_nodes == 10
  with pytest.raises(methods.MethodError, match="tree_nodes 3 disagrees"):
    methods.MethodSpec("eagle3", tree_nodes=3, tree_shape="2x2x1")
  assert spec.label() == "eagle3(K=3, tree 2x2x1)"
  drafter = methods.build(smollm2, spec).drafter
  assert drafter.tree_shape == (0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6)
  with pytest.raises(methods.MethodError, match="for EAGLE, MTP and Medusa heads"):
    methods.build(smollm2, methods.MethodSpec("ngram", tree_shape="2"))


def test_ngram_retrieval_builds_both_tables(smollm2, tmp_path, monkeypatch):
  """Invariant: "ngram+retrieval" is n-gram with ``tree_width`` matches in
  front of the retrieval drafter, its parameters the retrieval datastore."""
  from specjax.drafters import Datastore, LookupDrafter
  monkeypatch.setenv("HOME", str(tmp_path))  # the datastore cache
  built = methods.build(smollm2, methods.MethodSpec(
      "ngram+retrieval", tree_width=3, tree_nodes=8,
      datastore_conversations=20))
  drafter, store = built.drafter, built.params
  assert (built.num_draft, built.tree_nodes) == (4, 8)
  assert isinstance(drafter, LookupDrafter) and isinstance(store, Datastore)
  assert drafter.ngram.num_paths == 3


def test_lookup_nodes_merge_the_trie_into_a_head_tree(smollm2, tmp_path,
                                                     monkeypatch):
  """Invariants: ``lookup_nodes`` wraps the head's drafter in a
  ``TreeUnion`` with the n-gram/retrieval trie (params: the head's and the
  datastore), counts within ``tree_nodes`` (added to a static shape's), and
  shows in the label."""
  from specjax.drafters import Datastore, EagleDrafter, LookupDrafter
  from specjax.drafters.union import TreeUnion
  monkeypatch.setenv("HOME", str(tmp_path))  # the datastore cache
  spec = methods.MethodSpec("eagle3", tree_shape="2x2", lookup_nodes=5,
                            datastore_conversations=20)
  assert (spec.tree_nodes, spec.k) == (11, 4)  # K: the trie's depth
  assert spec.label() == "eagle3(K=4, tree 2x2, lookup 5)"
  built = methods.build(smollm2, spec)
  drafter, params = built.drafter, built.params
  assert isinstance(drafter, TreeUnion) and drafter.table_nodes == 5
  assert isinstance(drafter.head, EagleDrafter)
  assert isinstance(drafter.table, LookupDrafter)
  assert isinstance(params.table, Datastore)
  assert drafter.feature_taps == drafter.head.feature_taps


def test_decoding_does_not_import_training():
  """Invariant: everything a decode with a trained head imports (the CLI,
  methods, engine, runner, every drafter with EAGLE's, the heads and their
  file loader) pulls in neither the trainer (``specjax.training``) nor
  optax or orbax. Run in a fresh interpreter: this one has them loaded."""
  import subprocess
  import sys
  code = (
      "import sys\n"
      "import specjax, specjax.cli.main, specjax.drafters.methods, "
      "specjax.core.engine, specjax.core.runner, specjax.drafters, "
      "specjax.drafters.eagle, specjax.drafters.union, "
      "specjax.heads.eagle, specjax.heads.export, specjax.heads.vocab\n"
      "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
      "('optax', 'orbax') or m.startswith('specjax.training'))\n"
      "print(' '.join(bad))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True).stdout.strip()
  assert out == "", f"decoding imports training code: {out}"


# Every method, and every key of the grammar at least once.
GRAMMAR = ["ar", "ngram", "ngram:k=5:nodes=8:width=2", "retrieval:k=3:nodes=6",
           "ngram+retrieval:nodes=8:width=3:conversations=300",
           "draft:draft=models/d.gguf:conf=0.5", "layerskip:layers=20:conf=0.6",
           "eagle:k=5", "eagle3:k=4:nodes=7:width=2",
           "eagle3:k=5:shape=2x2x1:lookup=8:head=runs/e3/head.npz",
           "eagle3:shape=0,1,2,0.0", "medusa:shape=2x2x1",
           "lookahead:k=3:window=5:width=2", "lookahead:k=5:window=4:levels=2",
           "clasp:k=3:layers=18:refresh=2", "clasp:k=4:nodes=8:width=3",
           "peagle:k=6:head=runs/pe/head.npz", "layerskip:k=3:pearl=1"]


@pytest.mark.parametrize("text", GRAMMAR)
def test_the_method_grammar_round_trips(text):
  """Invariant: ``MethodSpec.parse`` and ``MethodSpec.text`` are inverse
  (text -> spec -> text -> the same spec), and every key sets the field
  ``methods.KNOBS`` names."""
  spec = methods.MethodSpec.parse(text)
  assert methods.MethodSpec.parse(spec.text()) == spec
  name, knobs = methods.parse_knobs(text)
  assert spec.name == name
  for field, value in knobs.items():
    if field not in ("num_draft", "tree_nodes") or not spec.tree_shape:
      assert getattr(spec, field) == value, field  # a shape sets both


def test_the_grammar_covers_every_key():
  keys = {k.partition("=")[0] for t in GRAMMAR for k in t.split(":")[1:]}
  assert keys == set(methods.KNOBS)


@pytest.mark.parametrize("text,needle", [
    ("nope:k=2", "unknown method 'nope'"),
    ("eagle3:foo=1", "got 'foo=1'"),
    ("eagle3:k", "got 'k'"),
    ("eagle3:k=1.5", "k must be an integer, got '1.5'"),
    ("eagle3:conf=high", "conf must be a number, got 'high'"),
    ("eagle3:k=2:k=3", "k given twice"),
    ("ngram:head=h.npz", "head is for eagle, eagle3, medusa, mtp, peagle; "
     "ngram would"),
    ("eagle3:layers=3", "layers is for clasp, layerskip; eagle3 would"),
    ("ngram:conversations=300", "conversations is for eagle, eagle3, "
     "medusa, mtp, ngram+retrieval, peagle, retrieval; ngram would"),
    ("retrieval:width=2", "width is for clasp, eagle, eagle3, lookahead, "
     "medusa, mtp, ngram, ngram+retrieval, peagle; retrieval would"),
    ("ar:k=3", "k is for clasp, draft, eagle"),
    ("eagle3:shape=1000x1000", "nodes"),
    ("eagle3:pearl=1",
     "pearl is for draft, layerskip, ngram, peagle; eagle3 would"),
])
def test_a_bad_method_is_one_error_naming_the_knob(text, needle):
  """Invariant: each bad spec raises one MethodError that names the key
  (or the method) and the value."""
  with pytest.raises(methods.MethodError) as e:
    methods.MethodSpec.parse(text)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_help_lists_each_methods_knobs_and_the_grammar_refuses_the_rest(
    capsys):
  """Invariant: ``--help`` names each method with the grammar keys it reads
  (``methods.knobs_of``, the same table the grammar refuses knobs by), and
  every other key on that method is refused; the table is complete (a
  field no method reads cannot be written)."""
  from specjax.cli.main import main
  with pytest.raises(SystemExit):
    main(["bench", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  for name in methods.METHODS:
    keys = methods.knobs_of(name)
    assert (f"{name} ({', '.join(keys)})" if keys else f" {name};") in text
    for key in set(methods.KNOBS) - set(keys):
      with pytest.raises(methods.MethodError, match=f"{key} is for "):
        methods.parse_knobs(f"{name}:{key}=1")
  assert all(any(key in methods.knobs_of(m) for m in methods.METHODS)
             for key in methods.KNOBS)
