// echo::chain_select (CPU): one chain step's gates, ECHO order and budget cut in one call.
//
// The vLLM proposer's chain steps (top_k = 1) ran this as ~60 small torch ops (gates, priority rank, node gains,
// the rate table of choose_budget, the compaction): ~1 ms of host time per step on a 2-core CPU, 10 % of a step
// at batch 1. Twin of the composition in echo_vllm/core/chain_select.py (`chain_select_reference`), which is the
// specification and the fallback; the tests compare the two bit for bit on random inputs.
//
// Inputs ([B, d] drafted chains, D = max depth >= d):
//   scores [B, d] f32     cumulative draft log-probs (path scores)
//   valid [B, d] bool     finite score and the row's drafts are kept
//   confidence [B, d] f32 exp(score) where valid, else 0 (torch computes it: its exp is the reference's)
//   gate_on [D] bool, tau [D] f32: the calibrated gates (all off: no gates); depths > d count as open
//   gain_table [D, bins] f32 or empty: the acceptance table (empty: the fixed rule, the first k_cap candidates)
//   rest [B * d + 1] f64, draft [d + 1] f64: the cost model's seconds (see core/auto_budget.choose_budget)
//   history [B', 2] f64 (B' >= B) or empty: each request's running averages of accepted and expected drafts; its
//            factor f = (accepted + prior) / (expected + prior), computed in double and rounded to float, scales
//            its gains (min(f x p, 1)) and orders its nodes by f x confidence instead of the path score (gates
//            read the raw confidence); see echo_vllm/core/chain_select.py
// Outputs: counts [B] i32 (each row's selection is a prefix of its chain), depth_cap [B] i32, truncated [B]
// bool, predicted [] f64 (expected accepted drafts of the selection; 0 under the fixed rule).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "avx2_math.h"
#include "check_msg.h"
#include "exp_poly.h"
#include "isa_calls.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace echo {
namespace {

constexpr int32_t kClassDepth = 0;
constexpr int32_t kClassTail = 2;
constexpr int32_t kClassNone = 3;

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  ECHO_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor; got ", t.device());
  ECHO_CHECK_VALUE(t.dim() == dim, name, " must have ", dim, " dims; got shape ", t.sizes());
  ECHO_CHECK_TYPE(t.scalar_type() == dtype, name, " must be ", dtype, "; got ", t.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chain_select_cpu(
    const at::Tensor& scores_in, const at::Tensor& valid_in, const at::Tensor& confidence_in,
    const at::Tensor& gate_on_in, const at::Tensor& tau_in, const at::Tensor& gain_table_in, const at::Tensor& rest_in,
    const at::Tensor& draft_in, double base_tokens, int64_t k_cap, int64_t k_min, bool surplus_tail,
    const at::Tensor& history_in, double history_prior) {
  check(scores_in, "scores", at::kFloat, 2);
  check(valid_in, "valid", at::kBool, 2);
  check(confidence_in, "confidence", at::kFloat, 2);
  check(gate_on_in, "gate_on", at::kBool, 1);
  check(tau_in, "tau", at::kFloat, 1);
  check(rest_in, "rest", at::kDouble, 1);
  check(draft_in, "draft", at::kDouble, 1);
  const int64_t batch = scores_in.size(0), depth = scores_in.size(1), max_depth = gate_on_in.size(0);
  ECHO_CHECK_VALUE(valid_in.sizes() == scores_in.sizes() && confidence_in.sizes() == scores_in.sizes(),
                   "valid and confidence must have the shape of scores ", scores_in.sizes());
  ECHO_CHECK_VALUE(tau_in.size(0) == max_depth && depth <= max_depth, "gate_on and tau must be [D] with D >= d = ",
                   depth, "; got ", gate_on_in.sizes(), " and ", tau_in.sizes());
  const bool fixed = gain_table_in.numel() == 0;
  int64_t bins = 0;
  if (!fixed) {
    check(gain_table_in, "gain_table", at::kFloat, 2);
    ECHO_CHECK_VALUE(gain_table_in.size(0) == max_depth && gain_table_in.size(1) >= 1,
                     "gain_table must be [D, bins] with D = ", max_depth, "; got ", gain_table_in.sizes());
    bins = gain_table_in.size(1);
    ECHO_CHECK_VALUE(rest_in.size(0) == batch * depth + 1, "rest must be [B * d + 1] = [", batch * depth + 1,
                     "]; got ", rest_in.sizes());
    ECHO_CHECK_VALUE(draft_in.size(0) == depth + 1, "draft must be [d + 1] = [", depth + 1, "]; got ",
                     draft_in.sizes());
  }
  ECHO_CHECK_VALUE(k_cap >= 0 && k_min >= 0, "k_cap and k_min must be >= 0; got ", k_cap, " and ", k_min);
  const bool with_history = history_in.numel() > 0;
  if (with_history) {
    check(history_in, "history", at::kDouble, 2);
    ECHO_CHECK_VALUE(history_in.size(0) >= batch && history_in.size(1) == 2, "history must be [B', 2] with B' >= B = ",
                     batch, "; got ", history_in.sizes());
    ECHO_CHECK_VALUE(history_prior > 0.0, "history_prior must be > 0; got ", history_prior);
  }

  at::Tensor counts_t = at::zeros({batch}, scores_in.options().dtype(at::kInt));
  at::Tensor cap_t = at::full({batch}, max_depth, scores_in.options().dtype(at::kInt));
  at::Tensor trunc_t = at::zeros({batch}, scores_in.options().dtype(at::kBool));
  at::Tensor predicted_t = at::zeros({}, scores_in.options().dtype(at::kDouble));
  if (batch == 0 || depth == 0) return {counts_t, cap_t, trunc_t, predicted_t};

  const at::Tensor scores_t = scores_in.contiguous(), valid_t = valid_in.contiguous();
  const at::Tensor conf_t = confidence_in.contiguous(), gate_t = gate_on_in.contiguous(), tau_t = tau_in.contiguous();
  const float* scores = scores_t.data_ptr<float>();
  const bool* valid = valid_t.data_ptr<bool>();
  const float* conf = conf_t.data_ptr<float>();
  const bool* gate_on = gate_t.data_ptr<bool>();
  const float* tau = tau_t.data_ptr<float>();

  int32_t* counts = counts_t.data_ptr<int32_t>();
  int32_t* depth_cap = cap_t.data_ptr<int32_t>();
  bool* truncated = trunc_t.data_ptr<bool>();

  // Gates (core.gating.gate_caps): the shallowest closed gate truncates after its depth; undrafted depths are
  // open (confidence +inf), NaN closes (NaN >= tau is false).
  for (int64_t b = 0; b < batch; ++b) {
    int32_t cap = static_cast<int32_t>(max_depth);
    bool closed_any = false;
    for (int64_t j = 0; j < max_depth; ++j) {
      const float c = j < depth ? conf[b * depth + j] : std::numeric_limits<float>::infinity();
      if (gate_on[j] && !(c >= tau[j])) {
        cap = static_cast<int32_t>(j + 1);
        closed_any = true;
        break;
      }
    }
    depth_cap[b] = cap;
    truncated[b] = closed_any;
  }

  // The requests' history factors and the order's key per node: the path score, or with a history f x confidence
  // (float products, as the reference's tensor product).
  const int64_t num_nodes = batch * depth;
  std::vector<float> factor;
  std::vector<float> key_store;
  const float* key = scores;
  if (with_history) {
    const at::Tensor history_t = history_in.contiguous();
    const double* history = history_t.data_ptr<double>();
    factor.resize(batch);
    key_store.resize(num_nodes);
    for (int64_t b = 0; b < batch; ++b) {
      factor[b] = static_cast<float>((history[b * 2] + history_prior) / (history[b * 2 + 1] + history_prior));
      for (int64_t j = 0; j < depth; ++j) key_store[b * depth + j] = conf[b * depth + j] * factor[b];
    }
    key = key_store.data();
  }

  // ECHO's order (core.auto_budget.priority_rank): depth candidates, then (surplus_tail) the tails of truncated
  // requests; within a class path score (or the history key) descending, depth ascending, flat index ascending.
  // Ineligible nodes rank after every eligible one and are never selected, so only the eligible ones are sorted.
  std::vector<int32_t> prio(num_nodes, kClassNone);
  std::vector<int64_t> order;
  order.reserve(num_nodes);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < depth; ++j) {
      const int64_t n = b * depth + j;
      const float s = key[n];
      if (!valid[n] || scores[n] != scores[n] || s != s) continue;
      if (j + 1 <= depth_cap[b]) {
        prio[n] = kClassDepth;
      } else if (surplus_tail && truncated[b]) {
        prio[n] = kClassTail;
      } else {
        continue;
      }
      order.push_back(n);
    }
  }
  // +0.0 folds -0.0 (C++ compares them equal already); NaN never reaches here.
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    if (prio[x] != prio[y]) return prio[x] < prio[y];
    if (key[x] != key[y]) return key[x] > key[y];
    const int64_t dx = x % depth, dy = y % depth;
    if (dx != dy) return dx < dy;
    return x < y;
  });
  const int64_t eligible = static_cast<int64_t>(order.size());

  if (fixed) {  // the first k_cap candidates (select_by_rank)
    const int64_t take = std::min<int64_t>(k_cap, eligible);
    for (int64_t i = 0; i < take; ++i) counts[order[i] / depth] += 1;
    return {counts_t, cap_t, trunc_t, predicted_t};
  }

  // Node gains (AcceptanceModel.node_gain, chain=True): the table at (depth, bin of the confidence), 0 for unusable
  // nodes, then a running minimum along each chain. float32 as the reference.
  const at::Tensor table_t = gain_table_in.contiguous();
  const float* table = table_t.data_ptr<float>();
  std::vector<float> gain(num_nodes, 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    float running = std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < depth; ++j) {
      const int64_t n = b * depth + j;
      float p = 0.0f;
      if (valid[n] && scores[n] == scores[n]) {
        float c = conf[n];
        c = c != c ? 0.0f : std::min(std::max(c, 0.0f), 1.0f);
        const int64_t bin = std::min<int64_t>(static_cast<int64_t>(c * static_cast<float>(bins)), bins - 1);
        const int64_t row = std::min<int64_t>(std::max<int64_t>(j, 0), max_depth - 1);
        p = table[row * bins + bin];
        if (with_history) p = std::min(p * factor[b], 1.0f);
      }
      running = std::min(running, p);
      gain[n] = running;
    }
  }

  // The rate table (core.auto_budget.choose_budget): for every cut depth l = 0..d and every prefix of the order,
  // (base + sum of gains) / (rest(count) + draft(l)); plain decoding first, the first maximum wins.
  const at::Tensor rest_t = rest_in.contiguous(), draft_t = draft_in.contiguous();
  const double* rest = rest_t.data_ptr<double>();
  const double* draft = draft_t.data_ptr<double>();
  const double neg_inf = -std::numeric_limits<double>::infinity();
  // A probe's floor is what it can verify: with fewer eligible candidates than k_min (rows dropped as partial
  // prefills, a short chain) it verifies them all rather than nothing.
  k_min = std::min<int64_t>(k_min, eligible);
  double best = k_min > 0 ? neg_inf : base_tokens / std::max(rest[0] + draft[0], 1e-12);
  int64_t best_level = -1, best_pos = -1;
  double best_gain = 0.0;
  for (int64_t level = 0; level <= depth; ++level) {
    double cum_gain = 0.0;
    int64_t count = 0;
    const double denom_draft = draft[level];
    for (int64_t pos = 0; pos < eligible; ++pos) {
      const int64_t n = order[pos];
      if (n % depth + 1 > level) continue;  // deeper than the cut: masked out (rate -inf)
      cum_gain += static_cast<double>(gain[n]);
      ++count;
      if (count > k_cap || count < k_min) continue;
      const double rate = (base_tokens + cum_gain) / std::max(rest[count] + denom_draft, 1e-12);
      if (rate > best) {
        best = rate;
        best_level = level;
        best_pos = pos;
        best_gain = cum_gain;
      }
    }
  }
  if (best_level >= 0) {
    for (int64_t pos = 0; pos <= best_pos; ++pos) {
      const int64_t n = order[pos];
      if (n % depth + 1 <= best_level) counts[n / depth] += 1;
    }
    predicted_t.fill_(best_gain);
  }
  return {counts_t, cap_t, trunc_t, predicted_t};
}

