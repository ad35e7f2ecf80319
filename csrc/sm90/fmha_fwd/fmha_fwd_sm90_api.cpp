// Host layer of the fmha_fwd_sm90 family: validates every argument, fills FmhaFwdSm90Params and
// launches on the current stream. Contract: docs/architecture.md, "Forward".
//   fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
//       bottom_right) -> None                      what mla_autograd/_ops.py calls
//   fwd_with_options(..., options: dict) -> None   the same with launch options (tests and benchmarks only)
//   fwd_mla(q_nope, q_pe, k_nope, k_pe, v, out, lse, ...) -> None   fwd's arguments with MLA's split q / k read in
//       place (the MLA-native 192/128 forward); fwd_mla_with_options likewise
//   seq_order(cu_seqlens_q, cu_seqlens_k, rows_q, rows_k, max_seqlen_q, max_seqlen_k) -> int32 (B,)   the order in
//       which the varlen schedules take the sequences (tests only)
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "common/checks.h"
#include "common/cuda_check.h"
#include "common/device_info.h"
#include "common/options.h"
#include "sm90/fmha_fwd/fmha_fwd_sm90_params.h"

namespace {

// TMA's rules: unit last stride, every other stride a multiple of 16 bytes, a 16-byte aligned base. skip_dim: a
// dimension whose stride the kernel never uses (a one-head k_pe's head dimension).
void check_strides(const at::Tensor& t, const char* name, int64_t skip_dim = -1) {
  MLA_CHECK(t.stride(-1) == 1, "fmha_fwd_sm90: ", name, " must have unit stride in its last dim, got ",
              t.strides());
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if (i == skip_dim) continue;
    MLA_CHECK(t.stride(i) % 8 == 0, "fmha_fwd_sm90: ", name, " stride ", i, " (", t.stride(i),
                ") must be a multiple of 8 elements");
  }
  MLA_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "fmha_fwd_sm90: ", name,
              " must be 16-byte aligned");
}

// fwd_with_options' `options` -> FmhaFwdSm90Options; {} gives fwd's defaults. Keys:
//   "l2_group": int >= 0, (head, batch) pairs per L2 launch group (0: every pair interleaved).
//   "ctas": int >= 0, CTAs of the persistent grid (0: the launcher's choice; see FmhaFwdSm90Options).
//   "dynamic": bool, dynamic (True) or static (False) tile assignment instead of the launcher's choice.
//   "wide_keys": bool, False: unmasked problems keep the causal tile's key block (see FmhaFwdSm90Config).
//   "longest_first": bool, False: a packed batch's tiles in cu_seqlens order, not longest sequence first.
//   "staged_epilogue": bool, False: O stored straight from the accumulator layout, not through smem staging rows.
FmhaFwdSm90Options parse_options(const pybind11::dict& options) {
  FmhaFwdSm90Options o;
  constexpr const char* fn = "fmha_fwd_sm90";
  for (auto item : options) {
    const std::string key = mla::option_key(item.first, fn);
    if (key == "l2_group") {
      o.l2_head_group = mla::option_count(item.second, fn, key);
    } else if (key == "ctas") {
      o.ctas = mla::option_count(item.second, fn, key);
    } else if (key == "dynamic") {
      o.scheduler = mla::option_bool(item.second, fn, key) ? 1 : 0;
    } else if (key == "wide_keys") {
      o.wide_keys = mla::option_bool(item.second, fn, key);
    } else if (key == "longest_first") {
      o.longest_first = mla::option_bool(item.second, fn, key);
    } else if (key == "staged_epilogue") {
      o.staged_epilogue = mla::option_bool(item.second, fn, key);
    } else {
      MLA_CHECK(false, "fmha_fwd_sm90: unknown option '", key,
                "' (known: l2_group, ctas, dynamic, wide_keys, longest_first, staged_epilogue)");
    }
  }
  return o;
}

// The rope parts of an MLA-native call: q and k of fwd_impl are then q_nope and k_nope.
struct RopeInputs {
  const at::Tensor& q_pe;
  const at::Tensor& k_pe;
};

