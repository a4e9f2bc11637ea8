// CPU kernels of ECHO's tree steps on vLLM's CPU_ATTN paged KV cache (echo_vllm/vllm/tree_attn_cpu.py):
//
// * echo::tree_fix_attention: the masked attention of a step's fix-up rows (the tree rows whose attention is not
//   causal), written over the rows the stock kernel got wrong. Twin of the torch path in tree_attn_cpu
//   (`_fix_tree_rows_torch`, the reference its tests compare with): float32 logits, softmax over the visible keys
//   (the request's context and root, positions 0..ctx, and the drafts whose bit the row carries), float32
//   weighted sum of the values, one rounding to the output dtype.
// * echo::tree_kv_compact: copy the K and V of slot src[i] to slot dst[i] in every KV head of one layer cache,
//   all sources read before any destination is written (the accepted path's KV moves).
//
// The cache page layout is the ISA's business (the vec kernels store K transposed): both ops read and write a
// (block, head) page only through the caller's kmap / vmap tables ([bs, D] int64: the offset of K[t, d] and
// V[t, d] in the page), which tree_attn_cpu.page_layout derives from vLLM's own cache writer. Plain C++, no
// ISA intrinsics: the inner loops run over contiguous float buffers the compiler vectorises.
//
// Work unit: one (request, KV head). Its keys are gathered once into a contiguous float buffer and shared by
// every fix row of that request and every query head of the KV head's group (GQA), which is what makes the
// kernel cheaper than a per-row loop. Two paths: for the layout of vLLM's x86 kernels (K transposed, V by rows;
// found affine at run time) a fast path whose loops run over contiguous runs (`fix_task_transposed_k`); for any
// other layout the generic one, which reads every element through the maps.
#include "check_msg.h"
#include "avx2_math.h"
#include "exp_poly.h"
#include "isa_calls.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace echo {
namespace {

void check_index(const at::Tensor& t, const char* name, int64_t dim) {
  ECHO_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor; got ", t.device());
  ECHO_CHECK_VALUE(t.dim() == dim, name, " must have ", dim, " dims; got shape ", t.sizes());
  ECHO_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name,
                  " must be int64 or int32; got ", t.scalar_type());
}

at::Tensor as_long(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }

void check_cache(const at::Tensor& kv_cache, const at::Tensor& kmap, const at::Tensor& vmap) {
  ECHO_CHECK_VALUE(kv_cache.device().is_cpu(), "kv_cache must be a CPU tensor; got ", kv_cache.device());
  ECHO_CHECK_VALUE(kv_cache.dim() == 4, "kv_cache must be [num_blocks, kv_heads, block_size, 2 * head_size]; got ",
                   kv_cache.sizes());
  ECHO_CHECK_VALUE(kv_cache.stride(3) == 1 && kv_cache.stride(2) == kv_cache.size(3),
                   "kv_cache: each (block, head) page must be contiguous; got strides ", kv_cache.strides());
  const int64_t block_size = kv_cache.size(2), head_size = kv_cache.size(3) / 2;
  for (const auto* m : {&kmap, &vmap}) {
    ECHO_CHECK_VALUE(m->dim() == 2 && m->size(0) == block_size && m->size(1) == head_size,
                     "kmap / vmap must be [block_size, head_size] = [", block_size, ", ", head_size, "]; got ",
                     m->sizes());
    ECHO_CHECK_TYPE(m->scalar_type() == at::kLong, "kmap / vmap must be int64; got ", m->scalar_type());
  }
}

// A page layout whose offsets are base + t * t_stride + d * d_stride for every (token t, dim d) of the page.
struct AffineLayout {
  bool affine = false;
  int64_t base = 0, t_stride = 0, d_stride = 0;
};

AffineLayout affine_layout(const int64_t* map, int64_t block_size, int64_t head_size) {
  AffineLayout l;
  l.base = map[0];
  l.t_stride = block_size > 1 ? map[head_size] - map[0] : 0;
  l.d_stride = head_size > 1 ? map[1] - map[0] : 0;
  for (int64_t t = 0; t < block_size; ++t) {
    for (int64_t d = 0; d < head_size; ++d) {
      if (map[t * head_size + d] != l.base + t * l.t_stride + d * l.d_stride) return l;
    }
  }
  l.affine = true;
  return l;
}

