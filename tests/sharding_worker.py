"""Sharded decoding on forced host devices, run by tests/test_sharding.py in
its own process (the device count is fixed when JAX starts):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python -m tests.sharding_worker [--full]

A tiny random target (8 kv heads, so every mesh shape splits it) and an
untrained EAGLE-3 head decode a ragged batch of 8 rows on one device and on
each mesh; prints one JSON object: per (temperature, method, mesh) whether the
tokens equal the single-device run's, and, per array, its global shape and
the part of it one device holds.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core import bucketing, engine, sharding
from specjax.core.sampling import SamplingParams
from specjax.drafters import Method, NGramDrafter
from specjax.drafters.eagle import EagleDrafter, EagleParams
from specjax.heads.base import HeadConfig
from specjax.heads.vocab import build_draft_vocab
from specjax.models import decoder
from specjax.models.config import ModelConfig
from specjax.models.decoder import Decoder
from specjax.training.train import init_head

CFG = ModelConfig(vocab_size=64, dim=32, num_layers=3, num_heads=16,
                  num_kv_heads=8, head_dim=4, ffn_dim=48)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 1, 9], [3, 4, 3, 4, 3, 4, 3, 4], [20],
           [1, 2], [7, 7, 7], [8], [30, 31, 30, 31, 30]]
MESHES = ("data=1,model=8", "data=2,model=4", "data=4,model=2", "data=8")


def _spec(x) -> list:
  """``[global shape, one device's shape]``: what a device really holds."""
  return [list(x.shape), list(x.sharding.shard_shape(x.shape))]


def _as_specified(tree, specs, mesh) -> bool:
  """Every non-empty array of ``tree`` is laid out as its
  ``PartitionSpec`` in ``specs`` says (on its ``.sharding``, up to
  equivalent forms)."""
  from jax.sharding import NamedSharding
  leaves = jax.tree.leaves(tree)
  wanted = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(
      x, jax.sharding.PartitionSpec))
  assert len(leaves) == len(wanted), (len(leaves), len(wanted))
  # An empty array (a chain's tree counters) holds nothing to lay out.
  return all(x.size == 0
             or x.sharding.is_equivalent_to(NamedSharding(mesh, p),
                                            len(x.shape))
             for x, p in zip(leaves, wanted))


