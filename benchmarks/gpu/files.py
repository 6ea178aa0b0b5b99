"""What travels between this machine and a lent GPU (``benchmarks.gpu``): files cut
into sha256-checked parts, the tokenized data in a compact format, and the
limits on what a device call returns."""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
KIT = ROOT / ".devkit"
MIB = 1 << 20
OUT_FILES = 8  # files back from $OUT per call
OUT_FILE_BYTES = 16 * MIB
OUT_BYTES = 64 * MIB
_OUT_NAME = re.compile(r"[A-Za-z0-9._-]+")


def sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(MIB), b""):
      h.update(block)
  return h.hexdigest()


def split_file(path: pathlib.Path, part_bytes: int, dest_dirs,
               first_bytes: int | None = None) -> list[dict]:
  """Cuts ``path`` into pieces of at most ``part_bytes`` (the first at most
  ``first_bytes``: part 1 also carries loose files), the i-th written to
  ``dest_dirs(i) / NAME.i``; returns one record (name, bytes, sha256) per
  piece."""
  out = []
  with open(path, "rb") as f:
    size = first_bytes or part_bytes
    while block := f.read(size):
      piece = dest_dirs(len(out)) / f"{path.name}.{len(out):03d}"
      piece.parent.mkdir(parents=True, exist_ok=True)
      piece.write_bytes(block)
      out.append(dict(name=piece.name, bytes=len(block),
                      sha256=hashlib.sha256(block).hexdigest()))
      size = part_bytes
  return out


def join_parts(found: list[pathlib.Path], records: list[dict],
               dest: pathlib.Path, whole_sha: str) -> pathlib.Path:
  """Joins pieces in ``records`` order; names each missing or altered piece
  (ValueError) rather than producing a broken file."""
  by_name = {p.name: p for p in found}
  missing = [r["name"] for r in records if r["name"] not in by_name]
  if missing:
    raise ValueError(f"missing parts: {', '.join(missing)} (carry every "
                     ".devkit/pI on consecutive calls)")
  dest.parent.mkdir(parents=True, exist_ok=True)
  h = hashlib.sha256()
  with open(dest, "wb") as f:
    for r in records:
      block = by_name[r["name"]].read_bytes()
      if hashlib.sha256(block).hexdigest() != r["sha256"]:
        raise ValueError(f"part {r['name']} is damaged (sha256 mismatch)")
      h.update(block)
      f.write(block)
  if h.hexdigest() != whole_sha:
    raise ValueError(f"{dest.name}: joined file does not match its sha256")
  return dest


def tree_files() -> list[str]:
  """What a device call sends besides carried paths: tracked and untracked,
  not ignored files (paths relative to the repository)."""
  names = subprocess.run(
      ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
      cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
  return [n.decode() for n in names if n and (ROOT / n.decode()).is_file()]


def tree_bytes() -> int:
  return sum((ROOT / n).stat().st_size for n in tree_files())


def save_examples(path: pathlib.Path, train, heldout) -> None:
  """uint16 ids (vocab < 65536), bit-packed masks, compressed."""
  import numpy as np
  arrays = {}
  for name, e in (("train", train), ("heldout", heldout)):
    assert e.ids.max() < 1 << 16
    arrays.update({f"{name}_ids": e.ids.astype(np.uint16),
                   f"{name}_mask": np.packbits(e.mask, axis=1),
                   f"{name}_lengths": e.lengths})
  np.savez_compressed(path, **arrays)


def load_examples(path: pathlib.Path):
  import numpy as np
  from specjax.training.data import Examples
  with np.load(path) as z:
    def get(name):
      ids = z[f"{name}_ids"].astype(np.int32)
      mask = np.unpackbits(z[f"{name}_mask"], axis=1,
                           count=ids.shape[1]).astype(bool)
      return Examples(ids, mask, z[f"{name}_lengths"])
    return get("train"), get("heldout")


def manifest() -> tuple[dict, list[pathlib.Path]]:
  """The kit's manifest (every part carries it) and the tar pieces here."""
  found = sorted(KIT.glob("p*/kit.tar.*"))
  texts = {m.read_text() for m in KIT.glob("p*/manifest.json")}
  if not texts:
    raise ValueError("no .devkit/pI/manifest.json here: run `python -m benchmarks.gpu "
                     "pack` and carry its parts")
  if len(texts) > 1:  # parts of two packs: joining would fail later
    raise ValueError("the .devkit parts here come from different packs")
  return json.loads(texts.pop()), found


def out_problems(out: pathlib.Path) -> list[str]:
  """What in ``out`` would not come back from a device call: too many or
  too large files, odd names, folders more than two down."""
  files = [p for p in out.rglob("*") if p.is_file()]
  problems = [f"{len(files)} files > {OUT_FILES}"] if len(files) > OUT_FILES \
      else []
  total = sum(p.stat().st_size for p in files)
  if total > OUT_BYTES:
    problems.append(f"{total / MIB:.1f} MiB in all > {OUT_BYTES // MIB}")
  for p in files:
    rel = p.relative_to(out)
    if p.stat().st_size > OUT_FILE_BYTES:
      problems.append(f"{rel}: {p.stat().st_size / MIB:.1f} MiB > 16")
    if len(rel.parts) > 3 or not all(map(_OUT_NAME.fullmatch, rel.parts)):
      problems.append(f"{rel}: too deep or an odd name")
  return problems
