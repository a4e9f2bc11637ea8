// AVX2 + FMA building blocks shared by the CPU ops (tree_cpu.cpp's fix-up attention, chain_cpu.cpp's draft
// log-probs). The extension is built once for every x86-64 CPU at the baseline ISA; these functions carry target
// attributes and run only where `avx2_enabled` says the CPU has AVX2 and FMA (chosen at run time, per call).
#pragma once

#include "exp_poly.h"

#include <cstdlib>

#if defined(__x86_64__) && defined(__GNUC__)
#define ECHO_HAVE_AVX2 1
#include <immintrin.h>

namespace echo {

// exp_nonpositive on 8 lanes (the same steps; the polynomial with FMA). NaN lanes come out finite (the clamps'
// max/min return their second operand): callers that can see NaN test for it first.
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive8(__m256 x) {
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-126.0f)), _mm256_setzero_ps());
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 rounded = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, rounded), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(rounded), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Whether to run the AVX2 builds: the CPU has AVX2 and FMA, and `force_env` (e.g. ECHO_TREE_BASELINE_ISA) is
// not "1" (the tests run both builds on an AVX2 machine; read per call so that they can switch).
inline bool avx2_enabled(const char* force_env) {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const char* force = std::getenv(force_env);
  return has && !(force != nullptr && force[0] == '1');
}

}  // namespace echo
#endif
