"""EAGLE-3 head for SmolLM2-135M-Instruct, sized for one GPU (an H200).

  python experiments/gpu_kit.py train --out OUT    # on the GPU machine

The shipped CPU recipe (``eagle3_smollm2.py``: same data, template, held-out
set, Vd, TTT 3 then 7 over the last 15%, loss weights, warm starts) with
what a GPU changes: batch 64 instead of 2 with the learning rate raised to
1e-3 (3.3x; the square-root rule would give 1.7e-3, and nothing here has
measured either on a GPU), the LM head over every row (``rows_bucket =
max_len``: one compile per TTT length instead of one per count of assistant
positions; the gathering saves FLOPs on a CPU, compiles cost minutes on a
GPU lease), and ``steps`` set by ``gpu_kit.py`` from the step time it
measures against the lease's minutes. The held-out set is the CPU runs' 64
conversations, carried by the kit and kept out of training (``heldout = 0``
here: the kit's training rows already exclude them).
"""

import dataclasses
import pathlib
import runpy

_CPU = pathlib.Path(__file__).with_name("eagle3_smollm2.py")


def config():
  cpu = runpy.run_path(str(_CPU))["config"]()
  return dataclasses.replace(
      cpu, num_conversations=20000, heldout=0, batch_size=64, lr=1e-3,
      warmup=50, checkpoint_every=100, keep=2, rows_bucket=cpu.max_len)
