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
#include "exp_poly.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace echo {
namespace {

void check_index(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor; got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must have ", dim, " dims; got shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name,
                   " must be int64 or int32; got ", t.scalar_type());
}

at::Tensor as_long(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }

void check_cache(const at::Tensor& kv_cache, const at::Tensor& kmap, const at::Tensor& vmap) {
  TORCH_CHECK_VALUE(kv_cache.device().is_cpu(), "kv_cache must be a CPU tensor; got ", kv_cache.device());
  TORCH_CHECK_VALUE(kv_cache.dim() == 4, "kv_cache must be [num_blocks, kv_heads, block_size, 2 * head_size]; got ",
                    kv_cache.sizes());
  TORCH_CHECK_VALUE(kv_cache.stride(3) == 1 && kv_cache.stride(2) == kv_cache.size(3),
                    "kv_cache: each (block, head) page must be contiguous; got strides ", kv_cache.strides());
  const int64_t block_size = kv_cache.size(2), head_size = kv_cache.size(3) / 2;
  for (const auto* m : {&kmap, &vmap}) {
    TORCH_CHECK_VALUE(m->dim() == 2 && m->size(0) == block_size && m->size(1) == head_size,
                      "kmap / vmap must be [block_size, head_size] = [", block_size, ", ", head_size, "]; got ",
                      m->sizes());
    TORCH_CHECK_TYPE(m->scalar_type() == at::kLong, "kmap / vmap must be int64; got ", m->scalar_type());
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
// request's K is converted once into a float [D, keys] buffer and V into [keys, D]; the logits then accumulate d
// by d (ascending, as the generic path's dot products) over chunks of keys, the outputs key by key over chunks of
// dims, each chunk's sums held in registers (vectorised at the baseline ISA). Measured on the testbed's shapes
// (4 heads of 64, bf16): 3 fix rows over 200 keys 0.21 -> 0.06 ms per layer, 12 rows at batch 4 0.84 -> 0.20 ms.
template <typename scalar_t>
void fix_task_transposed_k(const scalar_t* c_ptr, int64_t c_s0, int64_t c_s1, const int64_t* bt_row,
                           int64_t block_size, int64_t head_size, const AffineLayout& kl, const AffineLayout& vl,
                           int64_t h, int64_t ctx, int64_t num_keys, const float* q_buf, int64_t num_q,
                           const int64_t* row_bits, int64_t group, float fscale, float cap, std::vector<float>& logits,
                           std::vector<float>& k_t, std::vector<float>& acc, std::vector<float>& v_rows) {
  // Logits of every query row in chunks of kChunk keys: a chunk's sums stay in registers over the d loop (a
  // plain lg[p] += q[d] k[d][p] sweep stores the whole row once per d and is store-bound). K's rows are padded
  // with zeros to whole chunks.
  constexpr int64_t kChunk = 16;
  const int64_t padded = (num_keys + kChunk - 1) / kChunk * kChunk;
  k_t.assign(head_size * padded, 0.f);
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
  for (int64_t qi = 0; qi < num_q; ++qi) {
    float* lg = logits.data() + qi * padded;
    // Visible: positions 0..ctx (context and root), then draft j (position ctx + 1 + j) iff bit j of the row.
    const int64_t bits = row_bits[qi / group];
    float max_logit = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_keys; ++p) {
      float s = lg[p] * fscale;
      if (cap > 0.f) s = cap * std::tanh(s / cap);
      lg[p] = s;
      const bool visible = p <= ctx || ((bits >> (p - ctx - 1)) & 1);
      if (visible) max_logit = std::max(max_logit, s);
    }
    float total = 0.f;
    for (int64_t p = 0; p <= ctx && p < num_keys; ++p) {
      const float w = exp_nonpositive(lg[p] - max_logit);
      lg[p] = w;
      total += w;
    }
    for (int64_t p = ctx + 1; p < num_keys; ++p) {
      const float w = ((bits >> (p - ctx - 1)) & 1) ? exp_nonpositive(lg[p] - max_logit) : 0.f;
      lg[p] = w;
      total += w;
    }
    const float inv = 1.f / total;
    for (int64_t p = 0; p < num_keys; ++p) lg[p] *= inv;  // the softmax weights, as the reference's softmax gives
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
    TORCH_CHECK_VALUE((keys + block_size - 1) / block_size <= bt_cols, "tree_fix_attention: request row ", req,
                      " needs ", keys, " keys but its block table holds ", bt_cols * block_size);
    for (int64_t b = 0; b < (keys + block_size - 1) / block_size; ++b) {
      const int64_t block = bt[req * bt_s0 + b];
      TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "tree_fix_attention: request row ", req, " block ", b,
                        " is ", block, ", outside the cache's ", num_blocks, " blocks");
    }
  }

  const AffineLayout kl = affine_layout(kmap, block_size, head_size);
  const AffineLayout vl = affine_layout(vmap, block_size, head_size);
  const bool transposed_k = kl.affine && kl.t_stride == 1 && vl.affine && vl.d_stride == 1;

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
                                        kf, row_acc, vf);
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
  TORCH_CHECK_VALUE(query.dim() == 3 && query.stride(2) == 1, "query must be [T, H, D] with contiguous rows; got ",
                    query.sizes(), " strides ", query.strides());
  TORCH_CHECK_VALUE(output.dim() == 3 && output.stride(2) == 1 && output.size(0) == query.size(0) &&
                        output.size(1) == query.size(1) && output.size(2) == query.size(2),
                    "output must be [T, H, D] like query ", query.sizes(), " with contiguous rows; got ",
                    output.sizes());
  TORCH_CHECK_VALUE(query.size(2) == kv_cache.size(3) / 2, "query head size ", query.size(2),
                    " != the cache's ", kv_cache.size(3) / 2);
  TORCH_CHECK_VALUE(query.size(1) % kv_cache.size(1) == 0, "query heads ", query.size(1),
                    " are not a multiple of the cache's KV heads ", kv_cache.size(1));
  TORCH_CHECK_TYPE(query.scalar_type() == kv_cache.scalar_type() && output.scalar_type() == query.scalar_type(),
                   "query, kv_cache and output must share one dtype; got ", query.scalar_type(), ", ",
                   kv_cache.scalar_type(), ", ", output.scalar_type());
  TORCH_CHECK_VALUE(query.device().is_cpu() && output.device().is_cpu(), "query and output must be CPU tensors");
  check_index(block_table, "block_table", 2);
  check_index(context_len, "context_len", 1);
  check_index(fix_rows, "fix_rows", 1);
  check_index(fix_req, "fix_req", 1);
  check_index(fix_bits, "fix_bits", 1);
  const int64_t num_fix = fix_rows.size(0);
  TORCH_CHECK_VALUE(fix_req.size(0) == num_fix && fix_bits.size(0) == num_fix, "fix_rows, fix_req and fix_bits ",
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
    TORCH_CHECK_VALUE(req_ptr[i] >= 0 && req_ptr[i] < num_reqs && req_ptr[i] < bt.size(0), "fix_req[", i, "] = ",
                      req_ptr[i], " is outside the ", std::min(num_reqs, bt.size(0)), " requests");
    TORCH_CHECK_VALUE(rows_ptr[i] >= 0 && rows_ptr[i] < num_tokens, "fix_rows[", i, "] = ", rows_ptr[i],
                      " is outside the ", num_tokens, " query rows");
    if (i > 0 && req_ptr[i] != req_ptr[i - 1]) {
      TORCH_CHECK_VALUE(req_ptr[i] > req_ptr[i - 1], "fix_req must be sorted (rows grouped by request)");
      group_start.push_back(i);
    }
    if (i == 0 || req_ptr[i] != req_ptr[i - 1]) group_req.push_back(req_ptr[i]);
  }
  group_start.push_back(num_fix);
  at::Tensor out = output;
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
  TORCH_CHECK_VALUE(src_slots.size(0) == dst_slots.size(0), "tree_kv_compact: ", src_slots.size(0),
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
    TORCH_CHECK_VALUE(s[i] >= 0 && s[i] < num_slots && t[i] >= 0 && t[i] < num_slots, "tree_kv_compact: move ", i,
                      " (slot ", s[i], " -> ", t[i], ") is outside the cache's ", num_slots, " slots");
  }
  const int64_t *kmp = km.data_ptr<int64_t>(), *vmp = vm.data_ptr<int64_t>();
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
