"""Decode speed of the code in one checkout: AR, n-gram (K = 5) and the shipped
EAGLE-3 head's static 7-node tree, batch 1, the eight chat prompts of
``experiments/common.py``, 128 new tokens, two rounds after compiling.

  .venv/bin/python experiments/decode_speed.py /path/to/checkout

Runs that checkout's specjax (its root goes first on ``sys.path``), so two
commits can be compared by alternating processes over two ``git worktree``s;
compare the ratios within a process, since whole processes drift. Prints one
JSON line of tokens/s per method.
"""

import json
import sys


def main(root: str):
  sys.path.insert(0, root)
  from experiments.common import CHAT_PROMPTS
  from specjax.core import runner
  from specjax.drafters import methods
  from specjax.drafters.methods import MethodSpec
  from specjax.measure import bench
  from specjax.models.registry import load_model
  model = load_model("smollm2-135m")
  ids = [model.tokenizer.encode_chat(p) for p in CHAT_PROMPTS]
  specs = {"ar": MethodSpec("ar"), "ngram": MethodSpec("ngram", num_draft=5),
           "tree": MethodSpec("eagle3", num_draft=3, tree_nodes=7,
                              tree_shape="0,1,2,0.0,0.1,1.0,0.0.0")}
  built = {k: (s, *methods.build(model, s)) for k, s in specs.items()}

  def run(k, p):
    s, d, dp = built[k]
    return runner.generate_ids(model, [p], max_new_tokens=128, drafter=d,
                               num_draft=s.k, tree_nodes=s.tree_nodes,
                               drafter_params=dp)
  for k in built:
    for p in ids:
      run(k, p)  # compile every prompt bucket
  tot = {k: [0, 0.0] for k in built}
  for _ in range(2):
    for p in ids:
      for k in built:
        r = run(k, p)
        tot[k][0] += len(r.rows[0].output_ids)
        tot[k][1] += r.wall_s
  print(json.dumps({"git_sha": bench.git_sha(),
                    **{k: round(n / s, 2) for k, (n, s) in tot.items()}}))


if __name__ == "__main__":
  main(sys.argv[1])