// The fast path of one (request, KV head) task, for the layout of vLLM's vec / vec16 CPU kernels: K stored
// transposed (a page's K[., d] is contiguous over tokens) and V by rows (V[t, .] contiguous over dims). The
// request's K is converted once into a float [D, keys] buffer (`convert_kv`) and V into [keys, D]; then
// `attend_*` computes every query row: logits accumulated d by d over chunks of keys, the masked softmax, the
// outputs key by key over chunks of dims, each chunk's sums held in registers. Two builds of `attend`: plain C++
// the compiler vectorises at the baseline ISA (any x86-64 or other CPU), and on x86 AVX2 + FMA intrinsics (two
// query rows at a time, eight 8-float accumulators in flight, a vector exp), chosen at run time by what the CPU
// supports: the extension is built once for machines with and without AVX2. With FMA each product-add rounds
// once instead of twice; the rows stay within the tests' float32 tolerance of the reference (the torch path and
// the stock kernel are not bit-identical to either anyway). Measured on the testbed's shapes (4 heads of 64,
// float32, one request; csrc/README.md): 12 fix rows over 167 keys 89 -> 49 us, 4 requests 340 -> 190 us.
template <typename scalar_t>
void convert_kv(const scalar_t* c_ptr, int64_t c_s0, int64_t c_s1, const int64_t* bt_row, int64_t block_size,
                int64_t head_size, const AffineLayout& kl, const AffineLayout& vl, int64_t h, int64_t num_keys,
                int64_t padded, std::vector<float>& k_t, std::vector<float>& v_rows) {
  k_t.assign(head_size * padded, 0.f);  // K's rows padded with zeros to whole chunks
  v_rows.resize(num_keys * head_size);
  for (int64_t p0 = 0; p0 < num_keys; p0 += block_size) {
    const int64_t n = std::min(block_size, num_keys - p0);
    const scalar_t* page = c_ptr + bt_row[p0 / block_size] * c_s0 + h * c_s1;
    for (int64_t d = 0; d < head_size; ++d) {
      const scalar_t* col = page + kl.base + d * kl.d_stride;
      float* dst = k_t.data() + d * padded + p0;
      for (int64_t t = 0; t < n; ++t) dst[t] = static_cast<float>(col[t]);
    }
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* row = page + vl.base + t * vl.t_stride;
      float* dst = v_rows.data() + (p0 + t) * head_size;
      for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<float>(row[d]);
    }
  }
}

// The geometry of one task's attention, after conversion.
struct TaskView {
  const float* q;    // [num_q, head_size]
  const float* k_t;  // [head_size, padded]
  const float* v;    // [num_keys, head_size]
  int64_t num_q, num_keys, padded, head_size, ctx, group;
  const int64_t* row_bits;  // per fix row (query rows come `group` per fix row)
  float scale, cap;
};

// Scale (and soft-cap) row lg of query row qi; its max over the visible keys. Visible: positions 0..ctx (context
// and root), then draft j (position ctx + 1 + j) iff bit j of the row.
inline float scale_row(const TaskView& t, int64_t qi, float* lg) {
  const int64_t bits = t.row_bits[qi / t.group];
  float max_logit = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < t.num_keys; ++p) {
    float s = lg[p] * t.scale;
    if (t.cap > 0.f) s = t.cap * std::tanh(s / t.cap);
    lg[p] = s;
    const bool visible = p <= t.ctx || ((bits >> (p - t.ctx - 1)) & 1);
    if (visible) max_logit = std::max(max_logit, s);
  }
  return max_logit;
}

// Softmax weights of row lg in place (0 for the hidden drafts), given its max over the visible keys.
inline void softmax_row(const TaskView& t, int64_t qi, float max_logit, float* lg) {
  const int64_t bits = t.row_bits[qi / t.group];
  float total = 0.f;
  for (int64_t p = 0; p <= t.ctx && p < t.num_keys; ++p) {
    const float w = exp_nonpositive(lg[p] - max_logit);
    lg[p] = w;
    total += w;
  }
  for (int64_t p = t.ctx + 1; p < t.num_keys; ++p) {
    const float w = ((bits >> (p - t.ctx - 1)) & 1) ? exp_nonpositive(lg[p] - max_logit) : 0.f;
    lg[p] = w;
    total += w;
  }
  const float inv = 1.f / total;
  for (int64_t p = 0; p < t.num_keys; ++p) lg[p] *= inv;  // the softmax weights, as the reference's softmax gives
}

