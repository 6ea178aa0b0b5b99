"""``specjax.methods``: names and knobs to drafters, with named errors."""

import dataclasses

import pytest

from specjax import methods
from specjax.models import registry


class _OtherTokenizer:
  def encode(self, text):
    return [1, 2, 3]


@pytest.mark.parametrize("change,needle", [
    (dict(vocab=37), "vocab 37"),
    (dict(tokenizer=_OtherTokenizer()), "tokenizes text differently"),
])
def test_draft_model_must_share_the_tokenizer(smollm2, monkeypatch, change,
                                              needle):
  """Invariant: a draft model with another vocabulary size, or the same size
  but another tokenizer, is refused with a message naming the mismatch."""
  cfg = smollm2.config
  if "vocab" in change:
    cfg = dataclasses.replace(cfg, vocab_size=change["vocab"])
  draft = registry.Model(config=cfg, params=None,
                         tokenizer=change.get("tokenizer", smollm2.tokenizer))
  monkeypatch.setattr(registry, "load_model", lambda name: draft)
  with pytest.raises(methods.MethodError, match=needle):
    methods.build(smollm2, methods.MethodSpec("draft", draft_model="d.gguf"))


def test_unknown_method_and_bad_knobs(smollm2):
  """Invariants: unknown names, K < 1 and impossible layer-skip depths are
  MethodErrors; "ar" builds no drafter."""
  assert methods.build(smollm2, methods.MethodSpec("ar")) == (None, None)
  for spec, needle in ((methods.MethodSpec("medusa9"), "unknown method"),
                       (methods.MethodSpec("ngram", num_draft=0), "--num-draft"),
                       (methods.MethodSpec("layerskip", layers=30), "< 30")):
    with pytest.raises(methods.MethodError, match=needle):
      methods.build(smollm2, spec)