// Checks q_pe / k_pe against q_nope (q) and k_nope (k), whose shapes fwd_impl has checked, and fills `rp` with
// their pointers and strides. Returns Dr.
int64_t set_rope_parts(const RopeInputs& r, const at::Tensor& q, const at::Tensor& k, bool varlen,
                       FmhaFwdSm90RopeParts& rp) {
  const at::Tensor& qp = r.q_pe;
  const at::Tensor& kp = r.k_pe;
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&qp, "q_pe"}, {&kp, "k_pe"}}) {
    MLA_CHECK(t->is_cuda() && t->device() == q.device(), "fmha_fwd_sm90: ", name,
              " must be a CUDA tensor on the device of q_nope");
    MLA_CHECK(t->scalar_type() == q.scalar_type(), "fmha_fwd_sm90: ", name, " must have the dtype of q_nope");
    MLA_CHECK(t->dim() == q.dim(), "fmha_fwd_sm90: ", name, " must have ", q.dim(), " dims, got ", t->sizes());
  }
  int64_t const nd = q.dim();
  for (int64_t i = 0; i + 1 < nd; ++i) {
    MLA_CHECK(qp.size(i) == q.size(i), "fmha_fwd_sm90: q_pe shape ", qp.sizes(), " does not match q_nope ", q.sizes());
  }
  for (int64_t i = 0; i + 2 < nd; ++i) {
    MLA_CHECK(kp.size(i) == k.size(i), "fmha_fwd_sm90: k_pe shape ", kp.sizes(), " does not match k_nope ", k.sizes());
  }
  int64_t const hkv = k.size(-2), heads = kp.size(-2);
  MLA_CHECK(heads == 1 || heads == hkv, "fmha_fwd_sm90: k_pe must have 1 head or as many as k_nope (", hkv,
            "), got ", heads);
  MLA_CHECK(kp.size(-1) == qp.size(-1), "fmha_fwd_sm90: k_pe head dim ", kp.size(-1), " must equal q_pe's ",
            qp.size(-1));
  check_strides(qp, "q_pe");
  check_strides(kp, "k_pe", heads == 1 ? nd - 2 : -1);
  rp.q_pe = qp.data_ptr();
  rp.k_pe = kp.data_ptr();
  rp.k_pe_heads = int(heads);
  int64_t const r0 = varlen ? 0 : 1;  // the row dimension
  rp.q_pe_row_stride = qp.stride(r0); rp.q_pe_head_stride = qp.stride(r0 + 1);
  rp.k_pe_row_stride = kp.stride(r0); rp.k_pe_head_stride = heads == 1 ? 8 : kp.stride(r0 + 1);
  rp.q_pe_batch_stride = varlen ? 0 : qp.stride(0);
  rp.k_pe_batch_stride = varlen ? 0 : kp.stride(0);
  return qp.size(-1);
}

void fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
              const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
              std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k, double softmax_scale,
              bool causal, bool bottom_right, const FmhaFwdSm90Options& opt, const RopeInputs* rope = nullptr) {
  // ---- device, dtypes ----
  MLA_CHECK(q.is_cuda(), "fmha_fwd_sm90: q must be a CUDA tensor");
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&k, "k"}, {&v, "v"}, {&out, "out"}, {&lse, "lse"}}) {
    MLA_CHECK(t->is_cuda() && t->device() == q.device(), "fmha_fwd_sm90: ", name,
                " must be a CUDA tensor on the device of q");
  }
  auto dt = q.scalar_type();
  MLA_CHECK(dt == at::kBFloat16 || dt == at::kHalf, "fmha_fwd_sm90: q must be bfloat16 or float16, got ", dt);
  MLA_CHECK(k.scalar_type() == dt, "fmha_fwd_sm90: k must have the dtype of q");
  MLA_CHECK(v.scalar_type() == dt, "fmha_fwd_sm90: v must have the dtype of q");
  MLA_CHECK(out.scalar_type() == dt, "fmha_fwd_sm90: out must have the dtype of q");
  MLA_CHECK(lse.scalar_type() == at::kFloat, "fmha_fwd_sm90: lse must be float32");
  mla::check_softmax_scale(softmax_scale, "fmha_fwd_sm90");
  MLA_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
              "fmha_fwd_sm90: cu_seqlens_q and cu_seqlens_k must be given together");
  bool const varlen = cu_seqlens_q.has_value();

  FmhaFwdSm90Params p{};
  int64_t B, Sq, Sk, Hq, Hkv, Dqk, Dv, rows_q, rows_k;
  if (!varlen) {
    MLA_CHECK(q.dim() == 4, "fmha_fwd_sm90: q must be (B, Sq, Hq, Dqk), got ", q.sizes());
    MLA_CHECK(k.dim() == 4, "fmha_fwd_sm90: k must be (B, Sk, Hkv, Dqk), got ", k.sizes());
    MLA_CHECK(v.dim() == 4, "fmha_fwd_sm90: v must be (B, Sk, Hkv, Dv), got ", v.sizes());
    B = q.size(0); Sq = q.size(1); Hq = q.size(2); Dqk = q.size(3);
    Sk = k.size(1); Hkv = k.size(2); Dv = v.size(3);
    MLA_CHECK(k.size(0) == B && k.size(3) == Dqk, "fmha_fwd_sm90: k shape ", k.sizes(), " does not match q ", q.sizes());
    MLA_CHECK(v.size(0) == B && v.size(1) == Sk && v.size(2) == Hkv,
                "fmha_fwd_sm90: v shape ", v.sizes(), " does not match k ", k.sizes());
    MLA_CHECK(out.dim() == 4 && out.size(0) == B && out.size(1) == Sq && out.size(2) == Hq && out.size(3) == Dv,
                "fmha_fwd_sm90: out must be (B, Sq, Hq, Dv) = (", B, ", ", Sq, ", ", Hq, ", ", Dv, "), got ", out.sizes());
    MLA_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == Hq && lse.size(2) == Sq,
                "fmha_fwd_sm90: lse must be (B, Hq, Sq), got ", lse.sizes());
    rows_q = Sq; rows_k = Sk;
    p.q_row_stride = q.stride(1); p.q_head_stride = q.stride(2); p.q_batch_stride = q.stride(0);
    p.k_row_stride = k.stride(1); p.k_head_stride = k.stride(2); p.k_batch_stride = k.stride(0);
    p.v_row_stride = v.stride(1); p.v_head_stride = v.stride(2); p.v_batch_stride = v.stride(0);
    p.o_row_stride = out.stride(1); p.o_head_stride = out.stride(2); p.o_batch_stride = out.stride(0);
    p.lse_head_stride = lse.stride(1); p.lse_batch_stride = lse.stride(0);
    MLA_CHECK(lse.stride(2) == 1, "fmha_fwd_sm90: lse must have unit stride in its last dim");
  } else {
    const at::Tensor& cq = *cu_seqlens_q;
    const at::Tensor& ck = *cu_seqlens_k;
    MLA_CHECK(cq.is_cuda() && cq.device() == q.device(), "fmha_fwd_sm90: cu_seqlens_q must be on the device of q");
    MLA_CHECK(ck.is_cuda() && ck.device() == q.device(), "fmha_fwd_sm90: cu_seqlens_k must be on the device of q");
    MLA_CHECK(cq.scalar_type() == at::kInt && cq.dim() == 1 && cq.is_contiguous(),
                "fmha_fwd_sm90: cu_seqlens_q must be a contiguous int32 (B+1,) tensor");
    MLA_CHECK(ck.scalar_type() == at::kInt && ck.dim() == 1 && ck.is_contiguous(),
                "fmha_fwd_sm90: cu_seqlens_k must be a contiguous int32 (B+1,) tensor");
    MLA_CHECK(cq.size(0) >= 1 && cq.size(0) == ck.size(0),
                "fmha_fwd_sm90: cu_seqlens_q and cu_seqlens_k must both have B+1 >= 1 entries");
    MLA_CHECK(max_seqlen_q.has_value() && max_seqlen_k.has_value(),
                "fmha_fwd_sm90: max_seqlen_q and max_seqlen_k are required with cu_seqlens");
    MLA_CHECK(q.dim() == 3, "fmha_fwd_sm90: varlen q must be (Tq, Hq, Dqk), got ", q.sizes());
    MLA_CHECK(k.dim() == 3, "fmha_fwd_sm90: varlen k must be (Tk, Hkv, Dqk), got ", k.sizes());
    MLA_CHECK(v.dim() == 3, "fmha_fwd_sm90: varlen v must be (Tk, Hkv, Dv), got ", v.sizes());
    B = cq.size(0) - 1;
    rows_q = q.size(0); Hq = q.size(1); Dqk = q.size(2);
    rows_k = k.size(0); Hkv = k.size(1); Dv = v.size(2);
    Sq = *max_seqlen_q; Sk = *max_seqlen_k;
    MLA_CHECK(Sq >= 0 && Sk >= 0, "fmha_fwd_sm90: max_seqlen_q/max_seqlen_k must be >= 0");
    // No sequence has more rows than its packed tensor: a larger bound cuts nothing (varlen_rows), so it is capped
    // there, which keeps it an int for the kernels and the grid no larger than the rows.
    Sq = std::min(Sq, rows_q); Sk = std::min(Sk, rows_k);
    MLA_CHECK(k.size(2) == Dqk, "fmha_fwd_sm90: k shape ", k.sizes(), " does not match q ", q.sizes());
    MLA_CHECK(v.size(0) == rows_k && v.size(1) == Hkv, "fmha_fwd_sm90: v shape ", v.sizes(), " does not match k ", k.sizes());
    MLA_CHECK(out.dim() == 3 && out.size(0) == rows_q && out.size(1) == Hq && out.size(2) == Dv,
                "fmha_fwd_sm90: out must be (Tq, Hq, Dv), got ", out.sizes());
    MLA_CHECK(lse.dim() == 2 && lse.size(0) == Hq && lse.size(1) == rows_q,
                "fmha_fwd_sm90: lse must be (Hq, Tq), got ", lse.sizes());
    MLA_CHECK(lse.stride(1) == 1, "fmha_fwd_sm90: lse must have unit stride in its last dim");
    p.q_row_stride = q.stride(0); p.q_head_stride = q.stride(1); p.q_batch_stride = 0;
    p.k_row_stride = k.stride(0); p.k_head_stride = k.stride(1); p.k_batch_stride = 0;
    p.v_row_stride = v.stride(0); p.v_head_stride = v.stride(1); p.v_batch_stride = 0;
    p.o_row_stride = out.stride(0); p.o_head_stride = out.stride(1); p.o_batch_stride = 0;
    p.lse_head_stride = lse.stride(0); p.lse_batch_stride = 0;
    p.cu_seqlens_q = cq.data_ptr<int>();
    p.cu_seqlens_k = ck.data_ptr<int>();
  }
  FmhaFwdSm90RopeParts rp{};
  if (rope != nullptr) {
    int64_t const Dn = Dqk;
    int64_t const Dr = set_rope_parts(*rope, q, k, varlen, rp);
    MLA_CHECK(Dn == 128 && Dr == 64 && Dv == 128, "fmha_fwd_sm90: the MLA-native forward takes (Dn, Dr, Dv) = "
              "(128, 64, 128) (q_nope, q_pe, v head dims), got (", Dn, ", ", Dr, ", ", Dv, ")");
    Dqk = Dn + Dr;
  }
  MLA_CHECK((Dqk == 192 && Dv == 128) || (Dqk == 128 && Dv == 128) || (Dqk == 64 && Dv == 64),
              "fmha_fwd_sm90: (Dqk, Dv) must be (192, 128), (128, 128) or (64, 64), got (", Dqk, ", ", Dv, ")");
  MLA_CHECK(Hkv > 0 && Hq % Hkv == 0, "fmha_fwd_sm90: Hq (", Hq, ") must be a multiple of Hkv (", Hkv, ")");
  MLA_CHECK(rows_q < (int64_t(1) << 31) && rows_k < (int64_t(1) << 31) && Sq < (int64_t(1) << 31) &&
                  Sk < (int64_t(1) << 31),
              "fmha_fwd_sm90: sequence lengths must fit in int32");
  MLA_CHECK(B * Hq < (int64_t(1) << 31), "fmha_fwd_sm90: batch * heads too large");
  check_strides(q, "q");
  check_strides(k, "k");
  check_strides(v, "v");
  check_strides(out, "out");
  // tile numbers (head, batch, 64-row M-block) are int32 (the 64/64 config's M-block is 192 rows)
  MLA_CHECK(B * Hq * ((Sq + 63) / 64) < (int64_t(1) << 31), "fmha_fwd_sm90: batch * heads * M-blocks too large for the grid");

  c10::cuda::CUDAGuard guard(q.device());
  if (B == 0 || Hq == 0 || rows_q == 0 || Sq == 0) return;

  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr();
  p.o = out.data_ptr(); p.lse = lse.data_ptr<float>();
  p.batch = int(B); p.hq = int(Hq); p.hkv = int(Hkv); p.head_dim_qk = int(Dqk); p.head_dim_v = int(Dv);
  p.seqlen_q = int(Sq); p.seqlen_k = int(Sk); p.rows_q = int(rows_q); p.rows_k = int(rows_k);
  p.softmax_scale = float(softmax_scale);
  p.causal = causal; p.bottom_right = bottom_right;
  p.is_bf16 = dt == at::kBFloat16;
  // TMA needs at least one row in every tensor it describes; an empty K/V means every row sees no key.
  at::Tensor kv_dummy;
  if (rows_k == 0) {
    kv_dummy = at::zeros({8, std::max<int64_t>(Dqk, Dv)}, q.options());
    p.k = kv_dummy.data_ptr(); p.v = kv_dummy.data_ptr();
    p.rows_k = 1; p.hkv = int(Hkv);
    // Never read (no key block is visited); only the TMA descriptors are encoded from it.
    int64_t const dmax = std::max<int64_t>(Dqk, Dv);
    p.k_row_stride = p.v_row_stride = dmax; p.k_head_stride = p.v_head_stride = dmax;
    p.k_batch_stride = p.v_batch_stride = dmax;
    p.seqlen_k = 0;
    rp.k_pe = kv_dummy.data_ptr();
    rp.k_pe_row_stride = rp.k_pe_head_stride = rp.k_pe_batch_stride = dmax;
    rp.k_pe_heads = 1;
  }

  cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  // The dynamic tile scheduler's counter, zeroed on the stream before the kernel, and for a packed batch of at most
  // kSeqOrderMaxBatch sequences the order its tiles take them in (longest first), which the launcher writes on the
  // stream (mla_sm90::launch_seq_order, zeroing the counter in the same launch).
  const bool dynamic = fmha_fwd_sm90_dynamic_tiles(p, opt);
  const bool ordered = varlen && opt.longest_first && B <= kSeqOrderMaxBatch;
  at::Tensor schedule_ints;  // [tile counter][sequence order]
  if (dynamic || ordered) {
    schedule_ints = at::empty({int64_t(dynamic) + (ordered ? B : 0)}, q.options().dtype(at::kInt));
    int* const ints = schedule_ints.data_ptr<int>();
    if (dynamic) p.tile_counter = ints;
    if (ordered) p.seq_order = ints + int(dynamic);
    if (dynamic && !ordered) {
      MLA_CUDA_CHECK(cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream),
                     "fmha_fwd_sm90: zeroing the tile counter");
    }
  }
  mla::DeviceInfo const& dev = mla::device_info(q.get_device());
  if (rope != nullptr) {
    MLA_CUDA_CHECK(fmha_fwd_sm90_launch_mla_192_128(p, rp, opt, dev, stream), "fmha_fwd_sm90: launch");
    return;
  }
  auto const launch = Dqk == 192 ? fmha_fwd_sm90_launch_192_128
                      : Dqk == 128 ? fmha_fwd_sm90_launch_128_128
                                   : fmha_fwd_sm90_launch_64_64;
  MLA_CUDA_CHECK(launch(p, opt, dev, stream), "fmha_fwd_sm90: launch");
}

