// Argument checks for the host layers: MLA_CHECK(cond, parts...) raises a c10::Error (a Python
// RuntimeError) whose message is the parts concatenated.
//
// Why not TORCH_CHECK's own formatting: it builds messages with std::ostringstream inside our
// extension, and on the H200 image (extensions built with its /opt/gcc) every TORCH_CHECK whose
// message formatted a number that way segfaulted, while string-only messages raised cleanly
// (in two kernel families; the cause is not established). Here numbers go through
// std::to_string and the message reaches TORCH_CHECK as one std::string, which c10 passes through.
#pragma once

#include <cmath>
#include <string>
#include <string_view>
#include <type_traits>

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

namespace mla {

inline std::string to_str(const char* s) { return s ? std::string(s) : std::string("(null)"); }
inline std::string to_str(const std::string& s) { return s; }
inline std::string to_str(std::string_view s) { return std::string(s); }
inline std::string to_str(bool b) { return b ? "true" : "false"; }
inline std::string to_str(char c) { return std::string(1, c); }
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                        !std::is_same_v<T, char>, int> = 0>
inline std::string to_str(T v) { return std::to_string(v); }
template <class T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline std::string to_str(T v) { return std::to_string(v); }
inline std::string to_str(c10::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a[i]);
  }
  return s + "]";
}
inline std::string to_str(c10::ScalarType t) { return c10::toString(t); }

template <class... A>
inline std::string cat(const A&... parts) {
  std::string s;
  ((s += to_str(parts)), ...);
  return s;
}

}  // namespace mla

#define MLA_CHECK(cond, ...) TORCH_CHECK(cond, ::mla::cat(__VA_ARGS__))

namespace mla {

// The one softmax_scale rule of every kernel family (and of the Python API, which checks it first):
// a finite, positive float. Zero is refused because CUTLASS's SM100 kernels read 0 as "use 1/sqrt(d)".
inline void check_softmax_scale(double softmax_scale, const char* family) {
  MLA_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, family,
            ": softmax_scale must be a finite number > 0, got ", softmax_scale);
}

}  // namespace mla
