"""A multi-token-prediction module for SmolLM2-135M-Instruct, a target that
ships none: DeepSeek-V3's MTP module (``heads.eagle.MTPHead``: one Llama
layer over (token, the target's last hidden state) pairs, the target's LM
head, the next depth fed the layer's output), trained by the EAGLE
trainer over cached target features with soft CE at TTT 3, as the shipped
EAGLE-3 head is (``eagle3_smollm2_cached.py``), and written in the
DeepSeek-V3 layout too (``workdir/head-deepseek/``).

  specjax train --config configs/mtp_smollm2.py --workdir runs/mtp
  specjax generate --method mtp --head runs/mtp/head.npz --prompt "..."

The LM head is the full vocabulary (49,152 rows, the target's, frozen): a
step costs ~4.5 s on the 2-core Zen 4 VM, four times the EAGLE-3 head's
over 16,384, so the shipped head's budget of about 2 hours buys 1,000
steps (75 min) over 1,000 cached conversations (the cache ~1.4 s each
there, 25 min).
Resumes from the newest checkpoint (and a partial feature cache).
"""

import pathlib
import runpy

_CACHED = pathlib.Path(__file__).with_name("eagle3_smollm2_cached.py")


def get_config():
  c = runpy.run_path(str(_CACHED))["get_config"]()
  c.head.variant = "mtp"
  c.head.init_layer = "random"
  c.steps = 1000
  c.data.feature_cache = 1000
  c.export = "deepseek"
  return c