// ---- echo::chain_select_logps (CPU): chain_inputs and chain_select in one call, from the per-depth log-probs ----
//
// The proposer holds a chain step's draft log-probs as one [B'] float32 tensor per drafted depth. In torch, the
// selection's inputs took a stack, a cumsum, isfinite, an and, a where and an exp: ~0.1 ms of a batch-4 step inside
// the engine (py-spy), where each small op costs 10-20 us. Here one call builds them and runs chain_select_cpu:
//   scores = cumsum over depths, accumulated in double and rounded to float per prefix (torch's CPU cumsum kernel
//            for float32 accumulates in at::acc_type<float, false> = double: the same bits, tested);
//   valid  = isfinite(scores) & kept (kept absent: every row);
//   confidence = at::exp(where(valid, scores, -inf)) - torch's own exp kernel on the same values.
// Returns (counts, depth_cap, truncated, predicted, scores, valid, confidence).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chain_select_logps_cpu(
    at::TensorList step_logps, int64_t batch, const std::optional<at::Tensor>& kept_in, const at::Tensor& gate_on,
    const at::Tensor& tau, const at::Tensor& gain_table, const at::Tensor& rest, const at::Tensor& draft,
    double base_tokens, int64_t k_cap, int64_t k_min, bool surplus_tail, const at::Tensor& history,
    double history_prior) {
  const int64_t depth = static_cast<int64_t>(step_logps.size());
  ECHO_CHECK_VALUE(depth >= 1, "step_logps must hold one [B] tensor per drafted depth; got none");
  std::vector<at::Tensor> columns;
  columns.reserve(depth);
  for (const at::Tensor& column : step_logps) {
    check(column, "step_logps[j]", at::kFloat, 1);
    ECHO_CHECK_VALUE(column.size(0) >= batch && batch >= 0, "step_logps[j] must hold >= batch = ", batch,
                     " rows; got ", column.sizes());
    columns.push_back(column.contiguous());
  }
  const bool* kept = nullptr;
  at::Tensor kept_t;
  if (kept_in.has_value()) {
    kept_t = kept_in->to(at::kBool).contiguous();
    ECHO_CHECK_VALUE(kept_t.device().is_cpu() && kept_t.dim() == 1 && kept_t.size(0) == batch, "kept must be [",
                     batch, "] on the CPU; got shape ", kept_t.sizes());
    kept = kept_t.data_ptr<bool>();
  }
  const auto float_options = columns[0].options();
  at::Tensor scores_t = at::empty({batch, depth}, float_options);
  at::Tensor valid_t = at::empty({batch, depth}, float_options.dtype(at::kBool));
  at::Tensor masked_t = at::empty({batch, depth}, float_options);
  float* scores = scores_t.data_ptr<float>();
  bool* valid = valid_t.data_ptr<bool>();
  float* masked = masked_t.data_ptr<float>();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < batch; ++r) {
    double sum = 0.0;
    const bool row_kept = kept == nullptr || kept[r];
    for (int64_t j = 0; j < depth; ++j) {
      sum += static_cast<double>(columns[j].data_ptr<float>()[r]);
      const float score = static_cast<float>(sum);
      const bool ok = std::isfinite(score) && row_kept;
      scores[r * depth + j] = score;
      valid[r * depth + j] = ok;
      masked[r * depth + j] = ok ? score : minus_inf;
    }
  }
  at::Tensor confidence_t = at::exp(masked_t);
  auto [counts, depth_cap, truncated, predicted] = chain_select_cpu(
      scores_t, valid_t, confidence_t, gate_on, tau, gain_table, rest, draft, base_tokens, k_cap, k_min, surplus_tail,
      history, history_prior);
  return {counts, depth_cap, truncated, predicted, scores_t, valid_t, confidence_t};
}

}  // namespace
}  // namespace echo

