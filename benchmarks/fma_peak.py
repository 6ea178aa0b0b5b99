"""This CPU's peak FMA rate (AVX2's 8-wide, AVX-512's 16-wide where it has
them), and the compute floor it puts under a forward over T tokens.

  .venv/bin/python -m benchmarks.fma_peak

Compiles a C++ loop of 12 independent FMA chains held in registers (no
memory traffic) and runs it on 1 and on all cores. A forward over T new
tokens multiplies every weight of SmolLM2 (134.5M in its matmuls and LM
head) by T rows: T x 134.5M / lanes FMAs, so at the measured peak its
matmuls cannot take less than ``floor_ms[T]``, whatever the kernel. Compare
with the weight read (``bench_verify.py --level matmul``): where the floor
exceeds the read, a verify over T tokens is compute-bound on this host.
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile


from benchmarks.common import machine

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
// 12 independent FMA chains in registers, `Vec` wide. Each chain starts
// from its own value, read at run time: chains that start equal are one
// chain to the compiler (GCC kept one and ran at the FMA's latency).
#define CHAINS(name, isa, Vec, set1, fmadd, add)                              \
  __attribute__((target(isa))) float name(long n, float v) {                  \
    Vec a0 = set1(v), a1 = set1(v + 1), a2 = set1(v + 2), a3 = set1(v + 3),   \
        a4 = set1(v + 4), a5 = set1(v + 5), a6 = set1(v + 6),                 \
        a7 = set1(v + 7), a8 = set1(v + 8), a9 = set1(v + 9),                 \
        a10 = set1(v + 10), a11 = set1(v + 11);                               \
    const Vec b = set1(0.999f), c = set1(1e-4f);                              \
    for (long k = 0; k < n; ++k) {                                            \
      a0 = fmadd(a0, b, c); a1 = fmadd(a1, b, c); a2 = fmadd(a2, b, c);       \
      a3 = fmadd(a3, b, c); a4 = fmadd(a4, b, c); a5 = fmadd(a5, b, c);       \
      a6 = fmadd(a6, b, c); a7 = fmadd(a7, b, c); a8 = fmadd(a8, b, c);       \
      a9 = fmadd(a9, b, c); a10 = fmadd(a10, b, c); a11 = fmadd(a11, b, c);   \
    }                                                                         \
    Vec s = add(add(add(a0, a1), add(a2, a3)), add(add(a4, a5), add(a6, a7))); \
    s = add(s, add(add(a8, a9), add(a10, a11)));                              \
    float out[16];                                                            \
    std::memcpy(out, &s, sizeof(float));                                      \
    return out[0];                                                            \
  }
CHAINS(ymm, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps)
CHAINS(zmm, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps)
int main(int argc, char** argv) {
  const long n = 100000000;
  float (*fn)(long, float) = std::strcmp(argv[2], "zmm") == 0 ? zmm : ymm;
  for (int threads = 1; threads <= atoi(argv[1]); threads *= 2) {
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      std::vector<std::thread> ts;
      std::vector<float> out(threads);
      auto t0 = std::chrono::steady_clock::now();
      for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { out[t] = fn(n, argc + t); });
      for (auto& t : ts) t.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (threads * n * 12 / s > best) best = threads * n * 12 / s;
    }
    printf("%d %.6e\n", threads, best);
  }
}
"""
WEIGHTS = 134.5e6  # SmolLM2-135M: every matmul and the LM head


def cpu_flags() -> set:
  with open("/proc/cpuinfo") as f:
    return set(next(l for l in f if l.startswith("flags")).split())


def rates(widths: dict, cores: int) -> dict:
  """``{register: {threads: FMA instructions per second}}`` for 1, 2, 4, ...
  up to ``cores`` threads, from the compiled loop."""
  out = {}
  with tempfile.TemporaryDirectory() as d:
    src, exe = pathlib.Path(d) / "fma.cc", pathlib.Path(d) / "fma"
    src.write_text(SOURCE)
    subprocess.run(["g++", "-O2", "-std=c++17", "-pthread", str(src), "-o",
                    str(exe)], check=True)
    for reg in widths:
      lines = subprocess.run([str(exe), str(cores), reg], check=True,
                             capture_output=True, text=True).stdout.split("\n")
      out[reg] = {int(t): float(r) for t, r in (l.split() for l in lines if l)}
  return out


def peak_gflops(isa: str, cores: int | None = None) -> float:
  """GFLOP/s at the FMA peak of ``cores`` threads (all of them by default)
  in the registers of the kernels' instruction set ``isa``
  (``native.isa()``: zmm for avx512, else ymm)."""
  reg, lanes = ("zmm", 16) if isa == "avx512" else ("ymm", 8)
  rate = rates({reg: lanes}, cores or os.cpu_count() or 1)[reg]
  return rate[max(rate)] * 2 * lanes / 1e9


def main() -> int:
  cores = os.cpu_count() or 1
  widths = {"ymm": 8} | ({"zmm": 16} if "avx512f" in cpu_flags() else {})
  out = dict(machine=machine())
  for reg, rate in rates(widths, cores).items():
    lanes, peak = widths[reg], rate[max(rate)]
    out[reg] = dict(
        fma_per_s_g={t: round(r / 1e9, 2) for t, r in rate.items()},
        gflops={t: round(r * 2 * lanes / 1e9, 1) for t, r in rate.items()},
        floor_ms={T: round(T * WEIGHTS / lanes / peak * 1e3, 2)
                  for T in (1, 2, 4, 8, 16)})
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
