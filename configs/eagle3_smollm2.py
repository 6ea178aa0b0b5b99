"""EAGLE-3 head for SmolLM2-135M-Instruct: the online recipe.

  specjax train --config configs/eagle3_smollm2.py --workdir runs/e3
  specjax train --config configs/eagle3_smollm2.py --set steps=50 --workdir /tmp/e3

Sized for the first, slower 2-core VM (calibrated there):
~2 h of training with the CPU to itself (~5.6 s per TTT-3 step, ~9 s per
TTT-7 step), ~1.1M tokens. Vd 16384 covers ~97% of assistant tokens;
TTT 3 for the first 85% of steps (twice the throughput, and at this accuracy
depths past 3 add little to τ), then 7; batch 2 x 512 tokens. Runs resume
from the newest checkpoint in the workdir. It trained the head shipped
until the cached recipe (``eagle3_smollm2_cached.py``) replaced it.
"""

from specjax.training.train import TrainConfig


def config() -> TrainConfig:
  return TrainConfig(
      model="smollm2-135m", num_conversations=4000, heldout=64, max_len=512,
      batch_size=2, steps=1150, ttt_steps=7, ttt_warm_steps=3,
      ttt_warm_fraction=0.85, draft_vocab=16384, lr=3e-4, warmup=20,
      final_lr_fraction=0.1, clip_norm=0.5, checkpoint_every=50, keep=3,
      log_every=10)