TORCH_LIBRARY_IMPL(echo, CPU, m) {
  m.impl("chain_select", &echo::chain_select_cpu);
  m.impl("chain_select_logps", &echo::chain_select_logps_cpu);
}

// ---- echo::draft_argmax_logp (CPU): a chain draft step's token and its draft log-prob in one pass ----------
//
// The proposer needs, per row of the head's logits [B, V], the argmax token (the first maximum, as torch.max) and
// log p(argmax) = max - logsumexp. In torch that is max + logsumexp (a composite of ~6 kernels) + a subtraction:
// ~70 us more per draft depth than vLLM's own argmax on the testbed. Here: one read for the maximum, one for the
// sum of exp(x - max) (a polynomial exp over 8 float lanes, chunk sums added in double), per row, both loops
// vectorised at the baseline ISA. On the testbed (V = 4096): 12 / 66 / 262 us at batch 1 / 8 / 32, where the
// first version (libm exp in double, scalar) took 24 / 183 / 710 and torch's max + logsumexp 24 / 77 / 242.
// Not bit-identical to torch's logsumexp (a different exp and summation order; the drafts are verified exactly
// whatever their scores), but deterministic, within 2e-6 of the float64 value, and <= 0 always.
// NaN anywhere in a row: that NaN's index and a NaN log-prob (torch.max propagates NaN); a row of -inf: NaN.
namespace echo {
namespace {

constexpr int64_t kChunk = 512;  // exp(x - max) of this many logits at a time, in a buffer on the stack

// Pass 2 of both draft ops: the sum of exp(x - best) over a row, chunk by chunk: the exp loop vectorises, and 8
// float partial sums per chunk (element-wise lanes: no reassociation needed) are added into a double.
template <typename scalar_t>
double sum_exp_below(const scalar_t* row, int64_t vocab, float best, float* buffer) {
  double sum = 0.0;
  for (int64_t start = 0; start < vocab; start += kChunk) {
    const int64_t n = std::min(kChunk, vocab - start);
    for (int64_t v = 0; v < n; ++v) buffer[v] = exp_nonpositive(static_cast<float>(row[start + v]) - best);
    float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t v = 0;
    for (; v + 8 <= n; v += 8) {
      for (int k = 0; k < 8; ++k) lanes[k] += buffer[v + k];
    }
    for (; v < n; ++v) sum += buffer[v];
    for (int k = 0; k < 8; ++k) sum += lanes[k];
  }
  return sum;
}

#ifdef ECHO_HAVE_AVX2
// The AVX2 + FMA build of pass 2 for float32 rows: the same chunks, lanes and order of additions as
// `sum_exp_below`, the exp with FMA (exp_nonpositive8): within a few float ulps of the baseline's. No NaN may be
// in the row (exp_nonpositive8 loses it): the callers test for NaN first.
__attribute__((target("avx2,fma"))) double sum_exp_below_avx2(const float* row, int64_t vocab, float best) {
  const __m256 top = _mm256_set1_ps(best);
  double sum = 0.0;
  for (int64_t start = 0; start < vocab; start += kChunk) {
    const int64_t n = std::min(kChunk, vocab - start);
    __m256 acc = _mm256_setzero_ps();
    int64_t v = 0;
    for (; v + 8 <= n; v += 8) {
      acc = _mm256_add_ps(acc, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row + start + v), top)));
    }
    for (; v < n; ++v) sum += exp_nonpositive(row[start + v] - best);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    for (int k = 0; k < 8; ++k) sum += lanes[k];
  }
  return sum;
}

