"""P-EAGLE head for SmolLM2-135M-Instruct: a block drafter warm-started from
the shipped EAGLE-3 head, trained over cached target features.

  specjax train --config configs/peagle_smollm2.py --workdir runs/pe

The cached EAGLE-3 recipe (``eagle3_smollm2_cached.py``: the target once
over the first 2000 training conversations, epochs over them) with the
head's variant ``peagle``: its parameters start as the shipped EAGLE-3
head's (slot 0 of a block is EAGLE-3's pair) and ``mask_hidden`` fresh; each
step trains 6 depths in one packed COD sequence (``ttt.peagle_loss``: every
position at depth 0, half of them at depth 1, a quarter at depth 2, ...,
drawn at random among those the loss counts). Resumes from the newest
checkpoint (and a partial cache).
"""

import pathlib
import runpy

import specjax

_CACHED = pathlib.Path(__file__).with_name("eagle3_smollm2_cached.py")


def get_config():
  c = runpy.run_path(str(_CACHED))["get_config"]()
  c.head.variant = "peagle"
  c.head.init_layer = "random"  # the EAGLE-3 head's layer instead
  c.head.init_head = str(pathlib.Path(specjax.__file__).parent
                         / "heads" / "smollm2-135m-eagle3.npz")
  c.head.cod_ratio = 0.5
  c.ttt.steps = 6  # the depths trained
  c.steps = 4000
  return c
