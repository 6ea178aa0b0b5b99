// y[M, N] = x[M, K] @ W on the CPU, as an XLA FFI custom call. Decode and
// verify forwards multiply a handful of rows by weights far larger than the
// caches, so the time is the weight read: the kernel streams each weight
// once and keeps every row's partial sums in registers. Past `few_many()`
// rows — verify blocks at larger batches, prefill chunks — the FMAs bound
// the time instead (at the cores' FMA peak SmolLM2's matmuls take as long
// as their read at ~17 rows, ~34 on Intel's AVX-512 cores with two
// full-width FMA units), and `panels_many` blocks for the FMA units: rows
// packed once, panels outermost, each block over the whole of K.
//
// W arrives pre-arranged ("packed", specjax/native.py: pack) as panels of
// 16 output columns, [P = ceil(N / 16), K, 16], the last panel zero-padded:
// a panel is one contiguous run of K * 64 bytes, read front to back. Rows go
// in register blocks, shared out evenly over the blocks: blocks of up to 6
// rows on one panel (12 ymm accumulators on AVX2 + the panel row's two
// vectors + a broadcast; AVX-512 for 8 rows or fewer, 8 as 4 + 4) or, with
// AVX-512 and more than 8 rows, up to 12 rows on two adjacent panels (24 zmm
// accumulators, a broadcast feeding two FMAs; 16 as 8 + 8). The panel is
// walked in chunks of 128 of its rows (8 KB), every row block taking its turn
// on a chunk while it is in L1. A lone one-panel block prefetches 16 panel
// rows ahead; otherwise each block prefetches its share of the next chunk, so
// the weights stream in while the later blocks compute (AVX2 on the Zen 3
// host: 8 rows 1.10x a one-row matmul, 16 rows 1.38x). Variants
// measured and dropped: DESIGN.md. Panels are shared out over XLA's intra-op
// thread pool. AVX-512 where the CPU has it, else AVX2 + FMA, else plain C++
// (specjax::isa).
//
// Panels hold f32 or bf16 weights (SpecjaxSmallGemmBf16): a bf16 weight is
// widened to f32 in registers (its 16 bits become the float's top half,
// exact), so a bf16 panel gives the f32 kernel's result on the same values
// while reading half the bytes. Rows, sums and outputs are f32 either way.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;  // output columns per panel: two ymm, one zmm
constexpr int64_t kTile = 2 * kLanes;  // output tile columns: two panels
constexpr int64_t kChunk = 128;  // panel rows a chunk: 8 KB, stays in L1
constexpr int64_t kAhead = 16;   // panel rows prefetched ahead: 1 KB
constexpr int64_t kGroup = 48;   // rows sharing one output tile
constexpr int64_t kOneRows = 6;  // most rows in a one-panel block
constexpr int64_t kWideRows = 12;  // most rows in a two-panel block
constexpr int64_t kFew = 8;      // up to this many rows: one-panel blocks

// More rows than this go to `panels_many`: 16, or 32 on Intel's AVX-512
// cores, whose two full-width FMA units keep the few-row loop bound by the
// read twice as far (family 6 model 207: a forward over 17 / 24 / 32 tokens
// 36 / 40 / 45 ms with 16, 28 / 32 / 38 ms with 32). Elsewhere (Zen 4,
// whose zmm FMA is two halves; AVX2) 16, where the kernel was tuned.
int64_t few_many() {
  static const int64_t rows =
      specjax::isa() == specjax::Isa::kAvx512 && __builtin_cpu_is("intel")
          ? 32 : 16;
  return rows;
}

using bf16 = uint16_t;  // the top half of an f32's bits

