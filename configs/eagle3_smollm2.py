"""EAGLE-3 head for SmolLM2-135M-Instruct: the online recipe.

  specjax train --config configs/eagle3_smollm2.py --workdir runs/e3
  specjax train --config configs/eagle3_smollm2.py --config.steps=50 --workdir /tmp/e3

Sized for the first, slower 2-core VM (calibrated there):
~2 h of training with the CPU to itself (~5.6 s per TTT-3 step, ~9 s per
TTT-7 step), ~1.1M tokens. Vd 16384 covers ~97% of assistant tokens;
TTT 3 for the first 85% of steps (twice the throughput, and at this accuracy
depths past 3 add little to τ), then 7; batch 2 x 512 tokens. Runs resume
from the newest checkpoint in the workdir. It trained the head shipped
until the cached recipe (``eagle3_smollm2_cached.py``) replaced it.

``get_sweep`` is the learning-rate sweep of this recipe, short runs:
``specjax train --config configs/eagle3_smollm2.py --config.steps=200
--sweep --workdir runs/e3-lr`` trains one head per point in
``runs/e3-lr/NAME``.
"""

from specjax.training.config import defaults


def get_config():
  c = defaults()
  c.model = "smollm2-135m"
  c.steps = 1150
  c.batch_size = 2
  c.data.num_conversations = 4000
  c.data.heldout = 64
  c.data.max_len = 512
  c.head.draft_vocab = 16384
  c.ttt.steps = 7
  c.ttt.warm_steps = 3
  c.ttt.warm_fraction = 0.85
  c.optim.lr = 3e-4
  c.optim.warmup = 20
  c.optim.final_lr_fraction = 0.1
  c.optim.clip_norm = 0.5
  c.checkpoint_every = 50
  c.keep = 3
  c.log_every = 10
  return c


def get_sweep():
  return [{"optim.lr": lr} for lr in (1e-4, 3e-4, 1e-3)]
