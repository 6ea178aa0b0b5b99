"""EAGLE-1 head for SmolLM2-135M-Instruct: the baseline EAGLE-3 improves on,
trained by the same trainer on the same data and budget as
configs/eagle3_smollm2.py (TTT length 1: EAGLE-1 trains on target
features only; feature regression + 0.1 soft CE over the full vocabulary).

  specjax train --config configs/eagle1_smollm2.py --workdir runs/e1
"""

import pathlib
import runpy

_EAGLE3 = pathlib.Path(__file__).with_name("eagle3_smollm2.py")


def get_config():
  c = runpy.run_path(str(_EAGLE3))["get_config"]()
  c.head.variant = "eagle1"
  c.ttt.steps = 1
  c.ttt.warm_steps = 1
  c.ttt.warm_fraction = 0.0
  return c
