// Which build of the CPU ops that have one ran (avx2_math.h): calls per kernel and build, counted once per
// parallel chunk. Read by `echo::cpu_isa_calls` so that a test on an AVX2 machine proves the AVX2 branch is the
// one taken (a dispatch that always fell back to the baseline would still give the same outputs).
#pragma once

#include <atomic>
#include <cstdint>

namespace echo {

enum class IsaKernel : int { kDraftLogp = 0, kTreeFixAttention = 1 };
constexpr int kIsaKernels = 2;

// [kernel * 2 + 0]: AVX2 build, [kernel * 2 + 1]: baseline build. One array for the whole library (an inline
// function's static is shared across translation units).
inline std::atomic<int64_t>* isa_call_counts() {
  static std::atomic<int64_t> counts[kIsaKernels * 2] = {};
  return counts;
}

inline void count_isa_call(IsaKernel kernel, bool avx2) {
  isa_call_counts()[static_cast<int>(kernel) * 2 + (avx2 ? 0 : 1)].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace echo