// The baseline build: plain C++ over 16-float chunks (the compiler vectorises it at the baseline ISA).
template <typename scalar_t>
void fix_task_baseline(const scalar_t* c_ptr, int64_t c_s0, int64_t c_s1, const int64_t* bt_row,
                       int64_t block_size, int64_t head_size, const AffineLayout& kl, const AffineLayout& vl,
                       int64_t h, int64_t ctx, int64_t num_keys, const float* q_buf, int64_t num_q,
                       const int64_t* row_bits, int64_t group, float fscale, float cap, std::vector<float>& logits,
                       std::vector<float>& k_t, std::vector<float>& acc, std::vector<float>& v_rows) {
  // Logits of every query row in chunks of kChunk keys: a chunk's sums stay in registers over the d loop (a
  // plain lg[p] += q[d] k[d][p] sweep stores the whole row once per d and is store-bound). K's rows are padded
  // with zeros to whole chunks.
  constexpr int64_t kChunk = 16;
  const int64_t padded = (num_keys + kChunk - 1) / kChunk * kChunk;
  convert_kv<scalar_t>(c_ptr, c_s0, c_s1, bt_row, block_size, head_size, kl, vl, h, num_keys, padded, k_t, v_rows);
  logits.resize(num_q * padded);
  for (int64_t c0 = 0; c0 < padded; c0 += kChunk) {
    for (int64_t qi = 0; qi < num_q; ++qi) {
      const float* q = q_buf + qi * head_size;
      float sums[kChunk] = {0.f};
      for (int64_t d = 0; d < head_size; ++d) {
        const float qd = q[d];
        const float* kd = k_t.data() + d * padded + c0;
        for (int64_t j = 0; j < kChunk; ++j) sums[j] += qd * kd[j];
      }
      std::memcpy(logits.data() + qi * padded + c0, sums, sizeof(sums));
    }
  }
  acc.assign(num_q * head_size, 0.f);
  const TaskView view{q_buf, k_t.data(), v_rows.data(), num_q, num_keys, padded, head_size, ctx, group,
                      row_bits, fscale, cap};
  for (int64_t qi = 0; qi < num_q; ++qi) {
    float* lg = logits.data() + qi * padded;
    softmax_row(view, qi, scale_row(view, qi, lg), lg);
    // The output in chunks of kChunk dims, each chunk's sums in registers over the keys (as the logits above).
    float* a = acc.data() + qi * head_size;
    int64_t c0 = 0;
    for (; c0 + kChunk <= head_size; c0 += kChunk) {
      float sums[kChunk] = {0.f};
      for (int64_t p = 0; p < num_keys; ++p) {
        const float w = lg[p];
        const float* v = v_rows.data() + p * head_size + c0;
        for (int64_t j = 0; j < kChunk; ++j) sums[j] += w * v[j];
      }
      std::memcpy(a + c0, sums, sizeof(sums));
    }
    for (int64_t p = 0; p < num_keys; ++p) {  // head sizes that are not a multiple of kChunk: the rest
      const float* v = v_rows.data() + p * head_size;
      for (int64_t d = c0; d < head_size; ++d) a[d] += lg[p] * v[d];
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define ECHO_TREE_AVX2 1
constexpr int64_t kAvx2Chunk = 32;  // keys per logits block: 4 vectors x 2 query rows = 8 accumulators

// Softmax of one row in place: scale, hidden drafts to -inf, max, exp, their sum, normalise (hidden: weight 0).
__attribute__((target("avx2,fma"))) void softmax_row_avx2(const TaskView& t, int64_t qi, float* lg) {
  const int64_t n = t.num_keys, bits = t.row_bits[qi / t.group];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (t.cap > 0.f) {  // soft-capped layers: the scalar rule (rare)
    softmax_row(t, qi, scale_row(t, qi, lg), lg);
    return;
  }
  const __m256 scale = _mm256_set1_ps(t.scale);
  int64_t p = 0;
  for (; p + 8 <= n; p += 8) _mm256_storeu_ps(lg + p, _mm256_mul_ps(_mm256_loadu_ps(lg + p), scale));
  for (; p < n; ++p) lg[p] *= t.scale;
  for (p = t.ctx + 1; p < n; ++p) {
    if (!((bits >> (p - t.ctx - 1)) & 1)) lg[p] = neg_inf;
  }
  __m256 vmax = _mm256_set1_ps(neg_inf);
  for (p = 0; p + 8 <= n; p += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(lg + p));
  float max_logit = hmax8(vmax);
  for (; p < n; ++p) max_logit = std::max(max_logit, lg[p]);
  const __m256 m = _mm256_set1_ps(max_logit);
  for (p = 0; p + 8 <= n; p += 8) _mm256_storeu_ps(lg + p, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(lg + p), m)));
  for (; p < n; ++p) lg[p] = exp_nonpositive(lg[p] - max_logit);
  for (p = t.ctx + 1; p < n; ++p) {  // exp(-inf) is 2^-126 here, not 0: hidden drafts get exactly 0
    if (!((bits >> (p - t.ctx - 1)) & 1)) lg[p] = 0.f;
  }
  __m256 vsum = _mm256_setzero_ps();
  for (p = 0; p + 8 <= n; p += 8) vsum = _mm256_add_ps(vsum, _mm256_loadu_ps(lg + p));
  float total = hsum8(vsum);
  for (; p < n; ++p) total += lg[p];
  const __m256 inv = _mm256_set1_ps(1.f / total);
  for (p = 0; p + 8 <= n; p += 8) _mm256_storeu_ps(lg + p, _mm256_mul_ps(_mm256_loadu_ps(lg + p), inv));
  for (; p < n; ++p) lg[p] *= 1.f / total;
}

// out[rows r0, r1] (r1 may equal r0: one row) = weights x V over dims [c0, c0 + 32).
__attribute__((target("avx2,fma"))) inline void pv_block_avx2(const TaskView& t, const float* w0, const float* w1,
                                                              int64_t c0, float* o0, float* o1) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t p = 0; p < t.num_keys; ++p) {
    const float* v = t.v + p * t.head_size + c0;
    const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                 v3 = _mm256_loadu_ps(v + 24);
    const __m256 x = _mm256_set1_ps(w0[p]), y = _mm256_set1_ps(w1[p]);
    a0 = _mm256_fmadd_ps(x, v0, a0);
    a1 = _mm256_fmadd_ps(x, v1, a1);
    a2 = _mm256_fmadd_ps(x, v2, a2);
    a3 = _mm256_fmadd_ps(x, v3, a3);
    b0 = _mm256_fmadd_ps(y, v0, b0);
    b1 = _mm256_fmadd_ps(y, v1, b1);
    b2 = _mm256_fmadd_ps(y, v2, b2);
    b3 = _mm256_fmadd_ps(y, v3, b3);
  }
  _mm256_storeu_ps(o1 + c0, b0);  // o1 first: when r1 == r0 the a-sums (the same) win
  _mm256_storeu_ps(o1 + c0 + 8, b1);
  _mm256_storeu_ps(o1 + c0 + 16, b2);
  _mm256_storeu_ps(o1 + c0 + 24, b3);
  _mm256_storeu_ps(o0 + c0, a0);
  _mm256_storeu_ps(o0 + c0 + 8, a1);
  _mm256_storeu_ps(o0 + c0 + 16, a2);
  _mm256_storeu_ps(o0 + c0 + 24, a3);
}