def main(full: bool) -> dict:
  params = decoder.random_params(jax.random.key(0), CFG, scale=0.3)
  hcfg = HeadConfig.for_target(CFG, 64, taps=(0, 1, 3))
  vocab = build_draft_vocab([np.arange(64)], 64, 64)
  head = EagleParams(head=init_head(jax.random.key(1), hcfg, Decoder(CFG), params, vocab),
                     draft_ids=jnp.asarray(vocab.ids), embed=params.embed)
  methods = {"ar": (None, 0, 0, None), "ngram": (NGramDrafter(), 3, 0, None),
             "eagle3": (EagleDrafter(hcfg), 3, 0, head)}
  if full:
    methods["eagle3_tree"] = (EagleDrafter(hcfg, tree_width=2), 3, 6, head)
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  temps = (0.0, 1.0)
  meshes = MESHES if full else ("data=2,model=4",)
  out = {"runs": [], "specs": {}}
  for temp in temps:
    for name, (drafter, k, nodes, dparams) in methods.items():
      if temp and not full and name == "ngram":
        continue
      dcfg = engine.DecodeConfig(
          capacity=48, sampling=SamplingParams(temperature=temp, top_p=0.9),
          drafter=drafter, num_draft=k, tree_nodes=nodes)
      run = lambda p, d, *a: engine.generate_jit(
          p, *a, np.int32(12), target=Decoder(CFG), dcfg=d, drafter_params=dparams
          if d.mesh is None else sharding.place_drafter_params(dparams,
                                                                d.mesh))
      ref = run(params, dcfg, prompt_BT, lengths, jax.random.key(7))
      for shape in meshes:
        mesh = sharding.make_mesh(shape)
        # Prompts and key as host arrays: the engine lays the state out.
        st = run(sharding.shard_params(params, Decoder(CFG), mesh),
                 dataclasses.replace(dcfg, mesh=mesh), prompt_BT, lengths,
                 jax.random.key(7))
        same = bool((np.asarray(st.tokens) == np.asarray(ref.tokens)).all()
                    and (np.asarray(st.num_tokens)
                         == np.asarray(ref.num_tokens)).all())
        out["runs"].append(dict(temperature=temp, method=name, mesh=shape,
                                equal=same, new_tokens=int(
                                    (st.num_tokens - st.prompt_lengths).sum())))
        if name == "eagle3" and temp == 0.0:
          sp = sharding.shard_params(params, Decoder(CFG), mesh)
          out["every_leaf_as_specified"] = out.get(
              "every_leaf_as_specified", True) and _as_specified(
                  sp, sharding.param_specs(params, Decoder(CFG), mesh), mesh) and (
                      _as_specified(st, sharding.state_specs(st, Decoder(CFG), mesh),
                                    mesh))
          out["specs"][shape] = dict(
              wqkv=_spec(sp.layers[0].wqkv), wo=_spec(sp.layers[0].wo),
              w_gate_up=_spec(sp.layers[0].w_gate_up),
              w_down=_spec(sp.layers[0].w_down), embed=_spec(sp.embed),
              attn_norm=_spec(sp.layers[0].attn_norm),
              cache_k=_spec(st.cache.k[0]), cache_v=_spec(st.cache.v[-1]),
              cache_lengths=_spec(st.cache.lengths),
              tokens=_spec(st.tokens), num_tokens=_spec(st.num_tokens),
              head_cache_k=_spec(st.drafter_state.cache.k[0]),
              head_pending=_spec(st.drafter_state.pending),
              head_fc=_spec(sharding.place_drafter_params(
                  head, mesh).head["fc"]["kernel"]))
  # SmolLM2's shape: 3 kv heads do not split over 2 devices (replicated),
  # its FFN and vocabulary do.
  odd = dataclasses.replace(CFG, num_heads=9, num_kv_heads=3, head_dim=4)
  sp = sharding.shard_params(decoder.random_params(jax.random.key(0), odd),
                             Decoder(odd), sharding.make_mesh("data=4,model=2"))
  out["specs"]["odd_heads"] = dict(wqkv=_spec(sp.layers[0].wqkv),
                                   w_down=_spec(sp.layers[0].w_down))
  return out


def train_main(workdir: str) -> dict:
  """Head training on one device, data-parallel on ``data=4,model=2``, and
  interrupted on that mesh then resumed on ``data=2,model=4``: per-step
  losses and the largest parameter difference against the one-device run."""
  import pathlib
  from specjax.training import train as etrain
  from tests.test_eagle_train import CFG, _examples, make_tiny_model
  work = pathlib.Path(workdir)
  model = make_tiny_model()
  ex = _examples(n=12)
  cfg = dataclasses.replace(CFG, batch_size=4, steps=4)
  run = lambda name, stop=None, **kw: etrain.train(
      dataclasses.replace(cfg, **kw), work / name, model=model, examples=ex,
      stop_after=stop, progress=False)
  one = run("one")
  sharded = run("sharded", mesh="data=4,model=2")
  part = run("moved", stop=3, mesh="data=4,model=2")
  rest = run("moved", mesh="data=2,model=4")
  diff = lambda r: max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                       for a, b in zip(jax.tree.leaves(one.params),
                                       jax.tree.leaves(r.params)))
  fc = sharded.params["fc"]["kernel"]
  return dict(one=one.losses, sharded=sharded.losses,
              moved={**{s: part.losses[s] for s in part.losses if s < 2},
                     **rest.losses},
              resumed_from=min(rest.losses),
              max_param_diff=dict(sharded=diff(sharded), moved=diff(rest)),
              head_fc=_spec(fc), head_on_devices=len(fc.sharding.device_set))


