// What the FFI kernels share: the CPU check their AVX2 variants dispatch on,
// and work shared out over XLA's intra-op thread pool.
#ifndef SPECJAX_KERNELS_COMMON_H_
#define SPECJAX_KERNELS_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace specjax {

// Whether this CPU runs the AVX2 + FMA variants (an ISA check, not a model
// check).
inline bool has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

enum class Isa { kGeneric, kAvx2, kAvx512 };

// The widest variant this CPU runs, capped by the environment variable
// SPECJAX_NATIVE_ISA ("avx2" or "generic"; read once), so that a test can
// run the narrower variants on a wider CPU.
inline Isa isa() {
  static const Isa chosen = [] {
    __builtin_cpu_init();
    Isa best = __builtin_cpu_supports("avx512f") && has_avx2_fma() ? Isa::kAvx512
               : has_avx2_fma()                                    ? Isa::kAvx2
                                                                   : Isa::kGeneric;
    const char* cap = std::getenv("SPECJAX_NATIVE_ISA");
    if (cap && std::string(cap) == "avx2") best = std::min(best, Isa::kAvx2);
    if (cap && std::string(cap) == "generic") best = Isa::kGeneric;
    return best;
  }();
  return chosen;
}

// Runs fn(i) for i in [0, n). Items go out from a shared counter: the
// caller and the pool's threads take items until none is left, and the
// caller then waits only for items already taken, which are running: it
// never waits on a task still queued behind other work (XLA may run several
// independent custom calls at once on the same pool). The state outlives
// the call for tasks that start after it returned; they find no item and
// end. `fn` must stay valid until the call returns, which it does.
template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  const Fn* f = &fn;
  auto work = [n, f](Shared& s) {
    for (int64_t i; (i = s.next.fetch_add(1)) < n;) {
      (*f)(i);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t t = 1; t < std::min(threads, n); ++t)
    pool.Schedule([shared, work] { work(*shared); });
  work(*shared);
  while (shared->done.load(std::memory_order_acquire) < n)
    std::this_thread::yield();
}

}  // namespace specjax

#endif  // SPECJAX_KERNELS_COMMON_H_
