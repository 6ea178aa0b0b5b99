// Attention of T new tokens over a row's KV cache, for decode and verify
// steps and prefill chunks on the CPU, as an XLA FFI custom call. XLA's version
// computes every one of the cache's S slots through small batched dots and a
// softmax over [B, G, T * R, S], and costs a third of a SmolLM2 decode step
// (18 of 55 ms at 256 cached tokens in a 512-slot cache; 65 of 115 ms at
// batch 8). This one reads each row's keys and values only up to the slots
// in use and skips masked ones: the rows' stale slots are never read. With
// AVX-512 or AVX2 both products are blocked in registers (a key or value
// vector loaded once for several queries) and the cache lines are
// prefetched: 30 layers at 8 new tokens took 2.2 ms with AVX2 (5.5 ms with
// GCC's vectorized loops alone). A prefill chunk (up to 512 tokens) runs in
// tasks of 16 tokens, each reading the chunk's tokens only up to the last
// one it sees (causal: half of them on average; docs/RESULTS.md, "Prefill").
//
// New token t of row b sees the row's prefix, cache slots s < lengths[b],
// and new token u iff mask[b, t, u]. The new tokens' keys and values come
// as their own operands, k_new and v_new [B, T, G, H]: the cache is only
// read, below each row's length, so a verify forward can leave it untouched
// (the engine writes what it keeps afterwards) and a row's stale slots are
// never read. Queries are grouped per kv head: query head n reads kv head
// n / R.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Cache reads prefetched ahead: slots of a key row (the next blocks' lines;
// the 64 rows of a block are 64 lines apart, which the hardware prefetchers
// do not follow) and value rows.
constexpr int64_t kAheadK = 64;
constexpr int64_t kAheadV = 8;
constexpr float kMasked = -std::numeric_limits<float>::infinity();

// exp(x) for the softmax's x <= 0, branch-free so that GCC vectorizes the
// loop (std::exp is a scalar libm call: at 8 new tokens it cost more than
// the rest of the attention). Cephes' expf: x = n ln 2 + r with n rounded to
// nearest (adding and subtracting 1.5 * 2^23), |r| <= ln 2 / 2, a
// polynomial for e^r (relative error ~1e-7), 2^n put into the exponent
// bits. Below -87 (masked slots are -inf) it returns 0. The loop over it
// vectorizes with -fno-trapping-math (the Makefile's flags).
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float xc = std::max(x, -87.0f);
  const float n = (xc * 1.44269504088896341f + kRound) - kRound;
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) * (1 << 23);
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale * static_cast<float>(x >= -87.0f);
}

// The three steps of one task, (row, kv head, new tokens [t0, t1)): its
// Q = (t1 - t0) * R queries, ordered t then r, scaled by 1 / sqrt(H) into
// qs[Q, H]; their scores over the `used` slots (row stride ld >= used);
// the softmax over the visible ones; the probability-weighted sum of the
// value rows. k: [H, S] (transposed), v: [S, H]; mask: the row's [T, T].
// Plain C++ here (GCC vectorizes the slot loops); attend_avx2 blocks the
// products in registers.

// scores[i, s] for s in [s0, s1): the slot loop innermost (contiguous k).
__attribute__((always_inline)) inline void scores_plain(
    const float* qs, int64_t Q, const float* k, int64_t H, int64_t S,
    int64_t s0, int64_t s1, float* scores, int64_t ld) {
  for (int64_t i = 0; i < Q; ++i)
    std::fill(scores + i * ld + s0, scores + i * ld + s1, 0.0f);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < Q; ++i) {
      const float qh = qs[i * H + h];
      float* srow = scores + i * ld;
      for (int64_t s = s0; s < s1; ++s) srow[s] += qh * k[h * S + s];
    }
}