void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
         const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
         std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k, double softmax_scale,
         bool causal, bool bottom_right) {
  fwd_impl(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
           bottom_right, FmhaFwdSm90Options{});
}

void fwd_with_options(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                      at::Tensor& lse, const std::optional<at::Tensor>& cu_seqlens_q,
                      const std::optional<at::Tensor>& cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
                      std::optional<int64_t> max_seqlen_k, double softmax_scale, bool causal, bool bottom_right,
                      const pybind11::dict& options) {
  const FmhaFwdSm90Options opt = parse_options(options);
  fwd_impl(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
           bottom_right, opt);
}

void fwd_mla_with_options(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& k_nope,
                          const at::Tensor& k_pe, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                          const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
                          std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
                          double softmax_scale, bool causal, bool bottom_right, const pybind11::dict& options) {
  const FmhaFwdSm90Options opt = parse_options(options);
  const RopeInputs rope{q_pe, k_pe};
  fwd_impl(q_nope, k_nope, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
           causal, bottom_right, opt, &rope);
}

void fwd_mla(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& k_nope, const at::Tensor& k_pe,
             const at::Tensor& v, at::Tensor& out, at::Tensor& lse, const std::optional<at::Tensor>& cu_seqlens_q,
             const std::optional<at::Tensor>& cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
             std::optional<int64_t> max_seqlen_k, double softmax_scale, bool causal, bool bottom_right) {
  fwd_mla_with_options(q_nope, q_pe, k_nope, k_pe, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, softmax_scale, causal, bottom_right, pybind11::dict());
}