__attribute__((target("avx2,fma"))) void attend_avx2(const TaskView& t, float* logits, float* out) {
  const int64_t D = t.head_size, P = t.padded;
  // Logits: blocks of 32 keys x 2 query rows (a lone last row pairs with itself; its store is the same).
  for (int64_t c0 = 0; c0 < P; c0 += kAvx2Chunk) {
    for (int64_t qi = 0; qi < t.num_q; qi += 2) {
      const int64_t qj = std::min(qi + 1, t.num_q - 1);
      const float *q0 = t.q + qi * D, *q1 = t.q + qj * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = t.k_t + d * P + c0;
        const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8), k2 = _mm256_loadu_ps(kd + 16),
                     k3 = _mm256_loadu_ps(kd + 24);
        const __m256 x = _mm256_set1_ps(q0[d]), y = _mm256_set1_ps(q1[d]);
        a0 = _mm256_fmadd_ps(x, k0, a0);
        a1 = _mm256_fmadd_ps(x, k1, a1);
        a2 = _mm256_fmadd_ps(x, k2, a2);
        a3 = _mm256_fmadd_ps(x, k3, a3);
        b0 = _mm256_fmadd_ps(y, k0, b0);
        b1 = _mm256_fmadd_ps(y, k1, b1);
        b2 = _mm256_fmadd_ps(y, k2, b2);
        b3 = _mm256_fmadd_ps(y, k3, b3);
      }
      float* l0 = logits + qi * P + c0;
      float* l1 = logits + qj * P + c0;
      _mm256_storeu_ps(l1, b0);
      _mm256_storeu_ps(l1 + 8, b1);
      _mm256_storeu_ps(l1 + 16, b2);
      _mm256_storeu_ps(l1 + 24, b3);
      _mm256_storeu_ps(l0, a0);
      _mm256_storeu_ps(l0 + 8, a1);
      _mm256_storeu_ps(l0 + 16, a2);
      _mm256_storeu_ps(l0 + 24, a3);
    }
  }
  for (int64_t qi = 0; qi < t.num_q; ++qi) softmax_row_avx2(t, qi, logits + qi * P);
  const int64_t full = D / 32 * 32;
  for (int64_t qi = 0; qi < t.num_q; qi += 2) {
    const int64_t qj = std::min(qi + 1, t.num_q - 1);
    const float *w0 = logits + qi * P, *w1 = logits + qj * P;
    float *o0 = out + qi * D, *o1 = out + qj * D;
    for (int64_t c0 = 0; c0 < full; c0 += 32) pv_block_avx2(t, w0, w1, c0, o0, o1);
    for (int64_t r = 0; r < (qj == qi ? 1 : 2); ++r) {  // head sizes that are not a multiple of 32: the rest
      const float* w = r ? w1 : w0;
      float* o = r ? o1 : o0;
      for (int64_t d = full; d < D; ++d) o[d] = 0.f;
      for (int64_t p = 0; p < t.num_keys; ++p) {
        const float* v = t.v + p * D;
        for (int64_t d = full; d < D; ++d) o[d] += w[p] * v[d];
      }
    }
  }
}

