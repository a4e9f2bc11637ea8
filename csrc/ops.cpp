// echo_vllm._C: the `echo` torch.library namespace (schemas) and the Python module stub.
//
// The kernels register themselves: budget_cpu.cpp (CPU), budget_cuda_binding.cpp (CUDA, only in CUDA builds).
// The fake (meta) implementation is Python, in echo_vllm/ops/_fake.py (set_python_module below points there).
#include <Python.h>

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

#include <ATen/ops/empty.h>

#include "budget_op.h"
#include "check_msg.h"
#include "isa_calls.h"

namespace echo {
namespace {

void check_tensor(const at::Tensor& scores, const at::Tensor& tensor, const char* name, at::ScalarType dtype,
                  bool per_request) {
  const int64_t batch = scores.size(0);
  if (per_request) {
    ECHO_CHECK_VALUE(tensor.dim() == 1 && tensor.size(0) == batch, name, " must be [B] = [", batch, "]; got ",
                     tensor.sizes());
  } else {
    ECHO_CHECK_VALUE(tensor.sizes() == scores.sizes(), name, " must have the shape of scores ", scores.sizes(),
                     "; got ", tensor.sizes());
  }
  ECHO_CHECK_TYPE(tensor.scalar_type() == dtype, name, " must be ", dtype, "; got ", tensor.scalar_type());
  ECHO_CHECK_VALUE(tensor.device() == scores.device(), name, " must be on the device of scores (",
                   scores.device(), "); got ", tensor.device());
}

}  // namespace

void check_budget_inputs(const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& parent,
                         const at::Tensor& valid, const at::Tensor& spine, const at::Tensor& depth_cap,
                         const at::Tensor& truncated, int64_t k_max) {
  ECHO_CHECK_VALUE(scores.dim() == 2, "scores must be [B, N]; got shape ", scores.sizes());
  ECHO_CHECK_TYPE(scores.scalar_type() == at::kFloat, "scores must be float32; got ", scores.scalar_type());
  check_tensor(scores, depth, "depth", at::kInt, false);
  check_tensor(scores, parent, "parent", at::kInt, false);
  check_tensor(scores, valid, "valid", at::kBool, false);
  check_tensor(scores, spine, "spine", at::kBool, false);
  check_tensor(scores, depth_cap, "depth_cap", at::kInt, true);
  check_tensor(scores, truncated, "truncated", at::kBool, true);
  ECHO_CHECK_VALUE(k_max >= 0, "k_max must be an integer >= 0; got ", k_max);
  ECHO_CHECK_VALUE(scores.numel() <= INT32_MAX, "scores must have fewer than 2^31 nodes; got B * N = ",
                   scores.numel());
}

void check_budget_outputs(const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& parent,
                          const at::Tensor& valid, const at::Tensor& spine, const at::Tensor& depth_cap,
                          const at::Tensor& truncated, const at::Tensor& selected, const at::Tensor& counts,
                          const at::Tensor& order, const at::Tensor& parent_local, const at::Tensor& order_depth) {
  struct Out {
    const at::Tensor& tensor;
    const char* name;
    at::ScalarType dtype;
    bool per_request;
  };
  const Out outs[] = {
      {selected, "selected", at::kBool, false},
      {counts, "counts", at::kInt, true},
      {order, "order", at::kInt, false},
      {parent_local, "parent_local", at::kInt, false},
      {order_depth, "order_depth", at::kInt, false},
  };
  const at::Tensor* inputs[] = {&scores, &depth, &parent, &valid, &spine, &depth_cap, &truncated};
  for (const Out& out : outs) {
    check_tensor(scores, out.tensor, out.name, out.dtype, out.per_request);
    ECHO_CHECK_VALUE(out.tensor.is_contiguous(), out.name, " (out) must be contiguous");
    ECHO_CHECK_VALUE(at::has_internal_overlap(out.tensor) != at::MemOverlap::Yes, out.name,
                     " (out) must not have internal overlap");
    for (const at::Tensor* input : inputs) {
      at::assert_no_overlap(out.tensor, *input);
    }
    for (const Out& other : outs) {
      if (&other.tensor != &out.tensor) {
        at::assert_no_overlap(out.tensor, other.tensor);
      }
    }
  }
}

BudgetOutputs empty_budget_outputs(const at::Tensor& scores) {
  const auto options = scores.options();
  const auto int_options = options.dtype(at::kInt);
  return {at::empty(scores.sizes(), options.dtype(at::kBool)), at::empty({scores.size(0)}, int_options),
          at::empty(scores.sizes(), int_options), at::empty(scores.sizes(), int_options),
          at::empty(scores.sizes(), int_options)};
}

// Calls per CPU kernel and build so far (isa_calls.h): [draft log-prob AVX2, baseline, tree fix-up AVX2, baseline].
std::vector<int64_t> cpu_isa_calls() {
  std::vector<int64_t> out(kIsaKernels * 2);
  for (int i = 0; i < kIsaKernels * 2; ++i) out[i] = isa_call_counts()[i].load(std::memory_order_relaxed);
  return out;
}

}  // namespace echo