// Eight weights of a panel row as f32 (AVX2).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(
    const float* w) {
  return _mm256_loadu_ps(w);
}
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(
    const bf16* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// A panel row's 16 weights as f32 (AVX-512).
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(
    const float* w) {
  return _mm512_loadu_ps(w);
}
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(
    const bf16* w) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One weight as f32 (plain C++).
inline float widen(float w) { return w; }
inline float widen(bf16 w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Where a block kernel finds row r's value at k: x row-major (row r at
// x + r * ldx) or, PACKED, the block's MB rows interleaved k-major
// (`pack_rows`), so that one k's values are adjacent and a block needs one
// pointer for them.
template <int MB, bool PACKED>
__attribute__((always_inline)) inline const float* at(const float* x,
                                                       int64_t ldx, int r,
                                                       int64_t k) {
  return PACKED ? x + k * MB + r : x + r * ldx + k;
}

// Every block kernel reads row r of x at x + r * ldx and writes row r of its
// output tile at out + r * ldo. Named accumulators, stored one by one: with
// an array, or a loop over one at the end, GCC keeps them in memory and
// stores them back on every k (blocks of 1-4 rows ran at a third of the
// speed that way). Panel row k * step / 2^16 past `ahead` is prefetched on
// step k.
//
// Rows [0, MB) times K rows of one panel: out[r, :16] (added to what out
// holds when `accumulate`). AVX2 + FMA: two ymm accumulators a row (two
// independent FMA chains even for one row), the panel row's two vectors
// loaded once for all rows.
template <typename W, int MB, int NP, bool PACKED>
__attribute__((target("avx2,fma"))) void block_avx2(
    const float* x, int64_t ldx, const W* panel, int64_t, int64_t K,
    float* out, int64_t ldo, bool accumulate, const W* ahead, int64_t step) {
  static_assert(NP == 1, "AVX2 blocks take one panel");
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0,
         h2 = l0, l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
  if (accumulate) {
#define SPECJAX_LOAD(r)                                                   \
  if constexpr (MB > r) {                                                 \
    l##r = _mm256_loadu_ps(out + r * ldo);                                \
    h##r = _mm256_loadu_ps(out + r * ldo + 8);                            \
  }
    SPECJAX_LOAD(0) SPECJAX_LOAD(1) SPECJAX_LOAD(2)
    SPECJAX_LOAD(3) SPECJAX_LOAD(4) SPECJAX_LOAD(5)
#undef SPECJAX_LOAD
  }
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + (k * step >> 16) * kLanes),
                 _MM_HINT_T0);
    const __m256 w0 = load8(panel + k * kLanes);
    const __m256 w1 = load8(panel + k * kLanes + 8);
#define SPECJAX_ROW(r)                                                    \
  if constexpr (MB > r) {                                                 \
    const __m256 xb = _mm256_broadcast_ss(at<MB, PACKED>(x, ldx, r, k));  \
    l##r = _mm256_fmadd_ps(xb, w0, l##r);                                 \
    h##r = _mm256_fmadd_ps(xb, w1, h##r);                                 \
  }
    SPECJAX_ROW(0) SPECJAX_ROW(1) SPECJAX_ROW(2)
    SPECJAX_ROW(3) SPECJAX_ROW(4) SPECJAX_ROW(5)
#undef SPECJAX_ROW
  }
