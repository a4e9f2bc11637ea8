// echo::chain_feedback (CPU): a verified chain step's feedback to ECHO in one call.
//
// After vLLM verifies a chain step, the proposer derives each request's accepted drafts, adds the step to its
// statistics, the acceptance table's counts and the depth plan's level histograms. In torch that is ~45 small
// ops (~0.3 ms of host time per step inside the engine on the testbed's 2-core CPU, ~2 % of a batch-4 step).
// Twin of echo_vllm/core/chain_feedback.py (`chain_feedback_reference`), the specification and the fallback;
// every output is a count (or a float64 sum of counts), so the tests compare the two exactly.
//
// Inputs (R verified requests, D = max depth):
//   sampled [B', W] i32/i64  the step's sampled tokens per row of its batch, -1 = none
//   cur [R] i64              the verified requests' rows in `sampled`
//   old [R] i64              their rows in `confidence` (the drafting step's batch)
//   verified [R] i64         drafts verified per request (a prefix of its chain)
//   confidence [B, D] f32    the drafting step's depth confidences (0 past its drafted depth)
//   seen, hits [D, bins] f64 the acceptance table's counts, added to in place when record_acceptance
//   drafted                  the drafting step's depth (<= D), for the level histograms
//   history [B'', 2] f64     or empty: per row of the drafting step's batch (B'' >= B), running averages of accepted
//                            drafts and of the drafts the table expected of the verified nodes; each verified row's
//                            pair moves by weight alpha towards (accepted, expected), in place
//   gain_table [D, bins'] f32 the acceptance table (empty when history is): expected = the sum over the verified
//                            prefix of the table at (depth, bin of the confidence), running minimum along the chain
// Outputs: accepted [R] i64 (emitted - 1, >= 0); sums [5] f64 (rows, emitted, accepted, verified, verified depth);
// levels [(n + 1)^2 + (n + 1)] i64 with n = drafted + 1: the (reach, accepted) histogram then the node-depth
// histogram of `level_counts` (echo_vllm/core/time_budget.py).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "check_msg.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace echo {
namespace {

void check_index(const at::Tensor& t, const char* name, int64_t rows) {
  ECHO_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor; got ", t.device());
  ECHO_CHECK_VALUE(t.dim() == 1 && t.size(0) == rows, name, " must be [R] = [", rows, "]; got ", t.sizes());
  ECHO_CHECK_TYPE(t.scalar_type() == at::kLong, name, " must be int64; got ", t.scalar_type());
}

template <typename index_t>
int64_t emitted_of(const index_t* row, int64_t width) {
  int64_t n = 0;
  for (int64_t w = 0; w < width; ++w) n += row[w] != static_cast<index_t>(-1);
  return n;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> chain_feedback_cpu(const at::Tensor& sampled_in, const at::Tensor& cur_in,
                                                                  const at::Tensor& old_in, const at::Tensor& verified_in,
                                                                  const at::Tensor& confidence_in, at::Tensor seen,
                                                                  at::Tensor hits, int64_t drafted,
                                                                  bool record_acceptance, at::Tensor history,
                                                                  const at::Tensor& gain_table_in, double alpha) {
  ECHO_CHECK_VALUE(sampled_in.device().is_cpu(), "sampled must be a CPU tensor; got ", sampled_in.device());
  ECHO_CHECK_VALUE(sampled_in.dim() == 2, "sampled must be [B, W]; got shape ", sampled_in.sizes());
  ECHO_CHECK_TYPE(sampled_in.scalar_type() == at::kInt || sampled_in.scalar_type() == at::kLong,
                  "sampled must be int32 or int64; got ", sampled_in.scalar_type());
  const int64_t rows = cur_in.numel();
  check_index(cur_in, "cur", rows);
  check_index(old_in, "old", rows);
  check_index(verified_in, "verified", rows);
  ECHO_CHECK_VALUE(confidence_in.device().is_cpu() && confidence_in.dim() == 2,
                   "confidence must be a [B, D] CPU tensor; got ", confidence_in.sizes());
  ECHO_CHECK_TYPE(confidence_in.scalar_type() == at::kFloat, "confidence must be float32; got ",
                  confidence_in.scalar_type());
  const int64_t depth = confidence_in.size(1);
  ECHO_CHECK_VALUE(seen.dim() == 2 && seen.size(0) == depth && hits.sizes() == seen.sizes(),
                   "seen and hits must be [D, bins] with D = ", depth, "; got ", seen.sizes(), " and ", hits.sizes());
  ECHO_CHECK_TYPE(seen.scalar_type() == at::kDouble && hits.scalar_type() == at::kDouble,
                  "seen and hits must be float64; got ", seen.scalar_type(), " and ", hits.scalar_type());
  ECHO_CHECK_VALUE(seen.is_contiguous() && hits.is_contiguous() && seen.device().is_cpu() && hits.device().is_cpu(),
                   "seen and hits must be contiguous CPU tensors");
  ECHO_CHECK_VALUE(drafted >= 0 && drafted <= depth, "drafted must be in [0, ", depth, "]; got ", drafted);
  const bool with_history = history.numel() > 0;
  if (with_history) {
    ECHO_CHECK_VALUE(history.device().is_cpu() && history.dim() == 2 && history.size(0) >= confidence_in.size(0) &&
                         history.size(1) == 2 && history.is_contiguous(),
                     "history must be a contiguous [B', 2] CPU tensor with B' >= ", confidence_in.size(0),
                     " rows; got ", history.sizes());
    ECHO_CHECK_TYPE(history.scalar_type() == at::kDouble, "history must be float64; got ", history.scalar_type());
    ECHO_CHECK_VALUE(gain_table_in.device().is_cpu() && gain_table_in.dim() == 2 &&
                         gain_table_in.size(0) == confidence_in.size(1) && gain_table_in.size(1) >= 1,
                     "gain_table must be [D, bins] with D = ", confidence_in.size(1), "; got ", gain_table_in.sizes());
    ECHO_CHECK_TYPE(gain_table_in.scalar_type() == at::kFloat, "gain_table must be float32; got ",
                    gain_table_in.scalar_type());
    ECHO_CHECK_VALUE(alpha >= 0.0 && alpha <= 1.0, "alpha must be in [0, 1]; got ", alpha);
  }
  const at::Tensor sampled = sampled_in.contiguous(), confidence = confidence_in.contiguous();
  const at::Tensor cur = cur_in.contiguous(), old = old_in.contiguous(), verified = verified_in.contiguous();
  const int64_t batch = sampled.size(0), width = sampled.size(1), old_batch = confidence.size(0);
  const int64_t bins = seen.size(1);
  const int64_t* cur_p = cur.data_ptr<int64_t>();
  const int64_t* old_p = old.data_ptr<int64_t>();
  const int64_t* ver_p = verified.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    ECHO_CHECK_VALUE(cur_p[r] >= 0 && cur_p[r] < batch, "cur[", r, "] = ", cur_p[r], " is outside sampled's ", batch,
                     " rows");
    ECHO_CHECK_VALUE(old_p[r] >= 0 && old_p[r] < old_batch, "old[", r, "] = ", old_p[r],
                     " is outside confidence's ", old_batch, " rows");
  }

  at::Tensor accepted = at::empty({rows}, verified.options());
  at::Tensor sums = at::zeros({5}, verified.options().dtype(at::kDouble));
  const int64_t n = drafted + 1, size = n + 1;
  at::Tensor levels = at::zeros({size * size + size}, verified.options());
  int64_t* acc_p = accepted.data_ptr<int64_t>();
  double* sum_p = sums.data_ptr<double>();
  int64_t* joint = levels.data_ptr<int64_t>();
  int64_t* nodes = joint + size * size;
  const float* conf = confidence.data_ptr<float>();
  double* seen_p = seen.data_ptr<double>();
  double* hits_p = hits.data_ptr<double>();
  const at::Tensor gain_table = with_history ? gain_table_in.contiguous() : gain_table_in;
  const float* table = with_history ? gain_table.data_ptr<float>() : nullptr;
  const int64_t table_bins = with_history ? gain_table.size(1) : 0;
  double* history_p = with_history ? history.data_ptr<double>() : nullptr;

  AT_DISPATCH_INDEX_TYPES(sampled.scalar_type(), "chain_feedback", [&] {
    const index_t* tokens = sampled.data_ptr<index_t>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t emitted = emitted_of(tokens + cur_p[r] * width, width);
      const int64_t acc = std::max<int64_t>(emitted - 1, 0);
      const int64_t ver = ver_p[r];
      acc_p[r] = acc;
      sum_p[1] += static_cast<double>(emitted);
      sum_p[2] += static_cast<double>(acc);
      sum_p[3] += static_cast<double>(ver);
      sum_p[4] += static_cast<double>(ver);  // a chain's verified depth is its verified count
      // Level histograms: reach = the deepest verified node (0..D), nodes of depth 1..reach, the rest depth 0.
      const int64_t reach = std::min<int64_t>(std::max<int64_t>(ver, 0), depth);
      joint[std::min(reach, n) * size + std::min(acc, n)] += 1;
      nodes[0] += depth - reach;
      for (int64_t j = 1; j <= reach; ++j) nodes[std::min(j, n)] += 1;
      const float* row = conf + old_p[r] * depth;
      if (with_history) {
        // The table's expectation of the verified prefix: float gains with a running minimum, summed in double in
        // depth order (the reference adds the same values in the same order).
        double expected = 0.0;
        float running = std::numeric_limits<float>::infinity();
        for (int64_t d = 0; d < std::min<int64_t>(ver, depth); ++d) {
          float c = row[d];
          c = std::isnan(c) ? 0.0f : std::min(std::max(c, 0.0f), 1.0f);
          const int64_t bin = std::min<int64_t>(
              std::max<int64_t>(static_cast<int64_t>(c * static_cast<float>(table_bins)), 0), table_bins - 1);
          running = std::min(running, table[d * table_bins + bin]);
          expected += static_cast<double>(running);
        }
        double* pair = history_p + old_p[r] * 2;
        pair[0] = (1.0 - alpha) * pair[0] + alpha * static_cast<double>(acc);
        pair[1] = (1.0 - alpha) * pair[1] + alpha * expected;
      }
      if (!record_acceptance) continue;
      for (int64_t d = 0; d < depth; ++d) {
        // confidence_bins: NaN -> 0, clamp to [0, 1], float32 product truncated, the top bin closed.
        float c = row[d];
        c = std::isnan(c) ? 0.0f : std::min(std::max(c, 0.0f), 1.0f);
        const int64_t bin = std::min<int64_t>(std::max<int64_t>(static_cast<int64_t>(c * static_cast<float>(bins)), 0),
                                              bins - 1);
        const bool recorded = d < ver;
        seen_p[d * bins + bin] += recorded ? 1.0 : 0.0;
        hits_p[d * bins + bin] += (recorded && d < acc) ? 1.0 : 0.0;
      }
    }
  });
  sum_p[0] = static_cast<double>(rows);
  return {accepted, sums, levels};
}

}  // namespace
}  // namespace echo

TORCH_LIBRARY_IMPL(echo, CPU, m) { m.impl("chain_feedback", &echo::chain_feedback_cpu); }
