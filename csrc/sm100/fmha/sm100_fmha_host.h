// Host-side helpers shared by the SM100 forward and backward api (.cpp, torch, no CUTLASS):
// validation with errors naming the argument, stride packing, int32 limits. Nothing here launches.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/cuda_check.h"
#include "common/device_info.h"
#include "sm100/fmha/sm100_fmha_cu.h"
#include "sm100/fmha/sm100_fmha_launch.h"

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

// The problem that the forward's and the backward's plans share (FwdPlan and BwdPlan extend it).
struct ProblemPlan {
  DType dtype = DType::kBF16;
  HeadDims hd = HeadDims::kMha128x128;
  Mask mask = Mask::kNone;
  bool varlen = false;
  int64_t B = 0, Hq = 0, Hk = 0, h_r = 1, dqk = 0, dvo = 0;
  int64_t Sq = 0, Sk = 0;  // dense only
  int64_t total_q = 0, total_k = 0, max_q = 0, max_k = 0;
  std::string empty;  // "" | "no_query_rows" | "no_keys": handled without a kernel
  float scale = 0.f;
};

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& q, const char* name) {
  MLA_CHECK(t.scalar_type() == q.scalar_type(), "mla_autograd sm100: ", name, " dtype ", t.scalar_type(),
            " must equal q dtype ", q.scalar_type());
}

// Validates the attention problem of q, k, v, out and lse (dense (B, S, H, D) or varlen (rows, H, D) with
// int32 cu_seqlens of B + 1 entries and max_seqlen_q/k) with errors naming the argument, and fills P: dtype,
// head dims, heads (Hq a multiple of Hk), mask, lengths, the int32 limits the CUTLASS kernels need, TMA
// strides and alignment, and whether the call needs a kernel at all (P.empty).
inline void plan_problem(ProblemPlan& P, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& cu_q,
                         const c10::optional<at::Tensor>& cu_k, const c10::optional<int64_t>& max_seqlen_q,
                         const c10::optional<int64_t>& max_seqlen_k, double softmax_scale, bool causal,
                         bool bottom_right) {
  P.dtype = dtype_of(q, "q");
  check_same_dtype(k, q, "k");
  check_same_dtype(v, q, "v");
  check_same_dtype(out, q, "out");
  MLA_CHECK(lse.scalar_type() == at::kFloat, "mla_autograd sm100: lse must be float32, got ", lse.scalar_type());
  MLA_CHECK(cu_q.has_value() == cu_k.has_value(),
            "mla_autograd sm100: cu_seqlens_q and cu_seqlens_k must be given together");
  mla::check_softmax_scale(softmax_scale, "mla_autograd sm100");
  P.scale = float(softmax_scale);
  P.varlen = cu_q.has_value();
  const int64_t nd = P.varlen ? 3 : 4;
  MLA_CHECK(q.dim() == nd, "mla_autograd sm100: q must be ", nd, "-D (",
            P.varlen ? "total_q, heads, d" : "batch, seqlen_q, heads, d", "), got shape ", q.sizes());
  MLA_CHECK(k.dim() == nd, "mla_autograd sm100: k must be ", nd, "-D, got shape ", k.sizes());
  MLA_CHECK(v.dim() == nd, "mla_autograd sm100: v must be ", nd, "-D, got shape ", v.sizes());
  P.dqk = q.size(-1);
  P.dvo = v.size(-1);
  P.hd = head_dims_of(P.dqk, P.dvo);
  P.Hq = q.size(-2);
  P.Hk = k.size(-2);
  MLA_CHECK(P.Hq >= 1 && P.Hk >= 1, "mla_autograd sm100: q and k need at least one head");
  MLA_CHECK(P.Hq % P.Hk == 0, "mla_autograd sm100: q heads ", P.Hq, " must be a multiple of k heads ", P.Hk);
  MLA_CHECK(P.Hq <= 65535, "mla_autograd sm100: q heads ", P.Hq, " above the grid limit 65535");
  P.h_r = P.Hq / P.Hk;
  P.mask = mask_of(causal, bottom_right);
  if (P.varlen) {
    check_cu(cu_q, "cu_seqlens_q", -1);
    P.B = cu_q->size(0) - 1;
    check_cu(cu_k, "cu_seqlens_k", P.B + 1);
    P.total_q = q.size(0);
    P.total_k = k.size(0);
    MLA_CHECK(max_seqlen_q.has_value() && max_seqlen_k.has_value(),
              "mla_autograd sm100: varlen calls need max_seqlen_q and max_seqlen_k");
    MLA_CHECK(*max_seqlen_q >= 0 && *max_seqlen_k >= 0, "mla_autograd sm100: max_seqlen_q/max_seqlen_k must be >= 0");
    P.max_q = *max_seqlen_q;
    P.max_k = *max_seqlen_k;
    check_shape(k, "k", {P.total_k, P.Hk, P.dqk});
    check_shape(v, "v", {P.total_k, P.Hk, P.dvo});
    check_shape(out, "out", {P.total_q, P.Hq, P.dvo});
    check_shape(lse, "lse", {P.Hq, P.total_q});
  } else {
    P.B = q.size(0);
    P.Sq = q.size(1);
    P.Sk = k.size(1);
    P.total_q = P.B * P.Sq;
    P.total_k = P.B * P.Sk;
    P.max_q = P.Sq;
    P.max_k = P.Sk;
    check_shape(k, "k", {P.B, P.Sk, P.Hk, P.dqk});
    check_shape(v, "v", {P.B, P.Sk, P.Hk, P.dvo});
    check_shape(out, "out", {P.B, P.Sq, P.Hq, P.dvo});
    check_shape(lse, "lse", {P.B, P.Hq, P.Sq});
  }
  MLA_CHECK(P.total_q <= kInt32Max && P.total_k <= kInt32Max && P.max_q <= kInt32Max && P.max_k <= kInt32Max,
            "mla_autograd sm100: sequence lengths / token counts must be below 2^31");
  check_operand(q, "q");
  check_operand(k, "k");
  check_operand(v, "v");
  check_operand(out, "out");
  // no kernel: nothing to write / no keys at all
  if (P.total_q == 0 || P.B == 0) {
    P.empty = "no_query_rows";
  } else if (P.total_k == 0) {
    P.empty = "no_keys";
  } else {
    MLA_CHECK(P.max_q > 0, "mla_autograd sm100: max_seqlen_q is 0 but q has ", P.total_q, " rows");
  }
}

