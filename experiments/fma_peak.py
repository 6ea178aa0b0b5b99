"""This CPU's peak rate of 8-wide FMAs (AVX2), and the compute floor it puts
under a forward over T tokens (issue 17).

  .venv/bin/python experiments/fma_peak.py

Compiles a C++ loop of 12 independent FMA chains held in registers (no
memory traffic) and runs it on 1 and on all cores. A forward over T new
tokens multiplies every weight of SmolLM2 (134.5M in its matmuls and LM
head) by T rows: T x 134.5M / 8 eight-wide FMAs, so at the measured peak its
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from experiments.common import machine  # noqa: E402

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
__attribute__((target("avx2,fma"))) float chains(long n) {
  __m256 a0 = _mm256_set1_ps(0.f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
         a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-4f);
  for (long k = 0; k < n; ++k) {
#define F(r) a##r = _mm256_fmadd_ps(a##r, b, c);
    F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
#undef F
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
      _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)),
                    _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11))));
  return s[0];
}
int main(int argc, char** argv) {
  const long n = 100000000;
  for (int threads = 1; threads <= atoi(argv[1]); threads *= 2) {
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      std::vector<std::thread> ts;
      std::vector<float> out(threads);
      auto t0 = std::chrono::steady_clock::now();
      for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { out[t] = chains(n); });
      for (auto& t : ts) t.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (threads * n * 12 / s > best) best = threads * n * 12 / s;
    }
    printf("%d %.6e\n", threads, best);
  }
}
"""
WEIGHTS = 134.5e6  # SmolLM2-135M: every matmul and the LM head


def main() -> int:
  cores = os.cpu_count() or 1
  with tempfile.TemporaryDirectory() as d:
    src, exe = pathlib.Path(d) / "fma.cc", pathlib.Path(d) / "fma"
    src.write_text(SOURCE)
    subprocess.run(["g++", "-O2", "-std=c++17", "-pthread", str(src), "-o",
                    str(exe)], check=True)
    lines = subprocess.run([str(exe), str(cores)], check=True,
                           capture_output=True, text=True).stdout.split("\n")
  rate = {int(t): float(r) for t, r in (l.split() for l in lines if l)}
  peak = rate[max(rate)]
  print(json.dumps(dict(
      machine=machine(),
      fma8_per_s={t: round(r / 1e9, 2) for t, r in rate.items()},  # G/s
      gflops={t: round(r * 16 / 1e9, 1) for t, r in rate.items()},
      floor_ms={T: round(T * WEIGHTS / 8 / peak * 1e3, 2)
                for T in (1, 2, 4, 8, 16)})))
  return 0


if __name__ == "__main__":
  sys.exit(main())