// ECHO_TREE_BASELINE_ISA=1 forces the baseline build on an AVX2 machine (tests run both; read per call).
bool use_avx2() { return avx2_enabled("ECHO_TREE_BASELINE_ISA"); }
#endif

template <typename scalar_t>
void fix_task_transposed_k(const scalar_t* c_ptr, int64_t c_s0, int64_t c_s1, const int64_t* bt_row,
                           int64_t block_size, int64_t head_size, const AffineLayout& kl, const AffineLayout& vl,
                           int64_t h, int64_t ctx, int64_t num_keys, const float* q_buf, int64_t num_q,
                           const int64_t* row_bits, int64_t group, float fscale, float cap, std::vector<float>& logits,
                           std::vector<float>& k_t, std::vector<float>& acc, std::vector<float>& v_rows, bool avx2) {
#ifdef ECHO_TREE_AVX2
  if (avx2) {
    const int64_t padded = (num_keys + kAvx2Chunk - 1) / kAvx2Chunk * kAvx2Chunk;
    convert_kv<scalar_t>(c_ptr, c_s0, c_s1, bt_row, block_size, head_size, kl, vl, h, num_keys, padded, k_t,
                         v_rows);
    logits.resize(num_q * padded);
    acc.resize(num_q * head_size);
    const TaskView view{q_buf, k_t.data(), v_rows.data(), num_q, num_keys, padded, head_size, ctx, group,
                        row_bits, fscale, cap};
    attend_avx2(view, logits.data(), acc.data());
    return;
  }
#endif
  fix_task_baseline<scalar_t>(c_ptr, c_s0, c_s1, bt_row, block_size, head_size, kl, vl, h, ctx, num_keys, q_buf,
                              num_q, row_bits, group, fscale, cap, logits, k_t, acc, v_rows);
}

