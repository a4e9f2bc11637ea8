// exp(x) for x <= 0 in float arithmetic the compiler vectorises (shared by chain_cpu.cpp and tree_cpu.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace echo {

// exp(x) for x <= 0 (x - max of a row; -inf allowed) in float arithmetic only, so that loops over it vectorise
// (with -fno-trapping-math, csrc/build.py: it lets the compiler turn the clamps into selects): 2^t with
// t = x log2(e) clamped to [-126, 0], split as n + f (n = t rounded to nearest by the 1.5 * 2^23 trick, f in
// [-0.5, 0.5]); 2^f by its degree-6 Taylor polynomial (error < 2e-7 relative); 2^n from the exponent bits. Below
// 2^-126 (x < -87.3) the result is 2^-126 instead of 0: at most V * 1e-38 in a sum that is >= 1. NaN in: NaN out.
inline float exp_nonpositive(float x) {
  float t = x * 1.44269504088896341f;
  t = t < -126.0f ? -126.0f : t;
  t = t > 0.0f ? 0.0f : t;
  const float rounded = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22); no -ffast-math here
  const float f = (t - rounded) * 0.693147180559945309f;   // in [-0.347, 0.347]
  const float p =
      1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
  const int32_t bits = (static_cast<int32_t>(rounded) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace echo