TORCH_LIBRARY(echo, m) {
  m.set_python_module("echo_vllm.ops._fake");
  m.def(
      "select_budget(Tensor scores, Tensor depth, Tensor parent, Tensor valid, Tensor spine, Tensor depth_cap, "
      "Tensor truncated, int k_max) -> (Tensor selected, Tensor counts, Tensor order, Tensor parent_local, "
      "Tensor order_depth)");
  m.def(
      "select_budget_out(Tensor scores, Tensor depth, Tensor parent, Tensor valid, Tensor spine, "
      "Tensor depth_cap, Tensor truncated, int k_max, Tensor(a!) selected, Tensor(b!) counts, Tensor(c!) order, "
      "Tensor(d!) parent_local, Tensor(e!) order_depth) -> ()");
  // Tree steps on vLLM's CPU_ATTN cache (tree_cpu.cpp; callers: echo_vllm.ops.tree).
  m.def(
      "tree_fix_attention(Tensor query, Tensor kv_cache, Tensor kmap, Tensor vmap, Tensor block_table, "
      "Tensor context_len, Tensor fix_rows, Tensor fix_req, Tensor fix_bits, float scale, float softcap, "
      "Tensor(a!) output) -> ()");
  m.def("tree_kv_compact(Tensor(a!) kv_cache, Tensor kmap, Tensor vmap, Tensor src_slots, Tensor dst_slots) -> ()");
  // A chain step's gates, order and budget cut in one call (chain_cpu.cpp; caller: echo_vllm.ops.chain).
  m.def(
      "chain_select(Tensor scores, Tensor valid, Tensor confidence, Tensor gate_on, Tensor tau, Tensor gain_table, "
      "Tensor rest, Tensor draft, float base_tokens, int k_cap, int k_min, bool surplus_tail, Tensor history, "
      "float history_prior) -> (Tensor counts, Tensor depth_cap, Tensor truncated, Tensor predicted)");
  m.def(
      "chain_select_logps(Tensor[] step_logps, int batch, Tensor? kept, Tensor gate_on, Tensor tau, "
      "Tensor gain_table, Tensor rest, Tensor draft, float base_tokens, int k_cap, int k_min, bool surplus_tail, "
      "Tensor history, float history_prior) -> (Tensor counts, Tensor depth_cap, Tensor truncated, "
      "Tensor predicted, Tensor scores, Tensor valid, Tensor confidence)");
  m.def("draft_argmax_logp(Tensor logits) -> (Tensor ids, Tensor logps)");
  m.def("draft_topk_logp(Tensor logits, int k) -> (Tensor ids, Tensor logps)");
  // Which build of the CPU kernels ran, counted (isa_calls.h; tests read it).
  m.def("cpu_isa_calls() -> int[]", &echo::cpu_isa_calls);
  // A verified chain step's feedback in one call (feedback_cpu.cpp; caller: echo_vllm.ops.chain).
  m.def(
      "chain_feedback(Tensor sampled, Tensor cur, Tensor old, Tensor verified, Tensor confidence, Tensor(a!) seen, "
      "Tensor(b!) hits, int drafted, bool record_acceptance, Tensor(c!) history, Tensor gain_table, float alpha) -> "
      "(Tensor accepted, Tensor sums, Tensor levels)");
}

// ---- Python module stub: importing echo_vllm._C loads the library and runs the registrations above. ----

namespace {

PyObject* cuda_compiled(PyObject* /*self*/, PyObject* /*args*/) {
#ifdef ECHO_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyMethodDef echo_methods[] = {
    {"cuda_compiled", cuda_compiled, METH_NOARGS, "Whether this build contains the CUDA kernel."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef echo_module = {
    PyModuleDef_HEAD_INIT, "_C", "echo-vllm compiled ops (torch.ops.echo.*)", -1, echo_methods,
    nullptr,               nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&echo_module); }
