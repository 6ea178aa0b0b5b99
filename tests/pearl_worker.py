"""PEARL on device groups, run by the tests in their own process on 4
forced host devices (the device count is fixed when JAX starts), a
``(role=2, data=2)`` mesh: the drafter on two devices, the target on the
other two, each pair splitting the rows.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      python -m tests.pearl_worker greedy
  ... python -m tests.pearl_worker sample TARGET_DIR DRAFT_DIR OUT.npy

``greedy``: a tiny target and a tiny draft model decode a ragged batch of 4
rows at T = 0 with AR on one device and with PEARL on one device and on the
mesh (through the engine, and through ``runner.generate_ids`` on a model
placed on the mesh), and an untrained P-EAGLE head with PEARL on the mesh;
prints one JSON object (whether the outputs are equal, the steps in each
mode, the drafts accepted).
``sample``: ``tests/test_exactness.py``'s check on the mesh: its target and
draft model (transformers checkpoints), its prompt, sampling and K, N rows
with a key each; saves each row's first NEW tokens as one cell index.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specjax import testing
from specjax.core import bucketing, engine, pearl, runner
from specjax.core.sharding import on_mesh
from specjax.drafters import DraftModelDrafter, Method
from specjax.drafters.eagle import EagleDrafter
from specjax.models.decoder import Decoder
from specjax.models.registry import Model

PROMPTS = [[5, 17, 3, 9, 1, 30], [9, 1, 30, 22, 4, 8, 2, 11, 7], [33, 4],
           [8, 8, 8]]


def greedy() -> dict:
  cfg, params = testing.tiny("llama_gqa_tied", seed=0)
  _, draft = testing.tiny("llama_gqa_tied", seed=1)
  draft = jax.tree.map(lambda t, d: 0.7 * t + 0.3 * d, params, draft)
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  mesh = pearl.make_mesh(data=2)

  def run(params_of_drafter=None, **kw):
    st = engine.generate_jit(
        params, prompt_BT, lengths, jax.random.key(0), np.int32(20),
        target=Decoder(cfg), dcfg=engine.DecodeConfig(capacity=64, **kw),
        drafter_params=params_of_drafter or (draft if kw else None))
    return [st.tokens[b, lengths[b]:st.num_tokens[b]].tolist()
            for b in range(len(PROMPTS))], st

  pearl_kw = dict(drafter=DraftModelDrafter(Decoder(cfg)), num_draft=3,
                  pearl=True)
  ar, _ = run()
  one, _ = run(**pearl_kw)
  grouped, st = run(mesh=mesh, **pearl_kw)
  pend = st.drafter_state
  head_cfg, head = _peagle_head(cfg, params)
  drafted, head_st = run(mesh=mesh, drafter=EagleDrafter(head_cfg),
                         num_draft=3, pearl=True,
                         params_of_drafter=head)
  model = Model(Decoder(cfg), params, None)
  outputs = lambda res: [r.output_ids for r in res.rows]
  ar_runner = runner.generate_ids(model, PROMPTS, max_new_tokens=20)
  through_runner = runner.generate_ids(
      on_mesh(model, mesh), PROMPTS, max_new_tokens=20,
      method=Method(DraftModelDrafter(Decoder(cfg)), draft, 3, pearl=True))
  return {"equal_one_device": one == ar, "equal_mesh": grouped == ar,
          "runner_equal_mesh": outputs(through_runner) == outputs(ar_runner),
          "pre_steps": int(pend.pre_steps.sum()),
          "post_steps": int(pend.post_steps.sum()),
          "accepted": int(np.asarray(st.accepted_at).sum()),
          "peagle_equal_mesh": drafted == ar,
          "peagle_post_steps": int(head_st.drafter_state.post_steps.sum())}


def _peagle_head(cfg, params):
  """An untrained P-EAGLE head on the tiny target (``init_head``'s warm
  start: the target's LM head and final norm)."""
  from specjax.drafters.eagle import EagleParams
  from specjax.heads.base import HeadConfig
  from specjax.heads.vocab import build_draft_vocab
  from specjax.training.train import init_head
  V = cfg.vocab_size
  hcfg = HeadConfig.for_target(cfg, V, variant="peagle", taps=(0, 1, 2),
                               mask_token=V - 1)
  vocab = build_draft_vocab([np.arange(V)], V, V)
  head = init_head(jax.random.key(0), hcfg, Decoder(cfg), params, vocab)
  return hcfg, EagleParams(head=head, draft_ids=jnp.asarray(vocab.ids),
                           embed=params.embed)


def sample(target_dir: str, draft_dir: str, out: str) -> dict:
  from specjax.models.hf_loader import load_hf
  from tests.test_exactness import K, N, NEW, PROMPT, SAMPLING
  cfg, params = load_hf(target_dir)
  draft_cfg, draft = load_hf(draft_dir)
  L, V = len(PROMPT), cfg.vocab_size
  dcfg = engine.DecodeConfig(capacity=32, sampling=SAMPLING,
                             drafter=DraftModelDrafter(Decoder(draft_cfg)),
                             num_draft=K, mesh=pearl.make_mesh(data=2),
                             pearl=True)
  st = engine.generate_jit(params, jnp.tile(jnp.asarray([PROMPT], jnp.int32),
                                            (N, 1)),
                           jnp.full((N,), L, jnp.int32),
                           jax.random.split(jax.random.key(0), N),
                           np.int32(NEW), target=Decoder(cfg), dcfg=dcfg,
                           drafter_params=draft)
  assert (np.asarray(st.num_tokens) == L + NEW).all()
  tokens = np.asarray(st.tokens[:, L:L + NEW])
  np.save(out, np.ravel_multi_index(tokens.T, (V,) * NEW))
  pend = st.drafter_state
  return {"pre_steps": int(pend.pre_steps.sum()),
          "post_steps": int(pend.post_steps.sum()),
          "accepted_last": float((np.asarray(st.accepted_at)[:, K - 1]
                                  > 0).mean())}


if __name__ == "__main__":
  if sys.argv[1] == "greedy":
    print(json.dumps(greedy()))
  else:
    print(json.dumps(sample(*sys.argv[2:5])))
