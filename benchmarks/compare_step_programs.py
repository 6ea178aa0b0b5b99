"""Whether two checkouts compile the same engine step for SmolLM2.

  git worktree add /tmp/base REV && cp specjax/kernels/_native.so /tmp/base/specjax/kernels/
  .venv/bin/python -m benchmarks.compare_step_programs /tmp/base .

For AR, an n-gram chain (K = 5) and an n-gram trie (8 nodes), each
checkout (in its own process, run in that checkout, so its ``specjax``
comes first on the path) lowers
and compiles ``engine.step_jit`` on the packed SmolLM2 and dumps XLA's
optimized program; the texts are compared after dropping what only names
the source (file and function tables, metadata, numeric suffixes of
instruction names). Equal programs run the same code, so a refactor that
keeps them equal cannot change the step's speed. Prints one JSON line.
Works with checkouts from before the ``Target`` protocol (``model_cfg=``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

_DUMP = r"""
import sys
import jax, numpy as np
from specjax.core import bucketing, engine
from specjax.drafters import NGramDrafter
from specjax.models.registry import load_model
m = load_model("smollm2-135m")
kw = dict(target=m.target) if hasattr(m, "target") else dict(model_cfg=m.config)
dcfg = {"ar": engine.DecodeConfig(capacity=64),
        "chain": engine.DecodeConfig(capacity=64, drafter=NGramDrafter(),
                                     num_draft=5),
        "trie": engine.DecodeConfig(capacity=64, drafter=NGramDrafter(num_paths=4),
                                    num_draft=5, tree_nodes=8)}[sys.argv[1]]
prompt, lengths = bucketing.pad_prompts([[1, 2, 3, 4, 5]])
st = engine.prefill_jit(m.params, prompt, lengths, jax.random.key(0),
                        np.int32(8), dcfg=dcfg, **kw)
sys.stdout.write(engine.step_jit.lower(m.params, st, dcfg=dcfg, **kw)
                 .compile().as_text())
"""


def _normalized(root: str, mode: str) -> str:
  text = subprocess.run([sys.executable, "-c", _DUMP, mode], cwd=root,
                        capture_output=True, text=True, check=True).stdout
  lines = [l for l in text.splitlines()
           if not re.match(r'^\s*\d+ (\{|")', l)]  # file/frame tables
  text = re.sub(r"metadata=\{[^}]*\}", "", "\n".join(lines))
  return re.sub(r"stack_frame_id=\d+", "", re.sub(r"\.\d+", "", text))


def main(argv=None):
  a, b = (argv or sys.argv[1:])[:2]
  print(json.dumps({mode: _normalized(a, mode) == _normalized(b, mode)
                    for mode in ("ar", "chain", "trie")}))


if __name__ == "__main__":
  main()
