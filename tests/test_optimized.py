"""Greedy identity survives XLA's optimizing passes.

The rest of the suite compiles XLA's own code at LLVM -O0 (tests/conftest.py)
to save compile time; benchmarks and users run XLA's default level. Here a
subprocess with the default level decodes SmolLM2 with n-gram drafts and
with the shipped EAGLE-3 head's tree and checks both against AR.
"""

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = """
import json, sys
from specjax.core import runner
from specjax.drafters import Method, NGramDrafter, methods
from specjax.models.registry import load_model
model = load_model("smollm2-135m")
prompts = [model.tokenizer.encode_chat(p) for p in json.loads(sys.argv[1])]
run = lambda **kw: [r.output_ids for r in runner.generate_ids(
    model, prompts, max_new_tokens=40, **kw).rows]
head = methods.build(model, methods.MethodSpec(
    "eagle3", num_draft=4, min_confidence=0.3))
print(json.dumps({
    "ar": run(),
    "ngram": run(method=Method(NGramDrafter(), num_draft=4)),
    "eagle3_tree": run(method=Method(head.drafter, head.params, 4, 8))}))
"""


@pytest.mark.long
def test_greedy_identity_at_the_default_optimization_level():
  """Invariant: at XLA's default optimization level, n-gram chains and the
  shipped head's 8-node EAGLE-2 tree emit AR's tokens on SmolLM2 for a
  ragged batch of 4 chat prompts."""
  from tests.conftest import TEST_XLA_FLAGS
  from tests.test_smollm2 import PROMPTS
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if f not in TEST_XLA_FLAGS)
  run = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(PROMPTS)],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "XLA_FLAGS": flags})
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.splitlines()[-1])
  assert sum(map(len, out["ar"])) > 40
  assert out["ngram"] == out["ar"] and out["eagle3_tree"] == out["ar"]
