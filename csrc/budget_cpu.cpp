// CPU kernel of echo::select_budget: a bit-for-bit twin of echo_vllm.core.budget.select_budget_reference.
//
//   1. class of every node (parallel over requests), written into the `selected` buffer as scratch, and the
//      batch's class-0 / class-1 counts c0, c1;
//   2. the class boundary follows from c0, c1 and k_max (every class-0 node precedes every class-1 node);
//      inside the boundary class, std::nth_element on 96-bit keys (order key << 32 | flat index) picks the
//      first `need` nodes of the total order; they are tagged in the scratch;
//   3. per request (parallel): final mask, then compaction into order / parent_local / order_depth.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "budget_key.h"
#include "budget_op.h"
#include "check_msg.h"

namespace echo {
namespace {

constexpr uint8_t kChosen = 3;  // scratch tag: a boundary-class node within the first k_max
constexpr int64_t kGrainNodes = 32768;  // below this many nodes per task, threads cost more than they save

using Key = unsigned __int128;

int64_t row_grain(int64_t num_nodes) { return std::max<int64_t>(1, kGrainNodes / std::max<int64_t>(1, num_nodes)); }

void select_budget_cpu_impl(const at::Tensor& scores_t, const at::Tensor& depth_t, const at::Tensor& parent_t,
                            const at::Tensor& valid_t, const at::Tensor& spine_t, const at::Tensor& depth_cap_t,
                            const at::Tensor& truncated_t, int64_t k_max, const at::Tensor& selected_t,
                            const at::Tensor& counts_t, const at::Tensor& order_t, const at::Tensor& parent_local_t,
                            const at::Tensor& order_depth_t) {
  const int64_t batch = scores_t.size(0);
  const int64_t num_nodes = scores_t.size(1);
  if (batch == 0) {
    return;
  }
  const at::Tensor scores_c = scores_t.contiguous();
  const at::Tensor depth_c = depth_t.contiguous();
  const at::Tensor parent_c = parent_t.contiguous();
  const at::Tensor valid_c = valid_t.contiguous();
  const at::Tensor spine_c = spine_t.contiguous();
  const at::Tensor cap_c = depth_cap_t.contiguous();
  const at::Tensor truncated_c = truncated_t.contiguous();

  const float* scores = scores_c.const_data_ptr<float>();
  const int32_t* depth = depth_c.const_data_ptr<int32_t>();
  const int32_t* parent = parent_c.const_data_ptr<int32_t>();
  // Bool tensors are read as bytes: nonzero = true.
  const auto* valid = static_cast<const uint8_t*>(valid_c.const_data_ptr());
  const auto* spine = static_cast<const uint8_t*>(spine_c.const_data_ptr());
  const int32_t* depth_cap = cap_c.const_data_ptr<int32_t>();
  const auto* truncated = static_cast<const uint8_t*>(truncated_c.const_data_ptr());
  auto* selected = static_cast<uint8_t*>(selected_t.mutable_data_ptr());
  int32_t* counts = counts_t.mutable_data_ptr<int32_t>();
  int32_t* order = order_t.mutable_data_ptr<int32_t>();
  int32_t* parent_local = parent_local_t.mutable_data_ptr<int32_t>();
  int32_t* order_depth = order_depth_t.mutable_data_ptr<int32_t>();
  const int64_t grain = row_grain(num_nodes);

  // ---- 1. classes (scratch in `selected`) and class counts ----
  std::atomic<int64_t> total_c0{0};
  std::atomic<int64_t> total_c1{0};
  at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
    int64_t c0 = 0;
    int64_t c1 = 0;
    for (int64_t b = begin; b < end; ++b) {
      const int32_t cap = depth_cap[b];
      const bool trunc = truncated[b] != 0;
      const int64_t row = b * num_nodes;
      for (int64_t n = 0; n < num_nodes; ++n) {
        const int64_t i = row + n;
        const uint8_t c = budget::candidate_class(valid[i] != 0, spine[i] != 0, trunc, depth[i], cap, scores[i]);
        selected[i] = c;
        c0 += c == budget::kClassDepth;
        c1 += c == budget::kClassWidth;
      }
    }
    total_c0 += c0;
    total_c1 += c1;
  });
  const int64_t c0 = total_c0.load();
  const int64_t c1 = total_c1.load();