template <typename scalar_t>
void fix_attention_impl(const at::Tensor& query, const at::Tensor& kv_cache, const int64_t* kmap,
                        const int64_t* vmap, const at::Tensor& block_table, const int64_t* context,
                        const int64_t* rows, const int64_t* bits, const std::vector<int64_t>& group_start,
                        const std::vector<int64_t>& group_req, double scale, double softcap, at::Tensor& output) {
  const int64_t heads = query.size(1), head_size = query.size(2);
  const int64_t kv_heads = kv_cache.size(1), block_size = kv_cache.size(2), num_blocks = kv_cache.size(0);
  const int64_t group = heads / kv_heads;
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = output.stride(0), o_s1 = output.stride(1);
  const int64_t c_s0 = kv_cache.stride(0), c_s1 = kv_cache.stride(1);
  const int64_t bt_s0 = block_table.stride(0), bt_cols = block_table.size(1);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* c_ptr = kv_cache.data_ptr<scalar_t>();
  const int64_t* bt = block_table.data_ptr<int64_t>();
  scalar_t* o_ptr = output.data_ptr<scalar_t>();
  const int64_t num_groups = static_cast<int64_t>(group_req.size());
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Bounds first (outside the parallel region, so the error is one clear exception).
  for (int64_t g = 0; g < num_groups; ++g) {
    int64_t all_bits = 0;
    for (int64_t r = group_start[g]; r < group_start[g + 1]; ++r) all_bits |= bits[r];
    const int64_t req = group_req[g];
    const int64_t drafts = all_bits ? 64 - __builtin_clzll(static_cast<unsigned long long>(all_bits)) : 0;
    const int64_t keys = context[req] + 1 + drafts;
    ECHO_CHECK_VALUE((keys + block_size - 1) / block_size <= bt_cols, "tree_fix_attention: request row ", req,
                     " needs ", keys, " keys but its block table holds ", bt_cols * block_size);
    for (int64_t b = 0; b < (keys + block_size - 1) / block_size; ++b) {
      const int64_t block = bt[req * bt_s0 + b];
      ECHO_CHECK_VALUE(block >= 0 && block < num_blocks, "tree_fix_attention: request row ", req, " block ", b,
                       " is ", block, ", outside the cache's ", num_blocks, " blocks");
    }
  }

  const AffineLayout kl = affine_layout(kmap, block_size, head_size);
  const AffineLayout vl = affine_layout(vmap, block_size, head_size);
  const bool transposed_k = kl.affine && kl.t_stride == 1 && vl.affine && vl.d_stride == 1;
#ifdef ECHO_TREE_AVX2
  const bool avx2 = use_avx2();
#else
  const bool avx2 = false;
#endif
  count_isa_call(IsaKernel::kTreeFixAttention, avx2);

  at::parallel_for(0, num_groups * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys_buf, values_buf, q_buf, logits, acc, kf, vf, row_acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / kv_heads, h = task % kv_heads;
      const int64_t req = group_req[g], first = group_start[g], num_rows = group_start[g + 1] - first;
      int64_t all_bits = 0;
      for (int64_t r = 0; r < num_rows; ++r) all_bits |= bits[first + r];
      const int64_t ctx = context[req];
      const int64_t drafts = all_bits ? 64 - __builtin_clzll(static_cast<unsigned long long>(all_bits)) : 0;
      const int64_t num_keys = ctx + 1 + drafts;  // positions 0..ctx, then draft j at ctx + 1 + j
      const int64_t num_q = num_rows * group;
      if (transposed_k) {
        q_buf.resize(num_q * head_size);
        for (int64_t r = 0; r < num_rows; ++r) {
          for (int64_t gi = 0; gi < group; ++gi) {
            const scalar_t* src = q_ptr + rows[first + r] * q_s0 + (h * group + gi) * q_s1;
            float* dst = q_buf.data() + (r * group + gi) * head_size;
            for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<float>(src[d]);
          }
        }
        fix_task_transposed_k<scalar_t>(c_ptr, c_s0, c_s1, bt + req * bt_s0, block_size, head_size, kl, vl, h, ctx,
                                        num_keys, q_buf.data(), num_q, bits + first, group, fscale, cap, logits,
                                        kf, row_acc, vf, avx2);
        for (int64_t r = 0; r < num_rows; ++r) {
          for (int64_t gi = 0; gi < group; ++gi) {
            const float* a = row_acc.data() + (r * group + gi) * head_size;
            scalar_t* out = o_ptr + rows[first + r] * o_s0 + (h * group + gi) * o_s1;
            for (int64_t d = 0; d < head_size; ++d) out[d] = static_cast<scalar_t>(a[d]);
          }
        }
        continue;
      }
      keys_buf.resize(num_keys * head_size);
      values_buf.resize(num_keys * head_size);
      for (int64_t p = 0; p < num_keys; ++p) {
        const int64_t block = bt[req * bt_s0 + p / block_size], off = p % block_size;
        const scalar_t* page = c_ptr + block * c_s0 + h * c_s1;
        const int64_t* km = kmap + off * head_size;
        const int64_t* vm = vmap + off * head_size;
        float* kd = keys_buf.data() + p * head_size;
        float* vd = values_buf.data() + p * head_size;
        for (int64_t d = 0; d < head_size; ++d) {
          kd[d] = static_cast<float>(page[km[d]]);
          vd[d] = static_cast<float>(page[vm[d]]);
        }
      }
      q_buf.resize(num_q * head_size);
      for (int64_t r = 0; r < num_rows; ++r) {
        for (int64_t gi = 0; gi < group; ++gi) {
          const scalar_t* src = q_ptr + rows[first + r] * q_s0 + (h * group + gi) * q_s1;
          float* dst = q_buf.data() + (r * group + gi) * head_size;
          for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<float>(src[d]);
        }
      }
      logits.resize(num_keys);
      acc.resize(head_size);
      for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t row_bits = bits[first + r];
        for (int64_t gi = 0; gi < group; ++gi) {
          const float* q = q_buf.data() + (r * group + gi) * head_size;
          float max_logit = neg_inf;
          for (int64_t p = 0; p < num_keys; ++p) {
            const bool visible = p <= ctx || ((row_bits >> (p - ctx - 1)) & 1);
            if (!visible) {
              logits[p] = neg_inf;
              continue;
            }
            const float* k = keys_buf.data() + p * head_size;
            float dot = 0.f;
            for (int64_t d = 0; d < head_size; ++d) dot += q[d] * k[d];
            float s = dot * fscale;
            if (cap > 0.f) s = cap * std::tanh(s / cap);
            logits[p] = s;
            max_logit = std::max(max_logit, s);
          }
          float total = 0.f;
          for (int64_t p = 0; p < num_keys; ++p) {
            const float w = logits[p] == neg_inf ? 0.f : std::exp(logits[p] - max_logit);
            logits[p] = w;
            total += w;
          }
          std::fill(acc.begin(), acc.end(), 0.f);
          const float inv = 1.f / total;
          for (int64_t p = 0; p < num_keys; ++p) {
            const float w = logits[p] * inv;  // softmax weight, as the reference's softmax gives it
            if (w == 0.f) continue;
            const float* v = values_buf.data() + p * head_size;
            for (int64_t d = 0; d < head_size; ++d) acc[d] += w * v[d];
          }
          scalar_t* out = o_ptr + rows[first + r] * o_s0 + (h * group + gi) * o_s1;
          for (int64_t d = 0; d < head_size; ++d) out[d] = static_cast<scalar_t>(acc[d]);
        }
      }
    }
  });
}

