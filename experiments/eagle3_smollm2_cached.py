"""EAGLE-3 head for SmolLM2-135M-Instruct, trained over cached target features.

  specjax train --config experiments/eagle3_smollm2_cached.py --workdir runs/e3c

The same recipe as ``eagle3_smollm2.py`` but the frozen target runs once, over
the first 720 training conversations (``feature_cache``: 1.7 GB of bf16
features in ``workdir/features``), and the head trains 4 epochs over them
(1440 steps of batch 2). At the 1000-second budget of
``experiments/run_cache_lever.sh`` that trade -- 4 epochs over fewer
examples, each step half the cost of an online one -- reached the held-out τ
an online run reaches in ~1.6x the time (docs/RESULTS.md). Sized to ~2 h on
this 2-core CPU: the cache ~1.5 s per example, a TTT-3 step ~3.3 s, a TTT-7
step ~6.5 s. Resumes from the newest checkpoint (and a partial cache).
"""

import dataclasses
import pathlib
import runpy

_ONLINE = pathlib.Path(__file__).with_name("eagle3_smollm2.py")


def config():
  online = runpy.run_path(str(_ONLINE))["config"]()
  return dataclasses.replace(online, steps=1440, feature_cache=720)
