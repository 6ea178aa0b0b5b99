"""Puts llama.cpp's own HF -> GGUF converter in ``.venv/llama.cpp`` (the
reference ``tests/test_gguf_loader.py`` converts checkpoints with), from
the llama-cpp-python sdist on PyPI: its ``convert_hf_to_gguf.py``,
``conversion/`` and ``gguf-py/``, nothing compiled. The sdist's sha256 is
the one PyPI's index lists; ``pip download`` would also build its metadata
(minutes). Usage: ``python tests/fetch_converter.py VERSION DEST``."""

import hashlib
import io
import pathlib
import re
import shutil
import sys
import tarfile
import urllib.request

INDEX = "https://pypi.org/simple/llama-cpp-python/"
WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def main(version: str, dest: str) -> None:
  with urllib.request.urlopen(INDEX, timeout=60) as r:
    html = r.read().decode()
  name = re.escape(f"llama_cpp_python-{version}.tar.gz")
  found = re.search(rf'href="([^"#]*{name})#sha256=([0-9a-f]+)"', html)
  if not found:
    sys.exit(f"fetch_converter: no sdist of llama-cpp-python {version} on PyPI")
  url, sha = found.groups()
  with urllib.request.urlopen(url, timeout=600) as r:
    data = r.read()
  if hashlib.sha256(data).hexdigest() != sha:
    sys.exit(f"fetch_converter: {url} does not match PyPI's sha256")
  out = pathlib.Path(dest)
  tmp = out.with_name(out.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
  with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
    members = [m for m in tar.getmembers() if m.name.startswith(prefix)
               and m.name[len(prefix):].startswith(WANTED)]
    for m in members:
      m.name = m.name[len(prefix):]
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    tar.extractall(tmp, members=members, **safe)
  shutil.rmtree(out, ignore_errors=True)
  tmp.rename(out)


if __name__ == "__main__":
  main(*sys.argv[1:])
