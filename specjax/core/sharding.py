"""Device meshes: named axes, a logical axis for every array, placement.

specjax runs on JAX's own distributed machinery (named meshes, ``NamedSharding``,
the SPMD partitioner): a caller places the parameters and the prompts on a
mesh and XLA partitions the same jitted ``generate`` over it, inserting the
collectives. Nothing here is a new runtime.

Two mesh axes: ``data`` splits the batch (rows decode independently: no
communication but the loop's "any row running?"), ``model`` splits the
target tensor-parallel over kv heads (each device keeps whole GQA groups:
their query heads, key, value and cache), FFN units and the vocabulary.

Every array has *logical* axes (``batch``, ``kv_heads``, ``ffn``, ``vocab``
or None), mapped to mesh axes by ``RULES``. A logical axis is split only when
its size divides evenly by the mesh axis (SmolLM2's 3 kv heads do not split
over 2 devices): otherwise that array is replicated along that mesh axis,
which is always correct and only costs memory. ``param_specs`` and
``state_specs`` say what was chosen; the tests assert it on each array's
``.sharding``.

Several processes (hosts): ``initialize_distributed`` joins them before any
device is touched; the mesh then spans every process's devices, each process
runs the same program on the same host inputs and keeps its devices' part,
and ``to_host`` gathers results that live on other processes.

Drafters: their parameters (heads, draft models) are replicated — small next
to the target and read by every row; their state is split over the batch like
the rows it belongs to (``drafters.base.Drafter``: every state leaf leads
with B). The native CPU kernels (``specjax.kernels.native``) run on one device:
packed weights are refused here (load with ``native=False``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.core.cache import KVCache
from specjax.models.target import Target

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
RULES = {"batch": DATA, "kv_heads": MODEL, "ffn": MODEL, "vocab": MODEL}


class MeshError(ValueError):
  """A mesh spec that names unknown axes or does not fit the devices."""


def make_mesh(spec: str | Mapping[str, int],
              devices: Optional[list] = None) -> Mesh:
  """A ``(data, model)`` mesh from ``"data=2,model=4"`` (an axis left out has
  size 1) over ``devices`` (default all of them). Raises ``MeshError``."""
  if isinstance(spec, str):
    sizes = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
      name, eq, value = part.partition("=")
      if not eq or not value.strip().isdigit():
        raise MeshError(f"mesh entry {part!r} is not axis=size")
      sizes[name.strip()] = int(value)
  else:
    sizes = dict(spec)
  unknown = sorted(set(sizes) - set(AXES))
  if unknown:
    raise MeshError(f"unknown mesh axis {unknown[0]!r}; the axes are "
                    f"{', '.join(AXES)}")
  shape = tuple(sizes.get(a, 1) for a in AXES)
  if min(shape) < 1:
    raise MeshError(f"mesh axis sizes must be >= 1, got {sizes}")
  devices = jax.devices() if devices is None else devices
  if math.prod(shape) != len(devices):
    raise MeshError(f"mesh {dict(zip(AXES, shape))} needs {math.prod(shape)} "
                    f"devices, there are {len(devices)}")
  return Mesh(np.asarray(devices).reshape(shape), AXES)


def spec(logical: tuple, sizes: Mapping[str, int], mesh: Mesh) -> P:
  """The ``PartitionSpec`` of an array with these logical axes: each named
  axis goes to its ``RULES`` mesh axis when ``sizes[name]`` divides evenly
  by it (and no earlier axis of the array took that mesh axis)."""
  used, out = set(), []
  for name in logical:
    axis = RULES.get(name) if name else None
    fits = (axis is not None and axis not in used
            and sizes[name] % mesh.shape[axis] == 0)
    out.append(axis if fits else None)
    used.add(axis if fits else None)
  return P(*out)


def _sizes(target: Target, batch: int = 1) -> dict[str, int]:
  return dict(batch=batch, **target.axis_sizes)


def cache_axes(cache: KVCache) -> KVCache:
  return KVCache(k=(("batch", "kv_heads", None, None),) * len(cache.k),
                 v=(("batch", "kv_heads", None, None),) * len(cache.v),
                 lengths=("batch",))


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str)
                                      for a in x)


def _specs(axes_tree, sizes, mesh):
  return jax.tree.map(lambda a: spec(a, sizes, mesh), axes_tree,
                      is_leaf=_is_axes)


def param_specs(params, target: Target, mesh: Mesh):
  """Specs of the target's parameters (``Target.param_axes``)."""
  return _specs(target.param_axes(params), _sizes(target), mesh)