inline py::tuple tup(std::initializer_list<py::object> xs) {
  py::tuple t(xs.size());
  size_t i = 0;
  for (auto& x : xs) t[i++] = x;
  return t;
}
inline py::object I(int64_t v) { return py::int_(v); }

// The launched cu_seqlens (sm100_fmha_cu.h), made on `stream` from the caller's int32 (B + 1) tensors:
// sanitised (clamped into [0, rows], non-decreasing) and laid out; no host synchronisation. `family` names
// the caller in a launch error.
inline std::pair<at::Tensor, at::Tensor> launched_cu(const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t B,
                                                     int64_t rows_q, int64_t rows_k, CuLayout layout,
                                                     cudaStream_t stream, const char* family) {
  const int64_t n = B + 1, e = cu_entries(layout, B);
  const bool plain = layout == CuLayout::kPlain;
  at::Tensor buf = at::empty({2 * n + (plain ? 0 : 2 * e)}, cu_q.options());
  int* base = buf.data_ptr<int>();
  CuSanitize p{cu_q.data_ptr<int>(), cu_k.data_ptr<int>(), int(B), int(rows_q), int(rows_k), layout,
               base, base + n, plain ? base : base + 2 * n, plain ? base + n : base + 2 * n + e};
  MLA_CUDA_CHECK(sanitize_cu(p, stream), family, ": cu_seqlens sanitiser launch");
  return plain ? std::make_pair(buf.narrow(0, 0, n), buf.narrow(0, n, n))
               : std::make_pair(buf.narrow(0, 2 * n, e), buf.narrow(0, 2 * n + e, e));
}

// The same steps on the host (CPU int32 tensors), for the CPU tests: (launched cu_q, launched cu_k).
inline py::tuple sanitize_cu_on_host(const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t rows_q, int64_t rows_k,
                                     int64_t layout) {
  MLA_CHECK(!cu_q.is_cuda() && !cu_k.is_cuda(), "mla_autograd sm100: sanitize_cu_host takes CPU tensors");
  MLA_CHECK(layout >= 0 && layout <= 2, "mla_autograd sm100: layout must be 0, 1 or 2");
  check_cu(cu_q, "cu_seqlens_q", -1);
  const int64_t B = cu_q.size(0) - 1;
  check_cu(cu_k, "cu_seqlens_k", B + 1);
  const CuLayout l = CuLayout(layout);
  at::Tensor cq = cu_q.contiguous(), ck = cu_k.contiguous();
  at::Tensor c = at::empty({2 * (B + 1)}, cq.options());
  at::Tensor dq = at::empty({cu_entries(l, B)}, cq.options()), dk = at::empty({cu_entries(l, B)}, cq.options());
  const bool plain = l == CuLayout::kPlain;
  int* cp = c.data_ptr<int>();
  CuSanitize p{cq.data_ptr<int>(), ck.data_ptr<int>(), int(B), int(rows_q), int(rows_k), l, cp, cp + B + 1,
               plain ? cp : dq.data_ptr<int>(), plain ? cp + B + 1 : dk.data_ptr<int>()};
  sanitize_cu_host(p);
  if (plain) return tup({py::cast(c.narrow(0, 0, B + 1).clone()), py::cast(c.narrow(0, B + 1, B + 1).clone())});
  return tup({py::cast(dq), py::cast(dk)});
}

inline void bind_sanitize_cu(py::module_& m) {
  m.def("sanitize_cu_host", &sanitize_cu_on_host,
        "the launched cu_seqlens (sanitised, laid out: 0 plain, 1 empty batch in front, 2 bottom-right split) "
        "computed on the host by the steps of the device kernel; CPU int32 tensors",
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("rows_q"), py::arg("rows_k"), py::arg("layout"));
}

}  // namespace mla_sm100
