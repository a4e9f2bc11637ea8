// Argument checks of the echo ops whose error messages are built without iostreams.
//
// TORCH_CHECK*(cond, a, b, ...) formats its arguments with c10::str, i.e. through a std::ostringstream
// instantiated in *this* library. A toolchain that links libstdc++ statically into the extension (the GPU image's
// /opt/gcc/bin/g++: its _C.so needs no libstdc++.so.6) leaves two libstdc++ copies in the process, torch's shared
// one and ours; inserting an integer into that stream then segfaulted inside the static copy's num_put
// (echo::select_budget with k_max = -1 on CPU, torch 2.11: "Fatal Python error: Segmentation fault" instead of
// a ValueError; the select_budget computation itself was fine). ECHO_CHECK* build the message with std::string
// and std::to_string alone and throw it with C10_THROW_ERROR, so nothing of iostream runs in this library; the
// text is what TORCH_CHECK's `<<` would have printed (echo_vllm/ops/_fake.py mirrors some of it). Like
// TORCH_CHECK, the message is built only when the check fails.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace echo {
namespace check_msg {

inline void put(std::string& out, const char* text) { out += text; }
inline void put(std::string& out, const std::string& text) { out += text; }
inline void put(std::string& out, at::ScalarType dtype) { out += c10::toString(dtype); }
inline void put(std::string& out, const c10::Device& device) { out += device.str(); }

template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
void put(std::string& out, T value) {
  out += std::to_string(value);
}

// "[a, b]", as c10's operator<< prints sizes and strides.
inline void put(std::string& out, c10::IntArrayRef values) {
  out += '[';
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) {
      out += ", ";
    }
    out += std::to_string(values[i]);
  }
  out += ']';
}

template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  (put(out, args), ...);
  return out;
}

}  // namespace check_msg
}  // namespace echo

#define ECHO_CHECK_WITH(error_t, cond, ...)                                    \
  do {                                                                         \
    if (C10_UNLIKELY(!(cond))) {                                               \
      C10_THROW_ERROR(error_t, ::echo::check_msg::cat(__VA_ARGS__));           \
    }                                                                          \
  } while (false)

// TORCH_CHECK_VALUE / TORCH_CHECK_TYPE / TORCH_CHECK (ValueError / TypeError / RuntimeError in Python).
#define ECHO_CHECK_VALUE(cond, ...) ECHO_CHECK_WITH(ValueError, cond, __VA_ARGS__)
#define ECHO_CHECK_TYPE(cond, ...) ECHO_CHECK_WITH(TypeError, cond, __VA_ARGS__)
#define ECHO_CHECK(cond, ...) ECHO_CHECK_WITH(Error, cond, __VA_ARGS__)

// Ahead of AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, ...): the dispatch's own
// rejection of other dtypes formats through c10::str; this one raises the same NotImplementedError first.
#define ECHO_CHECK_FLOATING_DISPATCH(dtype, name)                                                          \
  ECHO_CHECK_WITH(NotImplementedError,                                                                     \
                  (dtype) == at::kFloat || (dtype) == at::kDouble || (dtype) == at::kHalf ||               \
                      (dtype) == at::kBFloat16,                                                            \
                  "\"", name, "\" not implemented for '", (dtype), "'")
