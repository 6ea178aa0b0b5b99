"""Medusa heads for SmolLM2-135M-Instruct: four depths on the target's last
hidden state, sharing one LM head over Vd 16384, trained by the same trainer
on the same data as configs/eagle3_smollm2.py (the target runs on the
fly) with Medusa-1's learning rate (1e-3).

  specjax train --config configs/medusa_smollm2.py --workdir runs/medusa

450 steps of 2 x 512 tokens (~0.46M tokens) took 24 min on the 2-core EPYC
host (~3.2 s a step: the frozen target's forward and the four depths'
LM-head losses). Runs resume from the newest checkpoint in the workdir. It trained the
shipped head, specjax/heads/smollm2-135m-medusa.npz (docs/RESULTS.md).
"""

import pathlib
import runpy

_EAGLE3 = pathlib.Path(__file__).with_name("eagle3_smollm2.py")


def get_config():
  c = runpy.run_path(str(_EAGLE3))["get_config"]()
  c.head.variant = "medusa"
  c.head.medusa_heads = 4
  c.steps = 450
  c.optim.lr = 1e-3
  c.ttt.warm_fraction = 0.0
  return c
