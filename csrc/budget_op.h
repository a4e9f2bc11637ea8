// Shared torch-side pieces of echo::select_budget: input/output validation and output allocation.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace echo {

using BudgetOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Raises TypeError (dtype) / ValueError (shape, device, k_max, size) naming the offending argument.
void check_budget_inputs(const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& parent,
                         const at::Tensor& valid, const at::Tensor& spine, const at::Tensor& depth_cap,
                         const at::Tensor& truncated, int64_t k_max);

// The out= buffers: exact shape and dtype, contiguous, on the inputs' device, no overlap with anything.
void check_budget_outputs(const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& parent,
                          const at::Tensor& valid, const at::Tensor& spine, const at::Tensor& depth_cap,
                          const at::Tensor& truncated, const at::Tensor& selected, const at::Tensor& counts,
                          const at::Tensor& order, const at::Tensor& parent_local, const at::Tensor& order_depth);

// (selected bool [B, N], counts int32 [B], order / parent_local / order_depth int32 [B, N]), uninitialised.
BudgetOutputs empty_budget_outputs(const at::Tensor& scores);

}  // namespace echo