void tree_fix_attention_cpu(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& kmap,
                            const at::Tensor& vmap, const at::Tensor& block_table, const at::Tensor& context_len,
                            const at::Tensor& fix_rows, const at::Tensor& fix_req, const at::Tensor& fix_bits,
                            double scale, double softcap, const at::Tensor& output) {
  check_cache(kv_cache, kmap, vmap);
  ECHO_CHECK_VALUE(query.dim() == 3 && query.stride(2) == 1, "query must be [T, H, D] with contiguous rows; got ",
                   query.sizes(), " strides ", query.strides());
  ECHO_CHECK_VALUE(output.dim() == 3 && output.stride(2) == 1 && output.size(0) == query.size(0) &&
                       output.size(1) == query.size(1) && output.size(2) == query.size(2),
                   "output must be [T, H, D] like query ", query.sizes(), " with contiguous rows; got ",
                   output.sizes());
  ECHO_CHECK_VALUE(query.size(2) == kv_cache.size(3) / 2, "query head size ", query.size(2),
                   " != the cache's ", kv_cache.size(3) / 2);
  ECHO_CHECK_VALUE(query.size(1) % kv_cache.size(1) == 0, "query heads ", query.size(1),
                   " are not a multiple of the cache's KV heads ", kv_cache.size(1));
  ECHO_CHECK_TYPE(query.scalar_type() == kv_cache.scalar_type() && output.scalar_type() == query.scalar_type(),
                  "query, kv_cache and output must share one dtype; got ", query.scalar_type(), ", ",
                  kv_cache.scalar_type(), ", ", output.scalar_type());
  ECHO_CHECK_VALUE(query.device().is_cpu() && output.device().is_cpu(), "query and output must be CPU tensors");
  check_index(block_table, "block_table", 2);
  check_index(context_len, "context_len", 1);
  check_index(fix_rows, "fix_rows", 1);
  check_index(fix_req, "fix_req", 1);
  check_index(fix_bits, "fix_bits", 1);
  const int64_t num_fix = fix_rows.size(0);
  ECHO_CHECK_VALUE(fix_req.size(0) == num_fix && fix_bits.size(0) == num_fix, "fix_rows, fix_req and fix_bits ",
                   "must have one entry per fix row; got ", num_fix, ", ", fix_req.size(0), ", ", fix_bits.size(0));
  if (num_fix == 0) return;
  const at::Tensor bt = as_long(block_table), ctx = as_long(context_len), rows = as_long(fix_rows);
  const at::Tensor req = as_long(fix_req), bits = as_long(fix_bits);
  const at::Tensor km = kmap.contiguous(), vm = vmap.contiguous();
  const int64_t* req_ptr = req.data_ptr<int64_t>();
  const int64_t* rows_ptr = rows.data_ptr<int64_t>();
  const int64_t num_reqs = ctx.size(0), num_tokens = query.size(0);
  // Fix rows come grouped by request (build_tree_batch lists them request by request).
  std::vector<int64_t> group_start{0}, group_req;
  for (int64_t i = 0; i < num_fix; ++i) {
    ECHO_CHECK_VALUE(req_ptr[i] >= 0 && req_ptr[i] < num_reqs && req_ptr[i] < bt.size(0), "fix_req[", i, "] = ",
                     req_ptr[i], " is outside the ", std::min(num_reqs, bt.size(0)), " requests");
    ECHO_CHECK_VALUE(rows_ptr[i] >= 0 && rows_ptr[i] < num_tokens, "fix_rows[", i, "] = ", rows_ptr[i],
                     " is outside the ", num_tokens, " query rows");
    if (i > 0 && req_ptr[i] != req_ptr[i - 1]) {
      ECHO_CHECK_VALUE(req_ptr[i] > req_ptr[i - 1], "fix_req must be sorted (rows grouped by request)");
      group_start.push_back(i);
    }
    if (i == 0 || req_ptr[i] != req_ptr[i - 1]) group_req.push_back(req_ptr[i]);
  }
  group_start.push_back(num_fix);
  at::Tensor out = output;
  ECHO_CHECK_FLOATING_DISPATCH(query.scalar_type(), "tree_fix_attention");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "tree_fix_attention", [&] {
    fix_attention_impl<scalar_t>(query, kv_cache, km.data_ptr<int64_t>(), vm.data_ptr<int64_t>(), bt,
                                 ctx.data_ptr<int64_t>(), rows_ptr, bits.data_ptr<int64_t>(), group_start,
                                 group_req, scale, softcap, out);
  });
}