// Masked slots to -inf, then each row's softmax in place over [0, used).
// The max and the sum run as 8 partial results, which GCC vectorizes (one
// running value it may not reorder without -ffast-math: at 16 new tokens
// the scalar reductions cost more than the products).
__attribute__((always_inline)) inline void softmax_rows(
    float* scores, int64_t ld, int64_t Q, int64_t R, int64_t used,
    int64_t prefix, const bool* mask, int64_t t0, int64_t T) {
  constexpr int64_t kParts = 8;
  const int64_t whole = used / kParts * kParts;
  for (int64_t i = 0; i < Q; ++i) {
    float* srow = scores + i * ld;
    const bool* visible = mask + (t0 + i / R) * T;  // mask[t, :]
    for (int64_t s = prefix; s < used; ++s)
      if (!visible[s - prefix]) srow[s] = kMasked;
    float tops[kParts], sums[kParts];
    std::fill(tops, tops + kParts, kMasked);
    for (int64_t s = 0; s < whole; s += kParts)
      for (int64_t j = 0; j < kParts; ++j)
        tops[j] = std::max(tops[j], srow[s + j]);
    float top = *std::max_element(tops, tops + kParts);
    for (int64_t s = whole; s < used; ++s) top = std::max(top, srow[s]);
    for (int64_t s = 0; s < used; ++s)
      srow[s] = exp_nonpositive(srow[s] - top);
    std::fill(sums, sums + kParts, 0.0f);
    for (int64_t s = 0; s < whole; s += kParts)
      for (int64_t j = 0; j < kParts; ++j) sums[j] += srow[s + j];
    float sum = 0.0f;
    for (int64_t j = 0; j < kParts; ++j) sum += sums[j];
    for (int64_t s = whole; s < used; ++s) sum += srow[s];
    const float inv = 1.0f / sum;
    for (int64_t s = 0; s < used; ++s) srow[s] *= inv;
  }
}

// out[i, :] = sum over s < used of p[i, s] v[s, :]; query i's output row
// at out + (i / R) * stride + (i % R) * H.
__attribute__((always_inline)) inline void values_plain(
    const float* p, int64_t ld, int64_t Q, int64_t R, const float* v,
    int64_t H, int64_t used, float* out, int64_t stride) {
  for (int64_t i = 0; i < Q; ++i) {
    float* orow = out + (i / R) * stride + (i % R) * H;
    std::fill(orow, orow + H, 0.0f);
    for (int64_t s = 0; s < used; ++s)
      for (int64_t j = 0; j < H; ++j) orow[j] += p[i * ld + s] * v[s * H + j];
  }
}

struct Task {
  const float* q;  // token t0's first query head of the group
  const float* k;  // [H, S]
  const float* v;  // [S, H]
  const float* k_new;  // new token u's key at k_new + u * new_stride, [H]
  const float* v_new;  // and value
  float* out;      // as q
  int64_t stride;  // between tokens in q and out: N * H
  int64_t new_stride;  // between new tokens in k_new and v_new: G * H
  // used = prefix + tn: the task reads new tokens [0, tn), past the last
  // one its tokens see (a causal prefill chunk's token t sees t + 1).
  int64_t H, S, used, prefix, t0, t1, T, tn, R;
  const bool* mask;  // the row's [T, T]
};

// Scores of the new tokens: scores[i, prefix + u] = qs[i] . k_new[u].
__attribute__((always_inline)) inline void scores_new(const Task& t,
                                                      const float* qs,
                                                      int64_t Q, float* scores,
                                                      int64_t ld) {
  for (int64_t i = 0; i < Q; ++i)
    for (int64_t u = 0; u < t.tn; ++u) {
      const float* kn = t.k_new + u * t.new_stride;
      float acc = 0.0f;
      for (int64_t h = 0; h < t.H; ++h) acc += qs[i * t.H + h] * kn[h];
      scores[i * ld + t.prefix + u] = acc;
    }
}

// out[i, :] += sum over new tokens u of p[i, prefix + u] v_new[u, :].
__attribute__((always_inline)) inline void values_new(const Task& t,
                                                      const float* p,
                                                      int64_t Q, int64_t ld) {
  for (int64_t i = 0; i < Q; ++i) {
    float* orow = t.out + (i / t.R) * t.stride + (i % t.R) * t.H;
    for (int64_t u = 0; u < t.tn; ++u) {
      const float pu = p[i * ld + t.prefix + u];
      const float* vn = t.v_new + u * t.new_stride;
      for (int64_t j = 0; j < t.H; ++j) orow[j] += pu * vn[j];
    }
  }
}

// Scaled queries, contiguous: qs[Q, H].
__attribute__((always_inline)) inline void scale_queries(const Task& t,
                                                         float* qs) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(t.H));
  for (int64_t i = 0; i < (t.t1 - t.t0) * t.R; ++i)
    for (int64_t h = 0; h < t.H; ++h)
      qs[i * t.H + h] =
          t.q[(i / t.R) * t.stride + (i % t.R) * t.H + h] * scale;
}

// Slots rounded up to whole blocks of 16.
int64_t blocks16(int64_t n) { return (n + 15) / 16 * 16; }

