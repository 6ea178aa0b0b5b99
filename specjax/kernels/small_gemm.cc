// y[M, N] = x[M, K] @ W for a few rows M, on the CPU, as an XLA FFI custom
// call (issue 17). Decode and verify forwards multiply a handful of rows by
// weights far larger than the caches, so the time is the weight read: the
// kernel streams each weight once and keeps every row's partial sums in
// registers.
//
// W arrives pre-arranged ("packed", specjax/native.py: pack) as panels of
// 16 output columns, [P = ceil(N / 16), K, 16], the last panel zero-padded:
// a panel is one contiguous run of K * 64 bytes, read front to back. Rows go
// in blocks of up to 6 (12 ymm accumulators on AVX2 + the panel row's two
// vectors + a broadcast), rows shared out evenly over the blocks (8 rows
// as 4 + 4). The panel is walked in chunks of 128 of its rows (8 KB), every
// row block taking its turn on a chunk while it is in L1. One block alone
// prefetches 16 panel rows ahead; with several, each block prefetches its
// share of the next chunk, so the weights stream in while the later blocks
// compute (8 rows: 1.10x a one-row matmul, 16 rows: 1.38x on the EPYC
// host). Variants measured and dropped: DESIGN.md. Panels are shared out
// over XLA's intra-op thread pool. AVX2 + FMA where the CPU has them (an
// AVX-512 variant is still to come), else plain C++.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;  // output columns per panel: two ymm
constexpr int64_t kRows = 6;    // rows per register block
constexpr int64_t kChunk = 128;  // panel rows a chunk: 8 KB, stays in L1
constexpr int64_t kAhead = 16;   // panel rows prefetched ahead: 1 KB
constexpr int64_t kGroup = 8 * kRows;  // rows sharing one output tile

// Rows [0, MB) of x (row stride ldx) times K rows of a panel: out[r, :16]
// (added to what out holds when `accumulate`). AVX2 + FMA: two ymm
// accumulators a row (two independent FMA chains even for one row), the
// panel row's two vectors loaded once for all rows; panel row
// k * step / 2^16 past `ahead` prefetched on step k. Named accumulators,
// stored one by one: with an array, or a loop over one at the end, GCC keeps
// them in memory and stores them back on every k (blocks of 1-4 rows ran
// at a third of the speed that way).
template <int MB>
__attribute__((target("avx2,fma"))) void block_avx2(
    const float* x, int64_t ldx, const float* panel, int64_t K, float* out,
    bool accumulate, const float* ahead, int64_t step) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0,
         h2 = l0, l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
  if (accumulate) {
#define SPECJAX_LOAD(r)                                                   \
  if constexpr (MB > r) {                                                 \
    l##r = _mm256_loadu_ps(out + r * kLanes);                             \
    h##r = _mm256_loadu_ps(out + r * kLanes + 8);                         \
  }
    SPECJAX_LOAD(0) SPECJAX_LOAD(1) SPECJAX_LOAD(2)
    SPECJAX_LOAD(3) SPECJAX_LOAD(4) SPECJAX_LOAD(5)
#undef SPECJAX_LOAD
  }
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + (k * step >> 16) * kLanes),
                 _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kLanes);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kLanes + 8);
#define SPECJAX_ROW(r)                                                    \
  if constexpr (MB > r) {                                                 \
    const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);               \
    l##r = _mm256_fmadd_ps(xb, w0, l##r);                                 \
    h##r = _mm256_fmadd_ps(xb, w1, h##r);                                 \
  }
    SPECJAX_ROW(0) SPECJAX_ROW(1) SPECJAX_ROW(2)
    SPECJAX_ROW(3) SPECJAX_ROW(4) SPECJAX_ROW(5)
#undef SPECJAX_ROW
  }
#define SPECJAX_STORE(r)                                                  \
  if constexpr (MB > r) {                                                 \
    _mm256_storeu_ps(out + r * kLanes, l##r);                             \
    _mm256_storeu_ps(out + r * kLanes + 8, h##r);                         \
  }
  SPECJAX_STORE(0) SPECJAX_STORE(1) SPECJAX_STORE(2)
  SPECJAX_STORE(3) SPECJAX_STORE(4) SPECJAX_STORE(5)
#undef SPECJAX_STORE
}

// The same in plain C++, for CPUs without AVX2 + FMA.
template <int MB>
void block_generic(const float* x, int64_t ldx, const float* panel, int64_t K,
                   float* out, bool accumulate, const float*, int64_t) {
  float acc[MB][kLanes] = {};
  if (accumulate) std::memcpy(acc, out, sizeof(acc));
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MB; ++r)
      for (int64_t j = 0; j < kLanes; ++j)
        acc[r][j] += x[r * ldx + k] * panel[k * kLanes + j];
  std::memcpy(out, acc, sizeof(acc));
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t,
                         float*, bool, const float*, int64_t);
#define SPECJAX_BLOCKS(fn)                                               \
  {nullptr, fn<1>, fn<2>, fn<3>, fn<4>, fn<5>, fn<6>}
const BlockFn kAvx2[kRows + 1] = SPECJAX_BLOCKS(block_avx2);
const BlockFn kGeneric[kRows + 1] = SPECJAX_BLOCKS(block_generic);

// The block kernels for this CPU, chosen once by its features.
const BlockFn* const kBlocks = specjax::has_avx2_fma() ? kAvx2 : kGeneric;

// Rows in blocks of at most kRows, shared out evenly (16 rows as 6 + 5 + 5,
// 8 as 4 + 4).
int64_t block_rows(int64_t rows, int64_t blocks_left) {
  return (rows + blocks_left - 1) / blocks_left;
}

// Panels [p0, p1) against every row of x, written into y: rows in groups
// sharing an output tile, each group's blocks taking turns chunk by chunk.
void panels(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
            int64_t p0, int64_t p1, float* y) {
  float tile[kGroup * kLanes];
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = w + p * K * kLanes;
    const int64_t n0 = p * kLanes, cols = std::min(kLanes, N - n0);
    for (int64_t g0 = 0; g0 < M; g0 += kGroup) {
      const int64_t rows = std::min(kGroup, M - g0);
      const int64_t blocks = (rows + kRows - 1) / kRows;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
          const int64_t mb = block_rows(rows - m0, blocks - b);
          // What this block prefetches: k * step / 2^16 panel rows past it.
          const float* ahead =
              blocks == 1 ? panel + (k0 + kAhead) * kLanes
                          : panel + (k0 + kChunk + b * kc / blocks) * kLanes;
          kBlocks[mb](x + (g0 + m0) * K + k0, K, panel + k0 * kLanes, kc,
                      tile + m0 * kLanes, k0 > 0, ahead, (1 << 16) / blocks);
          m0 += mb;
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(y + (g0 + r) * N + n0, tile + r * kLanes,
                    cols * sizeof(float));
    }
  }
}

ffi::Error SmallGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 ||
      wd[2] != kLanes || wd[1] != xd[1] || yd[0] != xd[0] ||
      (yd[1] + kLanes - 1) / kLanes != wd[0])
    return ffi::Error::InvalidArgument(
        "small_gemm: want x[M, K], w[ceil(N/16), K, 16], y[M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1], P = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(1, P / (4 * threads));
  specjax::parallel_for(pool, (P + chunk - 1) / chunk, [&](int64_t c) {
    panels(xp, M, K, wp, N, c * chunk, std::min(P, (c + 1) * chunk), yp);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallGemm, SmallGemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