// One float32 row of draft_argmax_logp with AVX2: false (nothing written) for the rows the baseline's special
// cases handle (a NaN, an infinite maximum, fewer than 8 logits). Same token (the first maximum); the log-prob
// within float rounding of the baseline's (see `sum_exp_below_avx2`). ~4x faster per row on the testbed (V 4096).
__attribute__((target("avx2,fma"))) bool argmax_logp_row_avx2(const float* row, int64_t vocab, int64_t* id,
                                                               float* logp) {
  if (vocab < 8) return false;
  __m256 maxes = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t m = 0;
  for (; m + 8 <= vocab; m += 8) {
    const __m256 x = _mm256_loadu_ps(row + m);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    maxes = _mm256_max_ps(x, maxes);  // equal values (+0 / -0 too): keeps the running maximum, as the baseline
  }
  float best = hmax8(maxes);
  for (; m < vocab; ++m) {
    const float x = row[m];
    if (x != x) return false;
    best = x > best ? x : best;
  }
  if (_mm256_movemask_ps(nan) != 0 || std::isinf(best)) return false;
  const double sum = sum_exp_below_avx2(row, vocab, best);
  const __m256 top = _mm256_set1_ps(best);
  int64_t first = 0;  // the first maximum, as torch.max: 8 comparisons at a time
  for (; first + 8 <= vocab; first += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + first), top, _CMP_EQ_OQ));
    if (hit != 0) {
      first += __builtin_ctz(static_cast<unsigned>(hit));
      break;
    }
  }
  while (row[first] != best) ++first;  // the tail (a no-op when the vector loop found it)
  *id = first;
  *logp = std::min(0.0f, static_cast<float>(-std::log(sum)));
  return true;
}
#endif