def batch_specs(tree: Any, batch: int, mesh: Mesh):
  """Every leaf split over ``data`` along its leading (batch) axis, the
  rest replicated: prompts, drafter states."""
  def leaf(x):
    if not x.shape:
      return P()
    return spec(("batch",) + (None,) * (len(x.shape) - 1), {"batch": batch},
                mesh)
  return jax.tree.map(leaf, tree)


def cache_specs(cache: KVCache, target: Target, mesh: Mesh):
  return _specs(cache_axes(cache), _sizes(target, cache.lengths.shape[0]),
                mesh)


def state_specs(state, target: Target, mesh: Mesh):
  """Specs of a ``engine.DecodeState``: per-row fields split over ``data``,
  the cache as ``cache_axes``, scalars and the key replicated."""
  B = state.tokens.shape[0]
  by_row = batch_specs(state.replace(cache=None, drafter_state=None), B, mesh)
  return by_row.replace(
      cache=cache_specs(state.cache, target, mesh),
      drafter_state=batch_specs(state.drafter_state, B, mesh),
      key=P())


def _named(specs, mesh):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda s: isinstance(s, P))


def constrain(tree, specs, mesh: Mesh):
  """``tree`` laid out as ``specs`` (inside jit: a sharding constraint)."""
  return jax.lax.with_sharding_constraint(tree, _named(specs, mesh))


def _put(tree: Any, shardings):
  """``jax.device_put`` onto (a tree of) global shardings, also with several
  processes: there an array held by one local device goes through the host
  (every process passes the same value and keeps its devices' part)."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def leaf(x, s):
    if not isinstance(x, jax.Array):
      return jax.device_put(x, s)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(leaf(jax.random.key_data(x), s),
                                      impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), s)
  if isinstance(shardings, NamedSharding):
    return jax.tree.map(lambda x: leaf(x, shardings), tree)
  return jax.tree.map(leaf, tree, shardings)


def shard_params(params, target: Target, mesh: Mesh):
  """The target's weights placed on ``mesh`` (``param_specs``)."""
  return _put(params, _named(param_specs(params, target, mesh), mesh))


def on_mesh(model, mesh: Optional[Mesh]):
  """A ``models.registry.Model`` with its weights laid out on ``mesh``
  (``shard_params``); unchanged for None. The native CPU kernels run on
  one device: a model loaded with them is refused."""
  if mesh is None:
    return model
  if model.native:
    raise ValueError("the native CPU kernels run on one device, not a mesh "
                     "(load the model with native=False)")
  return dataclasses.replace(
      model, params=shard_params(model.params, model.target, mesh), mesh=mesh)


def shard_batch(tree: Any, mesh: Mesh):
  """Prompts, lengths (or any tree of ``[B, ...]`` arrays) split over
  ``data``."""
  B = jax.tree.leaves(tree)[0].shape[0]
  return _put(tree, _named(batch_specs(tree, B, mesh), mesh))


def replicate(tree: Any, mesh: Mesh):
  """A copy of every leaf on every device: keys, scalars."""
  return _put(tree, NamedSharding(mesh, P()))


def place_drafter_params(tree: Any, mesh: Mesh):
  """A drafter's parameters on ``mesh``: replicated, except arrays already
  laid out on it (the target's embedding an EAGLE head reads stays the
  target's, not a second copy per device)."""
  def leaf(x):
    on_mesh = (isinstance(x, jax.Array)
               and isinstance(x.sharding, NamedSharding)
               and x.sharding.mesh == mesh)
    return x if on_mesh else _put(x, NamedSharding(mesh, P()))
  return jax.tree.map(leaf, tree)


def initialize_distributed(spec: str) -> None:
  """Joins a multi-process run (one process per host) before anything
  touches a device: ``"auto"`` (``jax.distributed``'s detection: TPU pods,
  SLURM, Open MPI, Kubernetes) or ``"HOST:PORT,N,I"`` (the coordinator, the
  process count, this process's index). CPU processes talk through gloo.
  Raises ``MeshError`` for a malformed spec."""
  parts = spec.split(",")
  if spec != "auto" and not (len(parts) == 3 and ":" in parts[0]
                             and parts[1].isdigit() and parts[2].isdigit()
                             and int(parts[2]) < int(parts[1])):
    raise MeshError(f"distributed spec must be 'auto' or HOST:PORT,N,I with "
                    f"I < N, got {spec!r}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if spec == "auto":
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(parts[0], int(parts[1]), int(parts[2]))


def to_host(tree: Any):
  """numpy copies of every leaf, whole on every process: an array spread
  over other processes' devices is gathered first."""
  from jax.experimental import multihost_utils

  def leaf(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree.map(leaf, tree)
