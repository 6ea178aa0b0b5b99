"""Peak memory of decoding one long prompt on SmolLM2 (f32, CPU), per prompt
length: each length in a fresh process, which reports its own peak RSS
(``ru_maxrss``) after loading the model, the prefill and 8 greedy tokens.

  python -m benchmarks.prefill_memory [--root CHECKOUT] [--lengths 1024 ...]

``--root`` runs another checkout's specjax (an A/B: the same script, the
same prompts). Prints one JSON object per length.
"""

import argparse
import json
import pathlib
import subprocess
import sys

_CHILD = """
import json, resource, sys, time
import numpy as np
from specjax.core import runner
from specjax.models.registry import load_model
n = int(sys.argv[1])
model = load_model("smollm2-135m")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = np.random.default_rng(0).integers(100, model.config.vocab_size, n)
t0 = time.perf_counter()
res = runner.generate_ids(model, [ids.tolist()], max_new_tokens=8)
print(json.dumps(dict(
    prompt_tokens=n, new_tokens=len(res.rows[0].output_ids),
    stop=res.rows[0].stop_reason, seconds=round(time.perf_counter() - t0, 1),
    peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                       / 2**20, 2),
    after_load_gib=round(base / 2**20, 2))))
"""


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--root", default=str(pathlib.Path(__file__).parents[1]))
  p.add_argument("--lengths", type=int, nargs="+",
                 default=[1024, 4096, 8081])
  args = p.parse_args(argv)
  for n in args.lengths:
    # Run in the checkout: ``python -c`` puts its directory first on the path.
    run = subprocess.run([sys.executable, "-c", _CHILD, str(n)],
                         cwd=args.root, capture_output=True, text=True)
    if run.returncode:
      print(json.dumps(dict(prompt_tokens=n, root=args.root,
                            failed=run.stderr.strip().splitlines()[-1:])))
      continue
    print(json.dumps({**json.loads(run.stdout.splitlines()[-1]),
                      "root": args.root}), flush=True)


if __name__ == "__main__":
  main()
