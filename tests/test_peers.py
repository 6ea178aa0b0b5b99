"""benchmarks/bench_peers.py on a two-layer cut of SmolLM2's GGUF (real
tokenizer and embeddings, so every engine loads it as it loads the full file)."""

import argparse
import json

import gguf
import pytest

from benchmarks import bench_peers
from specjax import assets

LAYERS = 2
PROMPTS = ("Write a Python function that reverses a string.",
           "List the first ten prime numbers, then the first ten squares.")


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
  """The first LAYERS blocks of the real file, every other tensor and all
  metadata as stored (block count changed)."""
  reader = gguf.GGUFReader(assets.smollm2_gguf())
  path = tmp_path_factory.mktemp("peers") / "smollm2-2layers.gguf"
  arch = reader.get_field("general.architecture").contents()
  writer = gguf.GGUFWriter(str(path), arch)
  for field in reader.fields.values():
    if field.name.startswith("GGUF.") or field.name == "general.architecture":
      continue
    value = LAYERS if field.name == f"{arch}.block_count" else field.contents()
    kind = field.types[0]
    sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, value, kind, sub_type=sub)
  kept = [t for t in reader.tensors if not t.name.startswith("blk.")
          or int(t.name.split(".")[1]) < LAYERS]
  for t in kept:
    writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes,
                           t.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_ti_data_to_file()
  for t in kept:
    writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
  writer.close()
  return path


@pytest.fixture
def prompt_file(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
  return path


def test_missing_peers_are_skipped_with_one_line(small_gguf, prompt_file,
                                                 monkeypatch, capsys):
  """Invariant: a peer that is not installed costs one stderr line naming
  it and how to install it; the specjax engine is still built."""
  from specjax.models.registry import load_model
  monkeypatch.setattr(bench_peers, "installed", lambda module: False)
  ns = argparse.Namespace(peers=["transformers", "llama_cpp"],
                          specjax=["ngram:k=3"], max_new_tokens=4, lookup=3,
                          llama_f32=False)
  engines = bench_peers.build_engines(ns, load_model(str(small_gguf)), small_gguf)
  assert [e for e, _, _ in engines] == ["specjax"]
  assert list(engines[0][2]) == ["ar", "ngram:k=3"]
  lines = capsys.readouterr().err.strip().splitlines()
  assert lines == [
      "bench_peers: transformers skipped: transformers is not installed "
      "(pip install -e '.[peers]')",
      "bench_peers: llama_cpp skipped: llama-cpp-python is not installed "
      "(pip install -e '.[peers]')"]


def test_unknown_peer_is_one_error_line(capsys):
  with pytest.raises(SystemExit) as e:
    bench_peers.main(["--peers", "vllm"])
  assert e.value.code == 2
  assert "unknown peer 'vllm'" in capsys.readouterr().err


@pytest.mark.long
def test_peers_bench_on_small_model(small_gguf, prompt_file, tmp_path):
  """Invariant: every installed engine yields an AR and a speculative row
  over the same prompts; each speculative output equals its own greedy AR's
  (prompt lookup is exact at T = 0 in all three); transformers' greedy output
  equals specjax's on these f32 weights; a rerun reads the journal instead of
  decoding again (identical timings). Both peers are required: the long
  stage installs them, and a missing one fails here instead of skipping."""
  assert bench_peers.installed("transformers"), "transformers is not installed"
  assert bench_peers.installed("llama_cpp"), "llama-cpp-python is not installed"
  journal = tmp_path / "peers.journal"
  argv = ["--model", str(small_gguf), "--dataset", str(prompt_file),
          "--max-new-tokens", "24", "--specjax", "ngram:k=3", "--lookup", "3",
          "--llama-f32", "--cache-dir", str(tmp_path / "cache"),
          "--journal", str(journal), "--n-ctx", "512"]
  rows = bench_peers.main(argv)
  by = {(r["engine"], r["method"]): r for r in rows}
  expected = {("specjax", "ar"), ("specjax", "ngram:k=3"),
              ("transformers", "ar"), ("transformers", "prompt-lookup:k=3")}
  expected |= {(e, m) for e in ("llama.cpp", "llama.cpp-f32")
               for m in ("ar", "prompt-lookup:k=3")}
  assert set(by) == expected
  for r in rows:
    assert r["num_prompts"] == len(PROMPTS) and r["tokens_per_s"] > 0
    assert 0 < r["new_tokens"] <= 24 * len(PROMPTS)
    assert r["equals_own_greedy"], r
  assert by[("transformers", "ar")]["rows_equal_to_specjax_greedy"] == len(PROMPTS)
  assert by[("llama.cpp", "ar")]["weights"] == "Q4_1 (as stored)"
  again = bench_peers.main(argv)
  assert [r["tokens_per_s"] for r in again] == [r["tokens_per_s"] for r in rows]
  # An interrupted run's first prompt alone, reported without decoding.
  journal.write_text(journal.read_text().splitlines()[0] + "\n")
  first = bench_peers.main(argv + ["--partial"])
  assert {r["num_prompts"] for r in first} == {1}
  assert all(r["new_tokens"] <= 24 for r in first)


def test_summary_ratios_and_exactness_flags():
  """Invariant: tokens/s are total new tokens over total seconds per
  (engine, method); speedups are against the same engine's AR; a prompt
  whose speculative output differs from the engine's own greedy output is
  counted; ``specjax_best_over_this`` uses the fastest specjax row."""
  a, b = [1, 2, 3, 4], [5, 6]
  runs = {("specjax", "ar"): [(a, 2.0), (b, 1.0)],          # 6 tokens / 3 s
          ("specjax", "ngram:k=5"): [(a, 1.0), (b, 0.5)],   # 6 / 1.5
          ("peer", "ar"): [(a, 4.0), (b, 2.0)],             # 6 / 6
          ("peer", "lookup"): [(a, 2.0), ([5, 7], 1.0)]}    # 6 / 3, one differs
  engines = [("specjax", {}, {"ar": None, "ngram:k=5": None}),
             ("peer", {}, {"ar": None, "lookup": None})]
  rows = {(r["engine"], r["method"]): r
          for r in bench_peers.summarize(engines, runs, dict(num_prompts=2))}
  assert rows[("specjax", "ngram:k=5")]["tokens_per_s"] == 4.0
  assert rows[("specjax", "ngram:k=5")]["speedup_over_own_ar"] == 2.0
  assert rows[("peer", "lookup")]["speedup_over_own_ar"] == 2.0
  assert not rows[("peer", "lookup")]["equals_own_greedy"]
  assert rows[("peer", "lookup")]["rows_differing_from_own_greedy"] == 1
  assert rows[("peer", "ar")]["rows_equal_to_specjax_greedy"] == 2
  assert rows[("peer", "ar")]["specjax_best"] == "ngram:k=5"
  assert rows[("peer", "ar")]["specjax_best_over_this"] == 4.0
  assert rows[("specjax", "ngram:k=5")]["specjax_best_over_this"] == 1.0