// Whether this chunk of draft rows runs the AVX2 build (float32 rows on an AVX2 + FMA CPU, unless
// ECHO_DRAFT_BASELINE_ISA=1), counted for `echo::cpu_isa_calls`.
template <typename scalar_t>
bool draft_rows_use_avx2() {
#ifdef ECHO_HAVE_AVX2
  const bool avx2 = std::is_same_v<scalar_t, float> && avx2_enabled("ECHO_DRAFT_BASELINE_ISA");
#else
  const bool avx2 = false;
#endif
  count_isa_call(IsaKernel::kDraftLogp, avx2);
  return avx2;
}

template <typename scalar_t>
void argmax_logp_rows(const scalar_t* logits, int64_t rows_begin, int64_t rows_end, int64_t vocab, int64_t* ids,
                      float* logps) {
  float buffer[kChunk];
  const bool avx2 = draft_rows_use_avx2<scalar_t>();
  for (int64_t r = rows_begin; r < rows_end; ++r) {
    const scalar_t* row = logits + r * vocab;
#ifdef ECHO_HAVE_AVX2
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (avx2 && argmax_logp_row_avx2(row, vocab, ids + r, logps + r)) continue;
    }
#endif
    // Pass 1: the maximum (a select per element: vectorises; a NaN never wins a comparison, found below).
    float maxes[8];
    for (int k = 0; k < 8; ++k) maxes[k] = -std::numeric_limits<float>::infinity();
    int64_t m = 0;
    for (; m + 8 <= vocab; m += 8) {
      for (int k = 0; k < 8; ++k) {
        const float x = static_cast<float>(row[m + k]);
        maxes[k] = x > maxes[k] ? x : maxes[k];
      }
    }
    float best = -std::numeric_limits<float>::infinity();
    for (; m < vocab; ++m) best = static_cast<float>(row[m]) > best ? static_cast<float>(row[m]) : best;
    for (int k = 0; k < 8; ++k) best = maxes[k] > best ? maxes[k] : best;
    const double sum = sum_exp_below(row, vocab, best, buffer);
    if (std::isnan(sum) || vocab == 0 || std::isinf(best)) {
      // A NaN logit (its index, as torch.max returns), a row of -inf or an inf logit: no usable log-prob.
      int64_t id = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        const float x = static_cast<float>(row[v]);
        if (x != x) {
          id = v;
          break;
        }
        if (x == best && id == 0 && static_cast<float>(row[0]) != best) id = v;
      }
      ids[r] = id;
      logps[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    int64_t best_id = 0;  // the first maximum, as torch.max
    while (static_cast<float>(row[best_id]) != best) ++best_id;
    ids[r] = best_id;
    logps[r] = std::min(0.0f, static_cast<float>(-std::log(sum)));  // max - (max + log sum): sum >= 1, so <= 0
  }
}