#define SPECJAX_STORE(r)                                                  \
  if constexpr (MB > r) {                                                 \
    _mm256_storeu_ps(out + r * ldo, l##r);                                \
    _mm256_storeu_ps(out + r * ldo + 8, h##r);                            \
  }
  SPECJAX_STORE(0) SPECJAX_STORE(1) SPECJAX_STORE(2)
  SPECJAX_STORE(3) SPECJAX_STORE(4) SPECJAX_STORE(5)
#undef SPECJAX_STORE
}

// The same with AVX-512 over NP adjacent panels (the second `pstride`
// weights past the first): a panel row is one zmm, so a row keeps one
// accumulator a panel, and two panels give even one row two FMA chains.
// Blocks of up to 12 rows times two panels hold 24 accumulators, and each
// broadcast of a row's value feeds two FMAs: half the broadcasts, and a
// weight chunk read from L1 by half as many blocks, as one-panel blocks of 6
// rows (32 rows: 1.93x a one-row matmul instead of 2.11x; DESIGN.md).
template <typename W, int MB, int NP, bool PACKED>
__attribute__((target("avx512f"))) void block_avx512(
    const float* x, int64_t ldx, const W* panel, int64_t pstride, int64_t K,
    float* out, int64_t ldo, bool accumulate, const W* ahead, int64_t step) {
  static_assert(NP == 1 || NP == 2, "AVX-512 blocks take one or two panels");
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0,
         a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0,
         b7 = a0, b8 = a0, b9 = a0, b10 = a0, b11 = a0;
#define SPECJAX_EACH(F)                                                   \
  F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
  if (accumulate) {
#define SPECJAX_LOAD(r)                                                   \
  if constexpr (MB > r) {                                                 \
    a##r = _mm512_loadu_ps(out + r * ldo);                                \
    if constexpr (NP > 1) b##r = _mm512_loadu_ps(out + r * ldo + kLanes); \
  }
    SPECJAX_EACH(SPECJAX_LOAD)
#undef SPECJAX_LOAD
  }
  for (int64_t k = 0; k < K; ++k) {
    const W* next = ahead + (k * step >> 16) * kLanes;
    _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T0);
    if constexpr (NP > 1)
      _mm_prefetch(reinterpret_cast<const char*>(next + pstride), _MM_HINT_T0);
    const __m512 w0 = load16(panel + k * kLanes);
    const __m512 w1 = NP > 1 ? load16(panel + pstride + k * kLanes) : w0;
#define SPECJAX_ROW(r)                                                    \
  if constexpr (MB > r) {                                                 \
    const __m512 xb = _mm512_set1_ps(*at<MB, PACKED>(x, ldx, r, k));      \
    a##r = _mm512_fmadd_ps(xb, w0, a##r);                                 \
    if constexpr (NP > 1) b##r = _mm512_fmadd_ps(xb, w1, b##r);           \
  }
    SPECJAX_EACH(SPECJAX_ROW)
#undef SPECJAX_ROW
  }
#define SPECJAX_STORE(r)                                                  \
  if constexpr (MB > r) {                                                 \
    _mm512_storeu_ps(out + r * ldo, a##r);                                \
    if constexpr (NP > 1) _mm512_storeu_ps(out + r * ldo + kLanes, b##r); \
  }
  SPECJAX_EACH(SPECJAX_STORE)
#undef SPECJAX_STORE
#undef SPECJAX_EACH
}

// The same in plain C++, for CPUs without AVX2 + FMA.
template <typename W, int MB, int NP, bool PACKED>
void block_generic(const float* x, int64_t ldx, const W* panel, int64_t,
                   int64_t K, float* out, int64_t ldo, bool accumulate,
                   const W*, int64_t) {
  static_assert(NP == 1, "plain C++ blocks take one panel");
  float acc[MB][kLanes] = {};
  if (accumulate)
    for (int r = 0; r < MB; ++r)
      std::memcpy(acc[r], out + r * ldo, sizeof(acc[r]));
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MB; ++r)
      for (int64_t j = 0; j < kLanes; ++j)
        acc[r][j] +=
            *at<MB, PACKED>(x, ldx, r, k) * widen(panel[k * kLanes + j]);
  for (int r = 0; r < MB; ++r)
    std::memcpy(out + r * ldo, acc[r], sizeof(acc[r]));
}

template <typename W>
using BlockFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t,
                         float*, int64_t, bool, const W*, int64_t);
#define SPECJAX_BLOCKS6(fn, W, NP)                                        \
  {nullptr, fn<W, 1, NP, false>, fn<W, 2, NP, false>, fn<W, 3, NP, false>, \
   fn<W, 4, NP, false>, fn<W, 5, NP, false>, fn<W, 6, NP, false>}
#define SPECJAX_BLOCKS12(fn, W, NP)                                       \
  {nullptr, fn<W, 1, NP, false>, fn<W, 2, NP, false>, fn<W, 3, NP, false>, \
   fn<W, 4, NP, false>, fn<W, 5, NP, false>, fn<W, 6, NP, false>,         \
   fn<W, 7, NP, false>, fn<W, 8, NP, false>, fn<W, 9, NP, false>,         \
   fn<W, 10, NP, false>, fn<W, 11, NP, false>, fn<W, 12, NP, false>}

// The block kernels for this CPU and weight type, chosen once by the CPU's
// features (specjax::isa: SPECJAX_NATIVE_ISA may cap them): how many
// adjacent panels a block takes, its most rows, and the kernels by row count
// for that many panels (`wide`) and for one (a range's odd last panel); and
// the kernels of a full block on packed rows (`pack_rows`), for that many
// panels and for one.
template <typename W>
struct Blocks {
  int64_t panels, rows;
  const BlockFn<W>* wide;
  const BlockFn<W>* one;
  BlockFn<W> packed_wide, packed_one;

