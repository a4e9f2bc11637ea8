// Torch binding of the CUDA kernel (budget_cuda.cu); compiled only into CUDA builds (ECHO_WITH_CUDA).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <ATen/ops/empty.h>

#include "budget_cuda.h"
#include "budget_op.h"
#include "check_msg.h"

namespace echo {
namespace {

void select_budget_cuda_impl(const at::Tensor& scores_t, const at::Tensor& depth_t, const at::Tensor& parent_t,
                             const at::Tensor& valid_t, const at::Tensor& spine_t, const at::Tensor& depth_cap_t,
                             const at::Tensor& truncated_t, int64_t k_max, const at::Tensor& selected,
                             const at::Tensor& counts, const at::Tensor& order, const at::Tensor& parent_local,
                             const at::Tensor& order_depth) {
  ECHO_CHECK_VALUE(scores_t.is_cuda(), "scores must be a CUDA tensor for the CUDA kernel; got ", scores_t.device());
  const c10::cuda::CUDAGuard guard(scores_t.device());
  const int64_t batch = scores_t.size(0);
  if (batch == 0) {
    return;
  }
  // No-ops (no copy, no sync) for the usual contiguous inputs.
  const at::Tensor scores = scores_t.contiguous();
  const at::Tensor depth = depth_t.contiguous();
  const at::Tensor parent = parent_t.contiguous();
  const at::Tensor valid = valid_t.contiguous();
  const at::Tensor spine = spine_t.contiguous();
  const at::Tensor depth_cap = depth_cap_t.contiguous();
  const at::Tensor truncated = truncated_t.contiguous();

  const int device = scores.get_device();
  const size_t workspace_bytes = budget_cuda_workspace_bytes(scores.numel(), device);
  at::Tensor workspace;  // from the caching allocator: fine inside CUDA graph capture
  if (workspace_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, scores.options().dtype(at::kByte));
  }

  BudgetCudaArgs args{};
  args.scores = scores.const_data_ptr<float>();
  args.depth = depth.const_data_ptr<int32_t>();
  args.parent = parent.const_data_ptr<int32_t>();
  args.valid = static_cast<const uint8_t*>(valid.const_data_ptr());
  args.spine = static_cast<const uint8_t*>(spine.const_data_ptr());
  args.depth_cap = depth_cap.const_data_ptr<int32_t>();
  args.truncated = static_cast<const uint8_t*>(truncated.const_data_ptr());
  args.k_max = k_max;
  args.batch = static_cast<int32_t>(batch);
  args.num_nodes = static_cast<int32_t>(scores.size(1));
  args.selected = static_cast<uint8_t*>(selected.mutable_data_ptr());
  args.counts = counts.mutable_data_ptr<int32_t>();
  args.order = order.mutable_data_ptr<int32_t>();
  args.parent_local = parent_local.mutable_data_ptr<int32_t>();
  args.order_depth = order_depth.mutable_data_ptr<int32_t>();
  args.workspace = workspace_bytes > 0 ? workspace.mutable_data_ptr() : nullptr;

  const cudaError_t err = budget_cuda_launch(args, c10::cuda::getCurrentCUDAStream(device).stream());
  ECHO_CHECK(err == cudaSuccess, "echo::select_budget CUDA launch failed: ", cudaGetErrorString(err));
}

BudgetOutputs select_budget_cuda(const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& parent,
                                 const at::Tensor& valid, const at::Tensor& spine, const at::Tensor& depth_cap,
                                 const at::Tensor& truncated, int64_t k_max) {
  check_budget_inputs(scores, depth, parent, valid, spine, depth_cap, truncated, k_max);
  BudgetOutputs out = empty_budget_outputs(scores);
  select_budget_cuda_impl(scores, depth, parent, valid, spine, depth_cap, truncated, k_max, std::get<0>(out),
                          std::get<1>(out), std::get<2>(out), std::get<3>(out), std::get<4>(out));
  return out;
}

void select_budget_out_cuda(const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& parent,
                            const at::Tensor& valid, const at::Tensor& spine, const at::Tensor& depth_cap,
                            const at::Tensor& truncated, int64_t k_max, const at::Tensor& selected,
                            const at::Tensor& counts, const at::Tensor& order, const at::Tensor& parent_local,
                            const at::Tensor& order_depth) {
  check_budget_inputs(scores, depth, parent, valid, spine, depth_cap, truncated, k_max);
  check_budget_outputs(scores, depth, parent, valid, spine, depth_cap, truncated, selected, counts, order,
                       parent_local, order_depth);
  select_budget_cuda_impl(scores, depth, parent, valid, spine, depth_cap, truncated, k_max, selected, counts, order,
                          parent_local, order_depth);
}

}  // namespace
}  // namespace echo

TORCH_LIBRARY_IMPL(echo, CUDA, m) {
  m.impl("select_budget", &echo::select_budget_cuda);
  m.impl("select_budget_out", &echo::select_budget_out_cuda);
}