std::tuple<at::Tensor, at::Tensor> draft_argmax_logp_cpu(const at::Tensor& logits_in) {
  ECHO_CHECK_VALUE(logits_in.device().is_cpu(), "logits must be a CPU tensor; got ", logits_in.device());
  ECHO_CHECK_VALUE(logits_in.dim() == 2, "logits must be [B, V]; got shape ", logits_in.sizes());
  const at::Tensor logits = logits_in.contiguous();
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  at::Tensor ids = at::empty({batch}, logits.options().dtype(at::kLong));
  at::Tensor logps = at::empty({batch}, logits.options().dtype(at::kFloat));
  ECHO_CHECK_FLOATING_DISPATCH(logits.scalar_type(), "draft_argmax_logp");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "draft_argmax_logp", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    int64_t* id_out = ids.data_ptr<int64_t>();
    float* logp_out = logps.data_ptr<float>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      argmax_logp_rows<scalar_t>(data, begin, end, vocab, id_out, logp_out);
    });
  });
  return {ids, logps};
}

// ---- echo::draft_topk_logp (CPU): a tree draft step's top-k tokens and their draft log-probs in one pass ----
//
// The tree step's twin of draft_argmax_logp: per row, the k largest logits (value descending, equal values lower
// index first: the tie rule of core.tree.topk_stable, so slot 0 is the chain's argmax) and each one's
// log p = x - logsumexp, clamped to <= 0. In torch (float copy, logsumexp, topk_stable's seven kernels, a clamp) it
// cost ~0.25 ms more per draft depth than the chain op at batch 1 on the testbed. Pass 1 keeps the k best in a
// small sorted list (an element enters only if it beats the k-th: rare after the first few hundred), pass 2 is
// draft_argmax_logp's sum of exp. NaN entries are skipped by the top-k and make the row's log-probs NaN (as
// torch's logsumexp); so do rows of -inf and rows holding +inf.
template <typename scalar_t>
void topk_logp_rows(const scalar_t* logits, int64_t rows_begin, int64_t rows_end, int64_t vocab, int64_t k,
                    int64_t* ids, float* logps) {
  float buffer[kChunk];
  std::vector<float> vals(k);
  std::vector<int64_t> idx(k);
  const bool avx2 = draft_rows_use_avx2<scalar_t>();
  for (int64_t r = rows_begin; r < rows_end; ++r) {
    const scalar_t* row = logits + r * vocab;
    int64_t count = 0;
    bool has_nan = false;
    for (int64_t v = 0; v < vocab; ++v) {
      const float x = static_cast<float>(row[v]);
      if (x != x) {
        has_nan = true;
        continue;
      }
      if (count == k && !(x > vals[k - 1])) continue;  // ties with the k-th keep the lower index
      int64_t pos = count < k ? count++ : k - 1;
      while (pos > 0 && vals[pos - 1] < x) {  // equal values stay ahead: ascending index among equals
        vals[pos] = vals[pos - 1];
        idx[pos] = idx[pos - 1];
        --pos;
      }
      vals[pos] = x;
      idx[pos] = v;
    }
    for (int64_t j = count; j < k; ++j) {  // fewer than k non-NaN entries: the first NaN indices fill the list
      vals[j] = std::numeric_limits<float>::quiet_NaN();
      idx[j] = 0;
    }
    const float best = count ? vals[0] : std::numeric_limits<float>::quiet_NaN();
    double sum = 0.0;
    if (count) {
#ifdef ECHO_HAVE_AVX2
      if constexpr (std::is_same_v<scalar_t, float>) {
        // The vector exp loses NaN and inf - inf: those rows take the baseline's sum (and its NaN).
        sum = avx2 && !has_nan && !std::isinf(best) ? sum_exp_below_avx2(row, vocab, best)
                                                    : sum_exp_below(row, vocab, best, buffer);
      } else {
        sum = sum_exp_below(row, vocab, best, buffer);
      }
#else
      sum = sum_exp_below(row, vocab, best, buffer);
#endif
    }
    const bool unusable = has_nan || count < k || std::isinf(best) || std::isnan(sum);
    const double lse = static_cast<double>(best) + std::log(sum);
    for (int64_t j = 0; j < k; ++j) {
      ids[r * k + j] = idx[j];
      logps[r * k + j] = unusable ? std::numeric_limits<float>::quiet_NaN()
                                  : std::min(0.0f, static_cast<float>(static_cast<double>(vals[j]) - lse));
    }
  }
}

