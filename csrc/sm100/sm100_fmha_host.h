// Host-side helpers shared by the SM100 forward and backward api (.cpp, torch, no CUTLASS):
// validation with errors naming the argument, stride packing, int32 limits. Nothing here launches.
#pragma once

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/device_info.h"
#include "sm100/sm100_fmha_launch.h"

namespace mla_sm100 {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

inline DType dtype_of(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return DType::kBF16;
  if (t.scalar_type() == at::kHalf) return DType::kFP16;
  MLA_CHECK(false, "mla_autograd sm100: ", name, " must be bfloat16 or float16, got ", t.scalar_type());
  return DType::kBF16;
}

inline HeadDims head_dims_of(int64_t dqk, int64_t dvo) {
  if (dqk == 192 && dvo == 128) return HeadDims::kMla192x128;
  if (dqk == 128 && dvo == 128) return HeadDims::kMha128x128;
  MLA_CHECK(false, "mla_autograd sm100: head dims (q/k last dim ", dqk, ", v last dim ", dvo,
              ") are not supported; the SM100 kernels support (192, 128) and (128, 128)");
  return HeadDims::kMha128x128;
}

inline Mask mask_of(bool causal, bool bottom_right) {
  if (!causal) return Mask::kNone;
  return bottom_right ? Mask::kCausalBottomRight : Mask::kCausalTopLeft;
}

inline void check_shape(const at::Tensor& t, const char* name, std::vector<int64_t> expected) {
  MLA_CHECK(t.sizes().vec() == expected, "mla_autograd sm100: ", name, " has shape ", t.sizes(),
              ", expected ", at::IntArrayRef(expected));
}

// Strides of an attention operand (last dim unit, the others multiples of 8 elements = 16 bytes,
// fitting int32) and a 16-byte aligned pointer (TMA requirements).
inline void check_operand(const at::Tensor& t, const char* name) {
  MLA_CHECK(t.dim() >= 3, "mla_autograd sm100: ", name, " must have at least 3 dims, got ", t.dim());
  MLA_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, "mla_autograd sm100: ", name,
              " must have unit stride in its last dim (got strides ", t.strides(), ")");
  for (int64_t d = 0; d < t.dim() - 1; ++d) {
    if (t.size(d) <= 1) continue;  // a size-1 dim's stride is never used (canonicalised below)
    MLA_CHECK(t.stride(d) % 8 == 0, "mla_autograd sm100: ", name, " stride ", t.stride(d), " of dim ", d,
                " is not a multiple of 8 elements (16 bytes), as TMA requires (strides ", t.strides(), ")");
    MLA_CHECK(t.stride(d) > 0 && t.stride(d) <= kInt32Max, "mla_autograd sm100: ", name, " stride ",
                t.stride(d), " of dim ", d, " must be positive and below 2^31");
  }
  int64_t misalign = t.is_cuda() ? int64_t(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16)
                                 : int64_t((t.storage_offset() * t.element_size()) % 16);
  MLA_CHECK(misalign == 0, "mla_autograd sm100: ", name, " data pointer must be 16-byte aligned");
}

// (row, head) strides of a (rows, heads, d) view of `t` (3-D varlen, or 4-D dense merged over
// (batch, seq)); size-1 dims get a canonical stride. merged = false when the dense batch and
// sequence dims cannot be merged into one row dimension (the caller then copies).
struct RowHead {
  int64_t row = 0, head = 0;
  bool merged = true;
};
inline RowHead row_head_of(const at::Tensor& t) {
  RowHead r;
  int64_t D = t.size(-1), H = t.size(-2);
  r.head = H > 1 ? t.stride(-2) : D;
  if (t.dim() == 3) {
    r.row = t.size(0) > 1 ? t.stride(0) : H * D;
    return r;
  }
  int64_t B = t.size(0), S = t.size(1);
  if (S > 1) {
    r.row = t.stride(1);
    r.merged = (B <= 1) || (t.stride(0) == S * t.stride(1));
  } else {
    r.row = B > 1 ? t.stride(0) : H * D;
  }
  return r;
}

using mla::DeviceInfo;   // common/device_info.h: read once per device
using mla::device_info;

inline void check_cu(const c10::optional<at::Tensor>& cu, const char* name, int64_t batch_plus_1) {
  const at::Tensor& c = *cu;
  MLA_CHECK(c.scalar_type() == at::kInt, "mla_autograd sm100: ", name, " must be int32, got ", c.scalar_type());
  MLA_CHECK(c.dim() == 1, "mla_autograd sm100: ", name, " must be 1-D, got shape ", c.sizes());
  MLA_CHECK(c.stride(0) == 1 || c.size(0) <= 1, "mla_autograd sm100: ", name, " must be contiguous");
  if (batch_plus_1 >= 0) {
    MLA_CHECK(c.size(0) == batch_plus_1, "mla_autograd sm100: ", name, " has ", c.size(0),
                " entries, expected ", batch_plus_1, " (batch + 1, like cu_seqlens_q)");
  }
  MLA_CHECK(c.size(0) >= 1, "mla_autograd sm100: ", name, " must have at least one entry");
}

inline py::tuple tup(std::initializer_list<py::object> xs) {
  py::tuple t(xs.size());
  size_t i = 0;
  for (auto& x : xs) t[i++] = x;
  return t;
}
inline py::object I(int64_t v) { return py::int_(v); }

inline void throw_on(LaunchStatus const& s, const char* what) {
  MLA_CHECK(s.code == 0, "mla_autograd sm100: ", what, ": ", s.msg,
              s.cuda != cudaSuccess ? std::string(" (") + cudaGetErrorString(s.cuda) + ")" : std::string());
}

}  // namespace mla_sm100
