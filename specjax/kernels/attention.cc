// Attention of T new tokens over a row's KV cache, for decode and verify
// steps on the CPU, as an XLA FFI custom call (issue 17). XLA's version
// computes every one of the cache's S slots through small batched dots and a
// softmax over [B, G, T * R, S], and costs a third of a SmolLM2 decode step
// (18 of 55 ms at 256 cached tokens in a 512-slot cache; 65 of 115 ms at
// batch 8). This one reads each row's keys and values only up to the slots
// in use and skips masked ones: the rows' stale slots are never read.
//
// Slot s is visible to new token t of row b iff s < lengths[b] (the row's
// prefix) or s = lengths[b] + u with mask[b, t, u] (the new tokens, already
// written into the cache), and s < S. Queries are grouped per kv head: query
// head n reads kv head n / R.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// One (row, kv head), new tokens [t0, t1): their (t1 - t0) * R queries
// (ordered t then r) against `used` slots. q and out point at token t0's
// first query head of the group, rows strided by `stride` (N * H); k:
// [H, S] (transposed), v: [S, H]; mask: the row's [T, T]. The inner loops
// run over contiguous slots or head dims, which GCC vectorizes: with AVX2 +
// FMA where the CPU has them (attend_avx2), else SSE2 (attend_generic).
__attribute__((always_inline)) inline void attend(const float* q, const float* k, const float* v, float* out,
            int64_t stride, int64_t H, int64_t S, int64_t used,
            int64_t prefix, const bool* mask, int64_t t0, int64_t t1,
            int64_t T, int64_t R, float* scores) {
  const int64_t Q = (t1 - t0) * R;
  const float scale = 1.0f / std::sqrt(static_cast<float>(H));
  std::fill(scores, scores + Q * used, 0.0f);
  for (int64_t h = 0; h < H; ++h) {
    const float* krow = k + h * S;
    for (int64_t i = 0; i < Q; ++i) {
      const float qh = q[(i / R) * stride + (i % R) * H + h] * scale;
      float* srow = scores + i * used;
      for (int64_t s = 0; s < used; ++s) srow[s] += qh * krow[s];
    }
  }
  for (int64_t i = 0; i < Q; ++i) {
    float* srow = scores + i * used;
    const bool* visible = mask + (t0 + i / R) * T;  // mask[t, :]
    for (int64_t s = prefix; s < used; ++s)
      if (!visible[s - prefix]) srow[s] = kMasked;
    float top = kMasked;
    for (int64_t s = 0; s < used; ++s) top = std::max(top, srow[s]);
    for (int64_t s = 0; s < used; ++s)
      srow[s] = exp_nonpositive(srow[s] - top);
    float sum = 0.0f;
    for (int64_t s = 0; s < used; ++s) sum += srow[s];
    const float inv = 1.0f / sum;
    float* orow = out + (i / R) * stride + (i % R) * H;
    std::fill(orow, orow + H, 0.0f);
    for (int64_t s = 0; s < used; ++s) {
      const float p = srow[s] * inv;
      const float* vrow = v + s * H;
      for (int64_t j = 0; j < H; ++j) orow[j] += p * vrow[j];
    }
  }
}

#define SPECJAX_ATTEND_ARGS                                               \
  const float *q, const float *k, const float *v, float *out,            \
      int64_t stride, int64_t H, int64_t S, int64_t used, int64_t prefix, \
      const bool *mask, int64_t t0, int64_t t1, int64_t T, int64_t R,     \
      float *scores
#define SPECJAX_ATTEND_CALL \
  attend(q, k, v, out, stride, H, S, used, prefix, mask, t0, t1, T, R, scores)
__attribute__((target("avx2,fma"))) void attend_avx2(SPECJAX_ATTEND_ARGS) {
  SPECJAX_ATTEND_CALL;
}
void attend_generic(SPECJAX_ATTEND_ARGS) { SPECJAX_ATTEND_CALL; }
#undef SPECJAX_ATTEND_ARGS
#undef SPECJAX_ATTEND_CALL

// The variant for this CPU, chosen once by its features.
using AttendFn = decltype(&attend_generic);
AttendFn choose_attend() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
             ? attend_avx2 : attend_generic;
}
const AttendFn kAttend = choose_attend();

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                     ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::S32> lengths,
                     ffi::Buffer<ffi::PRED> mask,
                     ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  auto md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 3)
    return ffi::Error::InvalidArgument("attention: bad ranks");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3];
  const int64_t G = kd[1], S = kd[3];
  if (kd[0] != B || kd[2] != H || vd[0] != B || vd[1] != G || vd[2] != S ||
      vd[3] != H || N % G != 0 || md[0] != B || md[1] != T || md[2] != T ||
      lengths.dimensions()[0] != B)
    return ffi::Error::InvalidArgument(
        "attention: want q[B, T, N, H], k[B, G, H, S], v[B, G, S, H], "
        "lengths[B], mask[B, T, T]");
  const int64_t R = N / G;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* lp = lengths.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  // Tasks: (row, kv head, up to kTokens new tokens), so that a verify of
  // T tokens at batch 1 still gives every thread work.
  constexpr int64_t kTokens = 2;
  const int64_t blocks = (T + kTokens - 1) / kTokens;
  specjax::parallel_for(pool, B * G * blocks, [&](int64_t task) {
    const int64_t b = task / (G * blocks), g = task / blocks % G;
    const int64_t t0 = task % blocks * kTokens;
    const int64_t t1 = std::min(T, t0 + kTokens);
    const int64_t prefix = std::clamp<int64_t>(lp[b], 0, S);
    const int64_t used = std::min<int64_t>(prefix + T, S);
    std::vector<float> scores((t1 - t0) * R * std::max<int64_t>(used, 1));
    const int64_t at = ((b * T + t0) * N + g * R) * H;
    kAttend(qp + at, kp + (b * G + g) * H * S, vp + (b * G + g) * S * H,
            op + at, N * H, H, S, used, prefix, mp + b * T * T, t0, t1, T, R,
            scores.data());
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
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
