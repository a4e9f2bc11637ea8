// Order-preserving keys for echo::select_budget, shared by the CPU op and the CUDA kernel.
//
// Depends on nothing but <cstdint>/<cstring>, so that csrc/budget_cuda.cu compiles with a bare nvcc.
//
// The specification (echo_vllm/core/budget.py, select_budget_reference) ranks the eligible nodes of the whole
// batch by the total order (class asc, score desc, depth asc, flat index asc). Classes are resolved by counting
// (every class-0 node precedes every class-1 node), so the keys below only need to order *within* a class:
//
//   key = (score_key_desc(score) << 32) | (depth ^ 0x80000000)     (uint64, ascending = better)
//
// with the flat index b * N + n as the final tie-breaker. NaN scores never reach a key (class 2).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ECHO_HD __host__ __device__ __forceinline__
#else
#define ECHO_HD inline
#endif

namespace echo {
namespace budget {

constexpr uint8_t kClassDepth = 0;
constexpr uint8_t kClassWidth = 1;
constexpr uint8_t kClassExcluded = 2;

ECHO_HD uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

// NaN test on the bits, immune to -ffast-math style assumptions.
ECHO_HD bool is_nan(float value) { return (float_bits(value) & 0x7fffffffu) > 0x7f800000u; }

// Score key, ascending = higher score. `+ 0.0f` mirrors the reference's `scores + 0.0` (folding -0.0 into
// 0.0, and flushing a denormal exactly when the reference's own add would); the explicit fold keeps -0.0 == 0.0
// under any rounding mode.
ECHO_HD uint32_t score_key_desc(float score) {
  uint32_t bits = float_bits(score + 0.0f);
  if (bits == 0x80000000u) {
    bits = 0u;
  }
  const uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ~ascending;
}

ECHO_HD uint64_t order_key(float score, int32_t depth) {
  return (static_cast<uint64_t>(score_key_desc(score)) << 32) | (static_cast<uint32_t>(depth) ^ 0x80000000u);
}

// Class of one node (the reference's candidate_class).
ECHO_HD uint8_t candidate_class(bool valid, bool spine, bool truncated, int32_t depth, int32_t depth_cap,
                                float score) {
  const bool usable = valid && depth <= depth_cap && !is_nan(score);
  if (!usable) {
    return kClassExcluded;
  }
  if (spine) {
    return kClassDepth;
  }
  return truncated ? kClassWidth : kClassExcluded;
}

}  // namespace budget
}  // namespace echo