def multihost_main(port: int, pid: int) -> dict:
  """Process ``pid`` of 2 (4 devices each) decoding on the global mesh
  ``data=4,model=2`` through ``runner.generate_ids`` (rows 0-3 live on
  process 0's devices, 4-7 on process 1's), against this process's own
  one-device run."""
  sharding.initialize_distributed(f"127.0.0.1:{port},2,{pid}")
  from specjax.core import runner
  from specjax.core.sharding import on_mesh
  from specjax.models.registry import Model
  params = decoder.random_params(jax.random.key(0), CFG, scale=0.3)
  one = Model(target=Decoder(CFG), params=params, tokenizer=None)
  meshed = on_mesh(one, sharding.make_mesh("data=4,model=2"))
  hcfg = HeadConfig.for_target(CFG, 64, taps=(0, 1, 3))
  vocab = build_draft_vocab([np.arange(64)], 64, 64)
  head = EagleParams(head=init_head(jax.random.key(1), hcfg, Decoder(CFG), params, vocab),
                     draft_ids=jnp.asarray(vocab.ids), embed=params.embed)
  out = dict(process=jax.process_index(), processes=jax.process_count(),
             devices=jax.device_count(), runs=[])
  for temp in (0.0, 1.0):
    for name, drafter, k, dparams in (("ar", None, 0, None),
                                      ("eagle3", EagleDrafter(hcfg), 3, head)):
      kw = dict(max_new_tokens=12, seed=3,
                method=Method(drafter, dparams, k),
                sampling=SamplingParams(temperature=temp, top_p=0.9))
      got = runner.generate_ids(meshed, PROMPTS, **kw)
      ref = runner.generate_ids(one, PROMPTS, **kw)
      out["runs"].append(dict(
          temperature=temp, method=name,
          equal=[r.output_ids for r in got.rows]
          == [r.output_ids for r in ref.rows],
          new_tokens=got.new_tokens))
  return out


# A Gemma-2-like target with every option the decoder has: biases, q/k and
# sandwich norms, (1 + w) norms, GeGLU, soft-caps, alternating windows
# shorter than the rows, local RoPE base, scaled embedding.
ARCH = dataclasses.replace(
    CFG, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=6, qkv_bias=True,
    o_bias=True, mlp_bias=True, activation="gelu_tanh", norm_offset=1.0,
    qk_norm=True, sandwich_norms=True, query_scale=0.3, attn_logit_cap=2.0,
    final_logit_cap=5.0, embed_scale=32 ** 0.5, sliding_window=4,
    layer_types=("sliding", "full") * 2, local_rope_theta=100.0)


def arch_main() -> dict:
  """AR and n-gram at T = 0, AR at T = 1 (top-p 0.9) on ``ARCH``: one
  device against ``data=2,model=2`` (4 of the 8 devices)."""
  params = decoder.random_params(jax.random.key(0), ARCH, scale=0.3)
  prompt_BT, lengths = bucketing.pad_prompts(PROMPTS)
  mesh = sharding.make_mesh("data=2,model=2", jax.devices()[:4])
  out = {"runs": []}
  for temp, drafter, k in ((0.0, None, 0), (0.0, NGramDrafter(), 3),
                           (1.0, None, 0)):
    dcfg = engine.DecodeConfig(
        capacity=48, sampling=SamplingParams(temperature=temp, top_p=0.9),
        drafter=drafter, num_draft=k)
    run = lambda p, d: engine.generate_jit(
        p, prompt_BT, lengths, jax.random.key(7), np.int32(12),
        target=Decoder(ARCH), dcfg=d)
    ref = run(params, dcfg)
    st = run(sharding.shard_params(params, Decoder(ARCH), mesh),
             dataclasses.replace(dcfg, mesh=mesh))
    out["runs"].append(dict(
        temperature=temp, method="ngram" if drafter else "ar",
        equal=bool((np.asarray(st.tokens) == np.asarray(ref.tokens)).all()),
        new_tokens=int((st.num_tokens - st.prompt_lengths).sum()),
        cache_k=_spec(st.cache.k[0])))
  return out


if __name__ == "__main__":
  if "--arch" in sys.argv:
    print(json.dumps(arch_main()))
  elif "--multihost" in sys.argv:
    print(json.dumps(multihost_main(int(sys.argv[-2]), int(sys.argv[-1]))))
  elif "--train" in sys.argv:
    print(json.dumps(train_main(sys.argv[-1])))
  else:
    if "--unconstrained" in sys.argv:  # the mutation: no layout constraints
      sharding.constrain = lambda tree, specs, mesh: tree
    print(json.dumps(main("--full" in sys.argv)))