// The row stride of a task's scores: room for the prefix's blocks of 16
// slots and, after the prefix, the new tokens' (attend_avx2 writes whole
// blocks).
int64_t score_stride(int64_t prefix, int64_t T) {
  return blocks16(prefix) + blocks16(T);
}

void attend_generic(const Task& t, float* qs, float* scores) {
  const int64_t Q = (t.t1 - t.t0) * t.R, ld = score_stride(t.prefix, t.tn);
  scale_queries(t, qs);
  scores_plain(qs, Q, t.k, t.H, t.S, 0, t.prefix, scores, ld);
  scores_new(t, qs, Q, scores, ld);
  softmax_rows(scores, ld, Q, t.R, t.used, t.prefix, t.mask, t.t0, t.T);
  values_plain(scores, ld, Q, t.R, t.v, t.H, t.prefix, t.out, t.stride);
  values_new(t, scores, Q, ld);
}

// AVX2 + FMA. Scores: QB <= 4 queries x 16 slots in 8 ymm accumulators,
// each key vector loaded once for the QB queries. Slots past `used` (up to
// the next multiple of 16 inside the buffer) get scores nobody reads. Named
// accumulators, not arrays: GCC stores an array back on every iteration.
template <int QB>
__attribute__((target("avx2,fma"))) void scores_avx2(
    const float* qs, const float* k, int64_t H, int64_t S, int64_t s0,
    float* scores, int64_t ld) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0,
         h2 = l0, l3 = l0, h3 = l0;
  for (int64_t h = 0; h < H; ++h) {
    _mm_prefetch(reinterpret_cast<const char*>(k + h * S + s0 + kAheadK),
                 _MM_HINT_T0);
    const __m256 k0 = _mm256_loadu_ps(k + h * S + s0);
    const __m256 k1 = _mm256_loadu_ps(k + h * S + s0 + 8);
#define SPECJAX_QUERY(i)                                       \
  if constexpr (QB > i) {                                      \
    const __m256 qb = _mm256_broadcast_ss(qs + i * H + h);     \
    l##i = _mm256_fmadd_ps(qb, k0, l##i);                      \
    h##i = _mm256_fmadd_ps(qb, k1, h##i);                      \
  }
    SPECJAX_QUERY(0) SPECJAX_QUERY(1) SPECJAX_QUERY(2) SPECJAX_QUERY(3)
#undef SPECJAX_QUERY
  }
  const __m256 rows[8] = {l0, h0, l1, h1, l2, h2, l3, h3};
  for (int i = 0; i < QB; ++i) {
    _mm256_storeu_ps(scores + i * ld + s0, rows[2 * i]);
    _mm256_storeu_ps(scores + i * ld + s0 + 8, rows[2 * i + 1]);
  }
}

// Values: QB <= 3 queries x DV <= 4 vectors of head dims [d0, d0 + 8 DV)
// in 12 accumulators, each value vector loaded once for the QB queries.
template <int QB, int DV>
__attribute__((target("avx2,fma"))) void values_avx2(
    const float* p, int64_t ld, const float* v, int64_t H, int64_t used,
    int64_t d0, float* const* outs) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00,
         a10 = a00, a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00,
         a22 = a00, a23 = a00;
  for (int64_t s = 0; s < used; ++s) {
    const float* vs = v + s * H + d0;
    _mm_prefetch(reinterpret_cast<const char*>(vs + kAheadV * H), _MM_HINT_T0);
    const __m256 p0 = _mm256_broadcast_ss(p + s);
    const __m256 p1 = QB > 1 ? _mm256_broadcast_ss(p + ld + s) : p0;
    const __m256 p2 = QB > 2 ? _mm256_broadcast_ss(p + 2 * ld + s) : p0;
#define SPECJAX_DIMS(j)                                          \
  if constexpr (DV > j) {                                        \
    const __m256 vv = _mm256_loadu_ps(vs + 8 * j);               \
    a0##j = _mm256_fmadd_ps(p0, vv, a0##j);                      \
    if constexpr (QB > 1) a1##j = _mm256_fmadd_ps(p1, vv, a1##j); \
    if constexpr (QB > 2) a2##j = _mm256_fmadd_ps(p2, vv, a2##j); \
  }
    SPECJAX_DIMS(0) SPECJAX_DIMS(1) SPECJAX_DIMS(2) SPECJAX_DIMS(3)
#undef SPECJAX_DIMS
  }
  const __m256 acc[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13},
                            {a20, a21, a22, a23}};
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < DV; ++j)
      _mm256_storeu_ps(outs[i] + d0 + 8 * j, acc[i][j]);
}