  // ---- 2. boundary class; the first `need` of its nodes in the total order get tagged kChosen ----
  bool take_all = k_max >= c0 + c1;
  uint8_t boundary = budget::kClassExcluded;  // nodes of class < boundary are all in
  if (!take_all) {
    boundary = k_max >= c0 ? budget::kClassWidth : budget::kClassDepth;
    const int64_t need = boundary == budget::kClassWidth ? k_max - c0 : k_max;  // < count of that class
    if (need > 0) {
      thread_local std::vector<Key> keys;
      keys.clear();
      keys.reserve(static_cast<size_t>(boundary == budget::kClassWidth ? c1 : c0));
      const int64_t total = batch * num_nodes;
      for (int64_t i = 0; i < total; ++i) {
        if (selected[i] == boundary) {
          keys.push_back((static_cast<Key>(budget::order_key(scores[i], depth[i])) << 32) |
                         static_cast<Key>(static_cast<uint32_t>(i)));
        }
      }
      std::nth_element(keys.begin(), keys.begin() + (need - 1), keys.end());
      for (int64_t j = 0; j < need; ++j) {
        selected[static_cast<uint32_t>(keys[j])] = kChosen;
      }
    }
  }

  // ---- 3. final mask and per-request compaction ----
  at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> local(static_cast<size_t>(num_nodes));
    for (int64_t b = begin; b < end; ++b) {
      const int64_t row = b * num_nodes;
      uint8_t* sel = selected + row;
      int32_t* order_row = order + row;
      int32_t count = 0;
      for (int64_t n = 0; n < num_nodes; ++n) {
        const uint8_t c = sel[n];
        const bool in = take_all ? c != budget::kClassExcluded : (c < boundary || c == kChosen);
        sel[n] = in ? 1 : 0;
        local[n] = in ? count : -1;
        if (in) {
          order_row[count++] = static_cast<int32_t>(n);
        }
      }
      counts[b] = count;
      const int32_t* parent_row = parent + row;
      const int32_t* depth_row = depth + row;
      for (int32_t j = 0; j < count; ++j) {
        const int32_t n = order_row[j];
        const int32_t p = parent_row[n];
        parent_local[row + j] = (p >= 0 && p < num_nodes) ? local[p] : -1;
        order_depth[row + j] = depth_row[n];
      }
      for (int64_t j = count; j < num_nodes; ++j) {
        order_row[j] = -1;
        parent_local[row + j] = -1;
        order_depth[row + j] = 0;
      }
    }
  });
}

BudgetOutputs select_budget_cpu(const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& parent,
                                const at::Tensor& valid, const at::Tensor& spine, const at::Tensor& depth_cap,
                                const at::Tensor& truncated, int64_t k_max) {
  check_budget_inputs(scores, depth, parent, valid, spine, depth_cap, truncated, k_max);
  ECHO_CHECK_VALUE(scores.device().is_cpu(), "scores must be a CPU tensor for the CPU kernel; got ",
                   scores.device());
  BudgetOutputs out = empty_budget_outputs(scores);
  select_budget_cpu_impl(scores, depth, parent, valid, spine, depth_cap, truncated, k_max, std::get<0>(out),
                         std::get<1>(out), std::get<2>(out), std::get<3>(out), std::get<4>(out));
  return out;
}

void select_budget_out_cpu(const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& parent,
                           const at::Tensor& valid, const at::Tensor& spine, const at::Tensor& depth_cap,
                           const at::Tensor& truncated, int64_t k_max, const at::Tensor& selected,
                           const at::Tensor& counts, const at::Tensor& order, const at::Tensor& parent_local,
                           const at::Tensor& order_depth) {
  check_budget_inputs(scores, depth, parent, valid, spine, depth_cap, truncated, k_max);
  ECHO_CHECK_VALUE(scores.device().is_cpu(), "scores must be a CPU tensor for the CPU kernel; got ",
                   scores.device());
  check_budget_outputs(scores, depth, parent, valid, spine, depth_cap, truncated, selected, counts, order,
                       parent_local, order_depth);
  select_budget_cpu_impl(scores, depth, parent, valid, spine, depth_cap, truncated, k_max, selected, counts, order,
                         parent_local, order_depth);
}

}  // namespace
}  // namespace echo

TORCH_LIBRARY_IMPL(echo, CPU, m) {
  m.impl("select_budget", &echo::select_budget_cpu);
  m.impl("select_budget_out", &echo::select_budget_out_cpu);
}
