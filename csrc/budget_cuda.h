// Plain-pointer interface of the CUDA budget-selection kernel (no torch; see budget_cuda_binding.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace echo {

struct BudgetCudaArgs {
  // Inputs, contiguous, all on the current device. Bool tensors are read as bytes (0 = false).
  const float* scores;       // [B, N]
  const int32_t* depth;      // [B, N]
  const int32_t* parent;     // [B, N]
  const uint8_t* valid;      // [B, N]
  const uint8_t* spine;      // [B, N]
  const int32_t* depth_cap;  // [B]
  const uint8_t* truncated;  // [B]
  int64_t k_max;             // >= 0
  int32_t batch;             // B
  int32_t num_nodes;         // N; B * N < 2^31
  // Outputs, contiguous, fully overwritten.
  uint8_t* selected;      // [B, N] bool
  int32_t* counts;        // [B]
  int32_t* order;         // [B, N]
  int32_t* parent_local;  // [B, N]
  int32_t* order_depth;   // [B, N]
  // Scratch of budget_cuda_workspace_bytes() bytes (nullptr when that is 0).
  void* workspace;
};

// Bytes of global scratch the launch needs on `device`: 0 when the per-node keys fit in shared memory
// (B * N * 9 bytes, up to ~25k nodes on an H100/H200), else B * N * 9.
size_t budget_cuda_workspace_bytes(int64_t num_candidates, int device);

// One kernel launch on `stream`: no host synchronisation, no allocation, safe inside CUDA graph capture.
cudaError_t budget_cuda_launch(const BudgetCudaArgs& args, cudaStream_t stream);

}  // namespace echo
