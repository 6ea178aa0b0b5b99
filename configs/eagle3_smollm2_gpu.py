"""EAGLE-3 head for SmolLM2-135M-Instruct, sized for one GPU (an H200).

  python -m benchmarks.gpu pack     # here; then the printed device calls

The CPU recipe (``eagle3_smollm2.py``: same data, template, held-out set, Vd,
loss weights, warm starts) with what a GPU lease changes:
- batch 64 instead of 2, the learning rate raised to 1e-3 (3.3x; the
  square-root rule would give 1.7e-3, and nothing here has measured either
  on a GPU);
- TTT 3 throughout, as the shipped head's cached recipe: one compiled step
  instead of two (TTT 7 bought ~0.01 tau at 2.2x the step cost on CPU);
- the LM head over every row (``ttt.rows_bucket = data.max_len``): one compile for
  the run, instead of one per count of assistant positions;
- no checkpoints (``checkpoint_every = 0``): nothing resumes across leases,
  the exported head comes back, and the next lease goes on from it;
- ``steps`` set by ``benchmarks.gpu`` from the step time it measures against
  the lease's minutes.
The held-out set is the CPU runs' 64 conversations, carried by the kit and
kept out of training (``data.heldout = 0`` here: the kit's training rows already
exclude them).
"""

import pathlib
import runpy

_CPU = pathlib.Path(__file__).with_name("eagle3_smollm2.py")


def get_config():
  c = runpy.run_path(str(_CPU))["get_config"]()
  c.data.num_conversations = 20000
  c.data.heldout = 0
  c.batch_size = 64
  c.optim.lr = 1e-3
  c.optim.warmup = 50
  c.ttt.steps = 3
  c.ttt.warm_fraction = 0.0
  c.checkpoint_every = 0
  c.ttt.rows_bucket = c.data.max_len
  return c