  static constexpr BlockFn<W> avx512_two[13] =
      SPECJAX_BLOCKS12(block_avx512, W, 2);
  static constexpr BlockFn<W> avx512_one[13] =
      SPECJAX_BLOCKS12(block_avx512, W, 1);
  static constexpr BlockFn<W> avx2[7] = SPECJAX_BLOCKS6(block_avx2, W, 1);
  static constexpr BlockFn<W> generic[7] =
      SPECJAX_BLOCKS6(block_generic, W, 1);
  static const Blocks& cpu() {
    static const Blocks b =
        specjax::isa() == specjax::Isa::kAvx512
            ? Blocks{2, kWideRows, avx512_two, avx512_one,
                     block_avx512<W, kWideRows, 2, true>,
                     block_avx512<W, kWideRows, 1, true>}
        : specjax::isa() == specjax::Isa::kAvx2
            ? Blocks{1, kOneRows, avx2, avx2, block_avx2<W, kOneRows, 1, true>,
                     block_avx2<W, kOneRows, 1, true>}
            : Blocks{1, kOneRows, generic, generic,
                     block_generic<W, kOneRows, 1, true>,
                     block_generic<W, kOneRows, 1, true>};
    return b;
  }
};
#undef SPECJAX_BLOCKS6
#undef SPECJAX_BLOCKS12

// Rows in blocks of at most `most`, shared out evenly (AVX2: 16 rows as
// 6 + 5 + 5, 8 as 4 + 4; AVX-512: 16 as 8 + 8, 32 as 11 + 11 + 10).
int64_t block_rows(int64_t rows, int64_t blocks_left) {
  return (rows + blocks_left - 1) / blocks_left;
}

// Panels [p0, p1) against every row of x, written into y: rows in groups
// sharing an output tile, each group's blocks taking turns chunk by chunk, a
// block's panels side by side in the tile.
template <typename W>
void panels(const float* x, int64_t M, int64_t K, const W* w, int64_t N,
            int64_t p0, int64_t p1, float* y) {
  const Blocks<W>& kn = Blocks<W>::cpu();
  // A few rows go one panel at a time (two panels with one block of 8 rows
  // took 1.1x as long as one panel with two blocks of 4).
  const bool wide = kn.panels > 1 && M > kFew;
  const int64_t most = wide ? kn.rows : kOneRows;
  float tile[kGroup * kTile];
  for (int64_t p = p0, np; p < p1; p += np) {
    np = wide ? std::min(kn.panels, p1 - p) : 1;
    const BlockFn<W>* fns = np > 1 ? kn.wide : kn.one;
    const W* panel = w + p * K * kLanes;
    const int64_t n0 = p * kLanes, cols = std::min(np * kLanes, N - n0);
    for (int64_t g0 = 0; g0 < M; g0 += kGroup) {
      const int64_t rows = std::min(kGroup, M - g0);
      const int64_t blocks = (rows + most - 1) / most;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
          const int64_t mb = block_rows(rows - m0, blocks - b);
          // What this block prefetches: k * step / 2^16 panel rows past it.
          const W* ahead =
              blocks == 1 && !wide
                  ? panel + (k0 + kAhead) * kLanes
                  : panel + (k0 + kChunk + b * kc / blocks) * kLanes;
          fns[mb](x + (g0 + m0) * K + k0, K, panel + k0 * kLanes, K * kLanes,
                  kc, tile + m0 * kTile, kTile, k0 > 0, ahead,
                  (1 << 16) / blocks);
          m0 += mb;
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(y + (g0 + r) * N + n0, tile + r * kTile,
                    cols * sizeof(float));
    }
  }
}

// Rows [0, blocks * mb) of x (row stride ldx) as `blocks` blocks of mb
// rows, each interleaved k-major: out[b][k][r] = x[b * mb + r][k].
void pack_rows(const float* x, int64_t ldx, int64_t K, int64_t blocks,
               int64_t mb, float* out) {
  for (int64_t b = 0; b < blocks; ++b) {  // written in order: 3x as fast
    const float* rows = x + b * mb * ldx;
    float* to = out + b * mb * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < mb; ++r) to[k * mb + r] = rows[r * ldx + k];
  }
}