std::tuple<at::Tensor, at::Tensor> draft_topk_logp_cpu(const at::Tensor& logits_in, int64_t k) {
  ECHO_CHECK_VALUE(logits_in.device().is_cpu(), "logits must be a CPU tensor; got ", logits_in.device());
  ECHO_CHECK_VALUE(logits_in.dim() == 2, "logits must be [B, V]; got shape ", logits_in.sizes());
  ECHO_CHECK_VALUE(k >= 1 && k <= logits_in.size(1), "top_k = ", k, " must be in [1, vocabulary size ",
                   logits_in.size(1), "]");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  at::Tensor ids = at::empty({batch, k}, logits.options().dtype(at::kLong));
  at::Tensor logps = at::empty({batch, k}, logits.options().dtype(at::kFloat));
  ECHO_CHECK_FLOATING_DISPATCH(logits.scalar_type(), "draft_topk_logp");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "draft_topk_logp", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    int64_t* id_out = ids.data_ptr<int64_t>();
    float* logp_out = logps.data_ptr<float>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      topk_logp_rows<scalar_t>(data, begin, end, vocab, k, id_out, logp_out);
    });
  });
  return {ids, logps};
}

}  // namespace
}  // namespace echo

TORCH_LIBRARY_IMPL(echo, CPU, m) {
  m.impl("draft_argmax_logp", &echo::draft_argmax_logp_cpu);
  m.impl("draft_topk_logp", &echo::draft_topk_logp_cpu);
}