void tree_kv_compact_cpu(const at::Tensor& kv_cache, const at::Tensor& kmap, const at::Tensor& vmap,
                         const at::Tensor& src_slots, const at::Tensor& dst_slots) {
  check_cache(kv_cache, kmap, vmap);
  check_index(src_slots, "src_slots", 1);
  check_index(dst_slots, "dst_slots", 1);
  ECHO_CHECK_VALUE(src_slots.size(0) == dst_slots.size(0), "tree_kv_compact: ", src_slots.size(0),
                   " sources but ", dst_slots.size(0), " destinations");
  const int64_t n = src_slots.size(0);
  if (n == 0) return;
  const at::Tensor src = as_long(src_slots), dst = as_long(dst_slots);
  const at::Tensor km = kmap.contiguous(), vm = vmap.contiguous();
  const int64_t kv_heads = kv_cache.size(1), block_size = kv_cache.size(2), head_size = kv_cache.size(3) / 2;
  const int64_t num_slots = kv_cache.size(0) * block_size;
  const int64_t c_s0 = kv_cache.stride(0), c_s1 = kv_cache.stride(1);
  const int64_t *s = src.data_ptr<int64_t>(), *t = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    ECHO_CHECK_VALUE(s[i] >= 0 && s[i] < num_slots && t[i] >= 0 && t[i] < num_slots, "tree_kv_compact: move ", i,
                     " (slot ", s[i], " -> ", t[i], ") is outside the cache's ", num_slots, " slots");
  }
  const int64_t *kmp = km.data_ptr<int64_t>(), *vmp = vm.data_ptr<int64_t>();
  ECHO_CHECK_FLOATING_DISPATCH(kv_cache.scalar_type(), "tree_kv_compact");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv_cache.scalar_type(), "tree_kv_compact", [&] {
    scalar_t* c = kv_cache.data_ptr<scalar_t>();
    // Gather every source first: overlapping moves are then exact whatever their order.
    std::vector<scalar_t> staged(n * kv_heads * 2 * head_size);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const scalar_t* page = c + (s[i] / block_size) * c_s0 + h * c_s1;
        const int64_t off = s[i] % block_size;
        scalar_t* out = staged.data() + (i * kv_heads + h) * 2 * head_size;
        for (int64_t d = 0; d < head_size; ++d) {
          out[d] = page[kmp[off * head_size + d]];
          out[head_size + d] = page[vmp[off * head_size + d]];
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        scalar_t* page = c + (t[i] / block_size) * c_s0 + h * c_s1;
        const int64_t off = t[i] % block_size;
        const scalar_t* in = staged.data() + (i * kv_heads + h) * 2 * head_size;
        for (int64_t d = 0; d < head_size; ++d) {
          page[kmp[off * head_size + d]] = in[d];
          page[vmp[off * head_size + d]] = in[head_size + d];
        }
      }
    }
  });
}

}  // namespace
}  // namespace echo

TORCH_LIBRARY_IMPL(echo, CPU, m) {
  m.impl("tree_fix_attention", &echo::tree_fix_attention_cpu);
  m.impl("tree_kv_compact", &echo::tree_kv_compact_cpu);
}