// The order in which the varlen schedules take the sequences of cu_seqlens_q / cu_seqlens_k (int32 (B + 1,) on
// the device) over packed tensors of rows_q / rows_k rows with max_seqlen_q / max_seqlen_k: an int32 (B,)
// permutation, longest first (FmhaProblemParams::seq_order). Tests only; B <= kSeqOrderMaxBatch.
at::Tensor seq_order(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t rows_q, int64_t rows_k,
                     int64_t max_seqlen_q, int64_t max_seqlen_k) {
  for (const at::Tensor* t : {&cu_seqlens_q, &cu_seqlens_k}) {
    MLA_CHECK(t->is_cuda() && t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous(),
              "fmha_fwd_sm90: seq_order: cu_seqlens_q / cu_seqlens_k must be contiguous int32 (B+1,) CUDA tensors");
  }
  MLA_CHECK(cu_seqlens_q.device() == cu_seqlens_k.device() && cu_seqlens_q.size(0) == cu_seqlens_k.size(0) &&
                cu_seqlens_q.size(0) >= 1,
            "fmha_fwd_sm90: seq_order: cu_seqlens_q and cu_seqlens_k must have B+1 >= 1 entries on one device");
  const int64_t B = cu_seqlens_q.size(0) - 1;
  MLA_CHECK(B <= kSeqOrderMaxBatch, "fmha_fwd_sm90: seq_order: at most ", kSeqOrderMaxBatch, " sequences, got ", B);
  for (int64_t x : {rows_q, rows_k, max_seqlen_q, max_seqlen_k}) {
    MLA_CHECK(x >= 0 && x < (int64_t(1) << 31), "fmha_fwd_sm90: seq_order: rows and max_seqlen must fit in int32");
  }
  c10::cuda::CUDAGuard guard(cu_seqlens_q.device());
  at::Tensor order = at::empty({B}, cu_seqlens_q.options());
  if (B == 0) return order;
  FmhaProblemParams p{};
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
  p.cu_seqlens_k = cu_seqlens_k.data_ptr<int>();
  p.seq_order = order.data_ptr<int>();
  p.batch = int(B);
  p.rows_q = int(rows_q); p.rows_k = int(rows_k);
  p.seqlen_q = int(max_seqlen_q); p.seqlen_k = int(max_seqlen_k);
  MLA_CUDA_CHECK(fmha_fwd_sm90_seq_order(p, at::cuda::getCurrentCUDAStream().stream()), "fmha_fwd_sm90: seq_order");
  return order;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mla_autograd SM90 (Hopper) fused attention forward (TMA + wgmma, warp-specialized)";
  m.def("fwd", &fwd, "fused attention forward (see docs/architecture.md)", pybind11::arg("q"), pybind11::arg("k"),
        pybind11::arg("v"), pybind11::arg("out"), pybind11::arg("lse"), pybind11::arg("cu_seqlens_q"),
        pybind11::arg("cu_seqlens_k"), pybind11::arg("max_seqlen_q"), pybind11::arg("max_seqlen_k"),
        pybind11::arg("softmax_scale"), pybind11::arg("causal"), pybind11::arg("bottom_right"));
  m.def("fwd_with_options", &fwd_with_options,
        "fwd with launch options, for tests and benchmarks: options = {'l2_group': N} forces N (head, batch) "
        "pairs per L2 launch group (0: all interleaved), {'ctas': N} a persistent grid of N CTAs (0: automatic), "
        "{'dynamic': bool} dynamic or static tile assignment, {'wide_keys': False} the causal tile's key block "
        "without a mask too, {'longest_first': False} varlen tiles in cu_seqlens order, {'staged_epilogue': False} O "
        "stored straight from the accumulator layout; {} is fwd",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"), pybind11::arg("lse"),
        pybind11::arg("cu_seqlens_q"), pybind11::arg("cu_seqlens_k"), pybind11::arg("max_seqlen_q"),
        pybind11::arg("max_seqlen_k"), pybind11::arg("softmax_scale"), pybind11::arg("causal"),
        pybind11::arg("bottom_right"), pybind11::arg("options"));
  m.def("fwd_mla", &fwd_mla,
        "fwd with MLA's split query and key read in place: q_nope (.., Hq, 128), q_pe (.., Hq, 64), k_nope "
        "(.., Hkv, 128), k_pe (.., 1 or Hkv, 64), v (.., Hkv, 128); out and lse as fwd's, bit for bit those of fwd "
        "on the concatenated q / k",
        pybind11::arg("q_nope"), pybind11::arg("q_pe"), pybind11::arg("k_nope"), pybind11::arg("k_pe"),
        pybind11::arg("v"), pybind11::arg("out"), pybind11::arg("lse"), pybind11::arg("cu_seqlens_q"),
        pybind11::arg("cu_seqlens_k"), pybind11::arg("max_seqlen_q"), pybind11::arg("max_seqlen_k"),
        pybind11::arg("softmax_scale"), pybind11::arg("causal"), pybind11::arg("bottom_right"));
  m.def("fwd_mla_with_options", &fwd_mla_with_options, "fwd_mla with fwd_with_options' launch options",
        pybind11::arg("q_nope"), pybind11::arg("q_pe"), pybind11::arg("k_nope"), pybind11::arg("k_pe"),
        pybind11::arg("v"), pybind11::arg("out"), pybind11::arg("lse"), pybind11::arg("cu_seqlens_q"),
        pybind11::arg("cu_seqlens_k"), pybind11::arg("max_seqlen_q"), pybind11::arg("max_seqlen_k"),
        pybind11::arg("softmax_scale"), pybind11::arg("causal"), pybind11::arg("bottom_right"),
        pybind11::arg("options"));
  m.def("seq_order", &seq_order,
        "tests only: the order (int32 (B,), longest first) in which the varlen schedules take the sequences",
        pybind11::arg("cu_seqlens_q"), pybind11::arg("cu_seqlens_k"), pybind11::arg("rows_q"),
        pybind11::arg("rows_k"), pybind11::arg("max_seqlen_q"), pybind11::arg("max_seqlen_k"));
}