using ScoresFn = void (*)(const float*, const float*, int64_t, int64_t,
                          int64_t, float*, int64_t);
using ValuesFn = void (*)(const float*, int64_t, const float*, int64_t,
                          int64_t, int64_t, float* const*);

// AVX-512: a 16-slot block or 16 head dims are one zmm. Scores: QB <= 8
// queries x 16 slots in 8 accumulators; values: QB <= 6 queries x DV <= 4
// vectors of head dims [d0, d0 + 16 DV) in 24. Twice the AVX2 blocks' work
// a loaded vector.
template <int QB>
__attribute__((target("avx512f"))) void scores_avx512(
    const float* qs, const float* k, int64_t H, int64_t S, int64_t s0,
    float* scores, int64_t ld) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0,
         c5 = c0, c6 = c0, c7 = c0;
  for (int64_t h = 0; h < H; ++h) {
    _mm_prefetch(reinterpret_cast<const char*>(k + h * S + s0 + kAheadK),
                 _MM_HINT_T0);
    const __m512 kv = _mm512_loadu_ps(k + h * S + s0);
#define SPECJAX_QUERY(i)                                                    \
  if constexpr (QB > i)                                                     \
    c##i = _mm512_fmadd_ps(_mm512_set1_ps(qs[i * H + h]), kv, c##i);
    SPECJAX_QUERY(0) SPECJAX_QUERY(1) SPECJAX_QUERY(2) SPECJAX_QUERY(3)
    SPECJAX_QUERY(4) SPECJAX_QUERY(5) SPECJAX_QUERY(6) SPECJAX_QUERY(7)
#undef SPECJAX_QUERY
  }
#define SPECJAX_STORE(i) \
  if constexpr (QB > i) _mm512_storeu_ps(scores + i * ld + s0, c##i);
  SPECJAX_STORE(0) SPECJAX_STORE(1) SPECJAX_STORE(2) SPECJAX_STORE(3)
  SPECJAX_STORE(4) SPECJAX_STORE(5) SPECJAX_STORE(6) SPECJAX_STORE(7)
#undef SPECJAX_STORE
}