// Panels [p0, p1) against many rows (a prefill chunk, M > few_many()): every
// row reuses the weights, so the time is the FMAs, and the blocking keeps
// the FMA units fed from the caches. The rows' full blocks come packed
// (`pack_rows`, done once for all panels: one k's values adjacent, one
// pointer a block), the last partial block is read in place. Panels go
// outermost: a block's panels (K x 128 bytes) stay in L2 while every row
// block passes them, so each weight is read from memory once and the packed
// rows (M x K floats) from L3. A block runs the whole of K and writes its
// tile straight into y (a tile whose panels pass N goes through `tile`),
// while prefetching its share of the next panels.
template <typename W>
void panels_many(const float* x, const float* packed, int64_t M, int64_t K,
                 const W* w, int64_t N, int64_t p0, int64_t p1, float* y) {
  const Blocks<W>& kn = Blocks<W>::cpu();
  const int64_t mb = kn.rows, full = M / mb, blocks = full + (M > full * mb);
  float tile[kWideRows * kTile];
  for (int64_t p = p0, np; p < p1; p += np) {
    np = std::min(kn.panels, p1 - p);
    const W* panel = w + p * K * kLanes;
    const int64_t n0 = p * kLanes, cols = std::min(np * kLanes, N - n0);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t m0 = b * mb, rows = std::min(mb, M - m0);
      const bool direct = cols == np * kLanes;
      float* out = direct ? y + m0 * N + n0 : tile;
      const int64_t ldo = direct ? N : kTile;
      const W* ahead = panel + (np * K + b * K / blocks) * kLanes;
      const int64_t step = (1 << 16) / blocks;
      if (b < full)
        (np > 1 ? kn.packed_wide : kn.packed_one)(
            packed + m0 * K, 0, panel, K * kLanes, K, out, ldo, false, ahead,
            step);
      else
        (np > 1 ? kn.wide : kn.one)[rows](x + m0 * K, K, panel, K * kLanes, K,
                                         out, ldo, false, ahead, step);
      if (!direct)
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(y + (m0 + r) * N + n0, tile + r * kTile,
                      cols * sizeof(float));
    }
  }
}

// y = x @ w for w packed with weights of type W (ffi::F32 or ffi::BF16).
template <ffi::DataType WT>
ffi::Error SmallGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::Buffer<WT> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 ||
      wd[2] != kLanes || wd[1] != xd[1] || yd[0] != xd[0] ||
      (yd[1] + kLanes - 1) / kLanes != wd[0])
    return ffi::Error::InvalidArgument(
        "small_gemm: want x[M, K], w[ceil(N/16), K, 16], y[M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1], P = wd[0];
  const float* xp = x.typed_data();
  const auto* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  using W = std::remove_cv_t<std::remove_pointer_t<decltype(wp)>>;
  const int64_t together = Blocks<W>::cpu().panels;  // a block's panels
  if (M <= few_many()) {
    const int64_t chunk =
        std::max<int64_t>(1, P / (4 * threads * together)) * together;
    const int64_t tasks = (P + chunk - 1) / chunk;
    specjax::parallel_for(pool, tasks, [&](int64_t c) {
      panels(xp, M, K, wp, N, c * chunk, std::min(P, (c + 1) * chunk), yp);
    });
    return ffi::Error::Success();
  }
  // The rows' full blocks packed once, by every thread, into this thread's
  // buffer (kept between calls: it only grows, to the largest M x K seen).
  static thread_local std::vector<float> packed;
  const int64_t mb = Blocks<W>::cpu().rows;
  packed.resize(std::max<int64_t>(packed.size(), M / mb * mb * K));
  float* pk = packed.data();
  specjax::parallel_for(pool, M / mb, [&](int64_t b) {
    pack_rows(xp + b * mb * K, K, K, 1, mb, pk + b * mb * K);
  });
  // One block's panels a task, so that the threads finish within one small
  // task's time of each other.
  specjax::parallel_for(pool, (P + together - 1) / together, [&](int64_t c) {
    panels_many(xp, pk, M, K, wp, N, c * together,
                std::min(P, (c + 1) * together), yp);
  });
  return ffi::Error::Success();
}

}  // namespace

// The variant the kernels run on this CPU: 0 plain C++, 1 AVX2 + FMA,
// 2 AVX-512 (specjax.native.isa).
extern "C" int SpecjaxIsa() { return static_cast<int>(specjax::isa()); }

#define SPECJAX_SMALL_GEMM(name, WT)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, SmallGemm<WT>,                  \
                                ffi::Ffi::Bind()                      \
                                    .Ctx<ffi::ThreadPool>()           \
                                    .Arg<ffi::Buffer<ffi::F32>>()     \
                                    .Arg<ffi::Buffer<WT>>()           \
                                    .Ret<ffi::Buffer<ffi::F32>>());
SPECJAX_SMALL_GEMM(SpecjaxSmallGemm, ffi::F32)
SPECJAX_SMALL_GEMM(SpecjaxSmallGemmBf16, ffi::BF16)
#undef SPECJAX_SMALL_GEMM