template <int QB, int DV>
__attribute__((target("avx512f"))) void values_avx512(
    const float* p, int64_t ld, const float* v, int64_t H, int64_t used,
    int64_t d0, float* const* outs) {
#define SPECJAX_ACC(i) \
  __m512 a##i##0 = _mm512_setzero_ps(), a##i##1 = a##i##0, a##i##2 = a##i##0, \
         a##i##3 = a##i##0;
  SPECJAX_ACC(0) SPECJAX_ACC(1) SPECJAX_ACC(2)
  SPECJAX_ACC(3) SPECJAX_ACC(4) SPECJAX_ACC(5)
#undef SPECJAX_ACC
  for (int64_t s = 0; s < used; ++s) {
    const float* vs = v + s * H + d0;
    _mm_prefetch(reinterpret_cast<const char*>(vs + kAheadV * H), _MM_HINT_T0);
#define SPECJAX_PROB(i) \
  const __m512 p##i = _mm512_set1_ps(p[(QB > i ? i : 0) * ld + s]);
    SPECJAX_PROB(0) SPECJAX_PROB(1) SPECJAX_PROB(2)
    SPECJAX_PROB(3) SPECJAX_PROB(4) SPECJAX_PROB(5)
#undef SPECJAX_PROB
#define SPECJAX_FMA(i, j) \
  if constexpr (QB > i) a##i##j = _mm512_fmadd_ps(p##i, vv, a##i##j);
#define SPECJAX_DIMS(j)                                                      \
  if constexpr (DV > j) {                                                    \
    const __m512 vv = _mm512_loadu_ps(vs + 16 * j);                          \
    SPECJAX_FMA(0, j) SPECJAX_FMA(1, j) SPECJAX_FMA(2, j)                    \
    SPECJAX_FMA(3, j) SPECJAX_FMA(4, j) SPECJAX_FMA(5, j)                    \
  }
    SPECJAX_DIMS(0) SPECJAX_DIMS(1) SPECJAX_DIMS(2) SPECJAX_DIMS(3)
#undef SPECJAX_DIMS
#undef SPECJAX_FMA
  }
#define SPECJAX_STORE(i, j) \
  if constexpr (QB > i && DV > j) \
    _mm512_storeu_ps(outs[i] + d0 + 16 * j, a##i##j);
#define SPECJAX_STORES(i) \
  SPECJAX_STORE(i, 0) SPECJAX_STORE(i, 1) SPECJAX_STORE(i, 2) SPECJAX_STORE(i, 3)
  SPECJAX_STORES(0) SPECJAX_STORES(1) SPECJAX_STORES(2)
  SPECJAX_STORES(3) SPECJAX_STORES(4) SPECJAX_STORES(5)
#undef SPECJAX_STORES
#undef SPECJAX_STORE
}

#define SPECJAX_VALUES(f, q) {nullptr, f<q, 1>, f<q, 2>, f<q, 3>, f<q, 4>}
// The register blocks of one instruction set: queries a scores call takes,
// queries and dims (vectors of kLanes) a values call takes.
struct Avx2 {
  static constexpr int64_t kScoreQ = 4, kValueQ = 3, kLanes = 8;
  static constexpr ScoresFn scores[kScoreQ + 1] = {
      nullptr, scores_avx2<1>, scores_avx2<2>, scores_avx2<3>,
      scores_avx2<4>};
  static constexpr ValuesFn values[kValueQ + 1][5] = {
      {}, SPECJAX_VALUES(values_avx2, 1), SPECJAX_VALUES(values_avx2, 2),
      SPECJAX_VALUES(values_avx2, 3)};
};
struct Avx512 {
  static constexpr int64_t kScoreQ = 8, kValueQ = 6, kLanes = 16;
  static constexpr ScoresFn scores[kScoreQ + 1] = {
      nullptr,          scores_avx512<1>, scores_avx512<2>,
      scores_avx512<3>, scores_avx512<4>, scores_avx512<5>,
      scores_avx512<6>, scores_avx512<7>, scores_avx512<8>};
  static constexpr ValuesFn values[kValueQ + 1][5] = {
      {},
      SPECJAX_VALUES(values_avx512, 1), SPECJAX_VALUES(values_avx512, 2),
      SPECJAX_VALUES(values_avx512, 3), SPECJAX_VALUES(values_avx512, 4),
      SPECJAX_VALUES(values_avx512, 5), SPECJAX_VALUES(values_avx512, 6)};
};
#undef SPECJAX_VALUES

// A task with the register-blocked products of instruction set P (H a
// multiple of P::kLanes; attend chooses); inlined into a wrapper compiled
// for P, so the softmax and the small loops are vectorized for it too.
template <class P>
__attribute__((always_inline)) inline void attend_blocked(const Task& t,
                                                          float* qs,
                                                          float* scores,
                                                          float* kt) {
  const int64_t Q = (t.t1 - t.t0) * t.R, ld = score_stride(t.prefix, t.tn);
  const auto score = [&](const float* keys, int64_t stride, int64_t s0,
                         float* out) {
    for (int64_t i = 0; i < Q; i += P::kScoreQ)
      P::scores[std::min(P::kScoreQ, Q - i)](qs + i * t.H, keys, t.H, stride,
                                             s0, out + i * ld, ld);
  };
  scale_queries(t, qs);
  // The prefix's slots in blocks of 16 (a last block may spill past the
  // prefix inside the buffer: those scores are overwritten just below).
  int64_t s0 = 0;
  for (; s0 < t.prefix && s0 + 16 <= t.S; s0 += 16) score(t.k, t.S, s0, scores);
  if (s0 < t.prefix)  // the last slots of the cache: fewer than 16
    scores_plain(qs, Q, t.k, t.H, t.S, s0, t.prefix, scores, ld);
  // The new tokens' keys as an [H, Tp] block (zero-padded to whole blocks
  // of 16), scored like cache slots, right after the prefix's (past
  // `used`, the padding's scores are never read).
  const int64_t Tp = blocks16(t.tn);
  for (int64_t h = 0; h < t.H; ++h)
    for (int64_t u = 0; u < Tp; ++u)
      kt[h * Tp + u] = u < t.tn ? t.k_new[u * t.new_stride + h] : 0.0f;
  for (int64_t u0 = 0; u0 < Tp; u0 += 16) score(kt, Tp, u0, scores + t.prefix);
  softmax_rows(scores, ld, Q, t.R, t.used, t.prefix, t.mask, t.t0, t.T);
  for (int64_t i = 0; i < Q; i += P::kValueQ) {
    const int64_t qb = std::min(P::kValueQ, Q - i);
    float* outs[P::kValueQ];
    for (int64_t j = 0; j < qb; ++j)
      outs[j] = t.out + ((i + j) / t.R) * t.stride + ((i + j) % t.R) * t.H;
    for (int64_t d0 = 0; d0 < t.H; d0 += 4 * P::kLanes)
      P::values[qb][std::min<int64_t>(4, (t.H - d0) / P::kLanes)](
          scores + i * ld, ld, t.v, t.H, t.prefix, d0, outs);
  }
  values_new(t, scores, Q, ld);
}

__attribute__((target("avx2,fma"))) void attend_avx2(const Task& t,
                                                     float* qs, float* scores,
                                                     float* kt) {
  attend_blocked<Avx2>(t, qs, scores, kt);
}

__attribute__((target("avx512f"))) void attend_avx512(const Task& t,
                                                      float* qs,
                                                      float* scores,
                                                      float* kt) {
  attend_blocked<Avx512>(t, qs, scores, kt);
}

// The variant for this CPU and head size (specjax::isa).
const specjax::Isa kIsa = specjax::isa();

// Scratch: qs [Q, H], scores [Q, score_stride], kt [H, blocks16(T)].
void attend(const Task& t, float* qs, float* scores, float* kt) {
  if (kIsa == specjax::Isa::kAvx512 && t.H % 16 == 0)
    attend_avx512(t, qs, scores, kt);
  else if (kIsa != specjax::Isa::kGeneric && t.H % 8 == 0)
    attend_avx2(t, qs, scores, kt);
  else
    attend_generic(t, qs, scores);
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                     ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                     ffi::Buffer<ffi::S32> lengths,
                     ffi::Buffer<ffi::PRED> mask,
                     ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  auto knd = k_new.dimensions(), vnd = v_new.dimensions();
  auto md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 3 ||
      knd.size() != 4 || vnd.size() != 4)
    return ffi::Error::InvalidArgument("attention: bad ranks");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3];
  const int64_t G = kd[1], S = kd[3];
  bool ok = kd[0] == B && kd[2] == H && vd[0] == B && vd[1] == G &&
            vd[2] == S && vd[3] == H && N % G == 0 && md[0] == B &&
            md[1] == T && md[2] == T && lengths.dimensions()[0] == B;
  for (auto nd : {knd, vnd})
    ok = ok && nd[0] == B && nd[1] == T && nd[2] == G && nd[3] == H;
  if (!ok)
    return ffi::Error::InvalidArgument(
        "attention: want q[B, T, N, H], k[B, G, H, S], v[B, G, S, H], "
        "k_new and v_new [B, T, G, H], lengths[B], mask[B, T, T]");
  const int64_t R = N / G;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const float* knp = k_new.typed_data();
  const float* vnp = v_new.typed_data();
  const int32_t* lp = lengths.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  // Tasks: (row, kv head, up to `per` new tokens): 2, so that a verify of
  // T tokens at batch 1 still gives every thread work; 16 past 64 tokens (a
  // prefill chunk), so that a task's queries share its keys' transpose.
  const int64_t per = T <= 64 ? 2 : 16;
  const int64_t blocks = (T + per - 1) / per;
  specjax::parallel_for(pool, B * G * blocks, [&](int64_t task) {
    const int64_t b = task / (G * blocks), g = task / blocks % G;
    const int64_t t0 = task % blocks * per;
    const int64_t t1 = std::min(T, t0 + per);
    const int64_t prefix = std::clamp<int64_t>(lp[b], 0, S);
    const bool* row_mask = mp + b * T * T;
    int64_t tn = 0;  // one past the last new token these tokens see
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t u = T; u > tn; --u)
        if (row_mask[t * T + u - 1]) {
          tn = u;
          break;
        }
    const int64_t Q = (t1 - t0) * R;
    const int64_t ld = score_stride(prefix, tn);
    // Per thread, kept between calls (it only grows): a prefill chunk's
    // scores are megabytes, which a fresh allocation would page in per task.
    static thread_local std::vector<float> scratch;
    const size_t need = Q * (H + ld) + H * blocks16(tn);
    if (scratch.size() < need) scratch.resize(need);
    const int64_t at = ((b * T + t0) * N + g * R) * H;
    const int64_t at_new = (b * T * G + g) * H;
    attend(Task{qp + at, kp + (b * G + g) * H * S, vp + (b * G + g) * S * H,
                knp + at_new, vnp + at_new, op + at, N * H, G * H, H, S,
                prefix + tn, prefix, t0, t1, T, tn, R, row_mask},
           scratch.data(), scratch.data() + Q * H,
           scratch.data() + Q * (H + ld));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
