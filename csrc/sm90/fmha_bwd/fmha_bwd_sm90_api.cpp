// Host api of the SM90 fused attention backward (family fmha_bwd_sm90):
//   bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
//       softmax_scale, causal, bottom_right, deterministic) -> None      what mla_autograd/_ops.py calls
//   bwd_with_options(..., deterministic, options: dict) -> None            the same with launch options
//       (tests and benchmarks only; see parse_options)
//   bwd_mla(dout, q_nope, q_pe, k_nope, k_pe, v, out, lse, dq, dk_nope, dk_pe, dv, ...) -> None   bwd's arguments
//       with MLA's split q / k read in place and dk written in two parts (the MLA-native 192/128 backward);
//       bwd_mla_with_options likewise
// Validates every argument (errors name it), allocates the fp32 workspace (O(Tq * Hq * D)), and
// launches preprocess -> main -> postprocess on the current stream.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "common/checks.h"
#include "common/cuda_check.h"
#include "common/device_info.h"
#include "common/options.h"
#include "fmha_bwd_sm90_config.h"
#include "fmha_bwd_sm90_params.h"

namespace {

void check_tensor(const at::Tensor& t, const char* name, const at::Tensor& like, int64_t ndim) {
  MLA_CHECK(t.is_cuda(), "fmha_bwd_sm90: ", name, " must be a CUDA tensor");
  MLA_CHECK(t.device() == like.device(), "fmha_bwd_sm90: ", name, " must be on the device of q");
  MLA_CHECK(t.scalar_type() == like.scalar_type(), "fmha_bwd_sm90: ", name, " must have the dtype of q (",
              like.scalar_type(), "), got ", t.scalar_type());
  MLA_CHECK(t.dim() == ndim, "fmha_bwd_sm90: ", name, " must have ", ndim, " dims, got ", t.dim());
  MLA_CHECK(t.stride(-1) == 1, "fmha_bwd_sm90: ", name, " must have a unit last-dim stride");
  for (int64_t i = 0; i < ndim - 1; ++i) {
    MLA_CHECK(t.stride(i) % 8 == 0 || t.size(i) <= 1, "fmha_bwd_sm90: ", name,
                " strides must be multiples of 8 elements (dim ", i, " has stride ", t.stride(i), ")");
  }
  MLA_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "fmha_bwd_sm90: ", name,
              " must be 16-byte aligned");
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  MLA_CHECK(t.sizes() == shape, "fmha_bwd_sm90: ", name, " must have shape ", shape, ", got ", t.sizes());
}

// bwd_with_options' `options` -> FmhaBwdSm90Options; {} gives bwd's defaults. Keys:
//   "l2_group": int >= 0, (kv head, batch) pairs per launch group of the main kernel (0: every pair interleaved);
//   "poison_workspace": bool, fill the fp32 workspace with NaN (semaphores -1) before the kernels run;
//   "compact_varlen": bool, varlen grids over the blocks that hold rows (default) or over max_seqlen x batch;
//   "longest_first": bool, the compact grids take a packed batch's sequences longest first (default) or in
//   cu_seqlens order;
//   "dq_wg_barriers": bool, each consumer warpgroup hands its dQ half to the reducer through its own barriers
//   (default) or both through one shared pair;
//   "zero_whole_grads": bool, packed batches: clear all of dq, dk, dv first instead of the uncovered rows.
FmhaBwdSm90Options parse_options(const py::dict& options) {
  FmhaBwdSm90Options o;
  constexpr const char* fn = "fmha_bwd_sm90";
  for (auto item : options) {
    const std::string key = mla::option_key(item.first, fn);
    if (key == "l2_group") {
      o.pair_group = mla::option_count(item.second, fn, key);
    } else if (key == "poison_workspace") {
      o.poison_workspace = mla::option_bool(item.second, fn, key);
    } else if (key == "compact_varlen") {
      o.compact_varlen = mla::option_bool(item.second, fn, key);
    } else if (key == "longest_first") {
      o.longest_first = mla::option_bool(item.second, fn, key);
    } else if (key == "dq_wg_barriers") {
      o.dq_wg_barriers = mla::option_bool(item.second, fn, key);
    } else if (key == "zero_whole_grads") {
      o.zero_whole_grads = mla::option_bool(item.second, fn, key);
    } else {
      MLA_CHECK(false, "fmha_bwd_sm90: unknown option '", key,
                "' (known: l2_group, poison_workspace, compact_varlen, longest_first, dq_wg_barriers, zero_whole_grads)");
    }
  }
  return o;
}

// The rope parts of an MLA-native call: q, k and dk of bwd_impl are then q_nope, k_nope and dk_nope.
struct RopeInputs {
  const at::Tensor& q_pe;
  const at::Tensor& k_pe;
  const at::Tensor& dk_pe;
};

// Checks q_pe / k_pe / dk_pe against q_nope (q) and k_nope (k), whose shapes bwd_impl has checked, and fills `rp`
// with their pointers and strides.
void set_rope_parts(const RopeInputs& r, const at::Tensor& q, const at::Tensor& k, bool varlen,
                    FmhaBwdSm90RopeParts& rp) {
  const at::Tensor& qp = r.q_pe;
  const at::Tensor& kp = r.k_pe;
  const at::Tensor& dkp = r.dk_pe;
  const int64_t nd = q.dim();
  MLA_CHECK(kp.dim() == nd, "fmha_bwd_sm90: k_pe must have ", nd, " dims, got ", kp.sizes());
  const int64_t hkv = k.size(-2), heads = kp.size(-2);
  MLA_CHECK(heads == 1 || heads == hkv, "fmha_bwd_sm90: k_pe must have 1 head or as many as k_nope (", hkv,
            "), got ", heads);
  check_tensor(qp, "q_pe", q, nd);
  check_tensor(dkp, "dk_pe", q, nd);
  // a one-head k_pe's head stride is never used (check_tensor's rules skip size-1 dims)
  check_tensor(kp, "k_pe", q, nd);
  std::vector<int64_t> qp_shape(q.sizes().begin(), q.sizes().end()), kp_shape(k.sizes().begin(), k.sizes().end());
  qp_shape.back() = 64;
  kp_shape.back() = 64;
  check_shape(qp, "q_pe", qp_shape);
  check_shape(dkp, "dk_pe", kp_shape);
  kp_shape[nd - 2] = heads;
  check_shape(kp, "k_pe", kp_shape);
  rp.q_pe = qp.data_ptr();
  rp.k_pe = kp.data_ptr();
  rp.dk_pe = dkp.data_ptr();
  rp.k_pe_heads = int(heads);
  const int64_t r0 = varlen ? 0 : 1;  // the row dimension
  rp.q_pe_row_stride = qp.stride(r0);
  rp.q_pe_head_stride = qp.stride(r0 + 1);
  rp.k_pe_row_stride = kp.stride(r0);
  rp.k_pe_head_stride = heads == 1 ? 8 : kp.stride(r0 + 1);
  rp.dk_pe_row_stride = dkp.stride(r0);
  rp.dk_pe_head_stride = dkp.stride(r0 + 1);
  rp.q_pe_batch_stride = varlen ? 0 : qp.stride(0);
  rp.k_pe_batch_stride = varlen ? 0 : kp.stride(0);
  rp.dk_pe_batch_stride = varlen ? 0 : dkp.stride(0);
}

void bwd_impl(at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out, at::Tensor lse,
              at::Tensor dq, at::Tensor dk, at::Tensor dv, std::optional<at::Tensor> cu_seqlens_q,
              std::optional<at::Tensor> cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
              std::optional<int64_t> max_seqlen_k, double softmax_scale, bool causal, bool bottom_right,
              bool deterministic, const FmhaBwdSm90Options& opt, const RopeInputs* rope = nullptr) {
  MLA_CHECK(q.is_cuda(), "fmha_bwd_sm90: q must be a CUDA tensor");
  MLA_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "fmha_bwd_sm90: q must be bfloat16 or float16, got ", q.scalar_type());
  const bool varlen = cu_seqlens_q.has_value();
  MLA_CHECK(cu_seqlens_k.has_value() == varlen,
              "fmha_bwd_sm90: cu_seqlens_q and cu_seqlens_k must be given together");
  const int64_t nd = varlen ? 3 : 4;
  check_tensor(q, "q", q, nd);
  check_tensor(k, "k", q, nd);
  check_tensor(v, "v", q, nd);
  check_tensor(out, "out", q, nd);
  check_tensor(dout, "dout", q, nd);
  check_tensor(dq, "dq", q, nd);
  check_tensor(dk, "dk", q, nd);
  check_tensor(dv, "dv", q, nd);
  MLA_CHECK(dq.is_contiguous(), "fmha_bwd_sm90: dq must be contiguous");
  // dk_nope of an MLA-native call may be strided like dv (below)
  MLA_CHECK(rope != nullptr || dk.is_contiguous(), "fmha_bwd_sm90: dk must be contiguous");
  // dv may be a strided view (check_tensor's rules; the kernels store through its strides): mla_attention's
  // backward writes it straight into the value half of the buffer that holds [dk_nope | dv] per head, the
  // gradient of the projection that k_nope and v are views of.
  MLA_CHECK(lse.is_cuda() && lse.device() == q.device(), "fmha_bwd_sm90: lse must be on the device of q");
  MLA_CHECK(lse.scalar_type() == at::kFloat, "fmha_bwd_sm90: lse must be float32, got ", lse.scalar_type());
  MLA_CHECK(lse.dim() == nd - 1, "fmha_bwd_sm90: lse must have ", nd - 1, " dims");
  MLA_CHECK(lse.stride(-1) == 1, "fmha_bwd_sm90: lse must have a unit last-dim stride");

  // d: the head dim of q . k (q_nope + q_pe in an MLA-native call)
  const int64_t d = q.size(-1) + (rope != nullptr ? rope->q_pe.size(-1) : 0), dvd = v.size(-1);
  const int64_t hq = q.size(-2), hkv = k.size(-2);
  if (rope != nullptr) {
    MLA_CHECK(q.size(-1) == 128 && rope->q_pe.size(-1) == 64 && dvd == 128,
              "fmha_bwd_sm90: the MLA-native backward takes (Dn, Dr, Dv) = (128, 64, 128) (q_nope, q_pe, v head "
              "dims), got (", q.size(-1), ", ", rope->q_pe.size(-1), ", ", dvd, ")");
  }
  MLA_CHECK((d == 192 && dvd == 128) || (d == 128 && dvd == 128) || (d == 64 && dvd == 64),
              "fmha_bwd_sm90: unsupported head dims (q/k ", d, ", v ", dvd,
              "); supported: (192,128), (128,128), (64,64)");
  MLA_CHECK(k.size(-1) == q.size(-1), "fmha_bwd_sm90: k head dim must equal q head dim");
  MLA_CHECK(hkv >= 1 && hq % hkv == 0, "fmha_bwd_sm90: num heads of q (", hq,
              ") must be a multiple of num heads of k (", hkv, ")");
  MLA_CHECK(v.size(-2) == hkv, "fmha_bwd_sm90: v must have the heads of k");
  mla::check_softmax_scale(softmax_scale, "fmha_bwd_sm90");

  int64_t batch, sq, sk, tq, tk, msq, msk;
  if (varlen) {
    const at::Tensor& cq = *cu_seqlens_q;
    const at::Tensor& ck = *cu_seqlens_k;
    MLA_CHECK(cq.is_cuda() && cq.device() == q.device(), "fmha_bwd_sm90: cu_seqlens_q must be on the device of q");
    MLA_CHECK(ck.is_cuda() && ck.device() == q.device(), "fmha_bwd_sm90: cu_seqlens_k must be on the device of q");
    MLA_CHECK(cq.scalar_type() == at::kInt, "fmha_bwd_sm90: cu_seqlens_q must be int32");
    MLA_CHECK(ck.scalar_type() == at::kInt, "fmha_bwd_sm90: cu_seqlens_k must be int32");
    MLA_CHECK(cq.dim() == 1 && cq.is_contiguous(), "fmha_bwd_sm90: cu_seqlens_q must be 1-D contiguous");
    MLA_CHECK(ck.dim() == 1 && ck.is_contiguous(), "fmha_bwd_sm90: cu_seqlens_k must be 1-D contiguous");
    MLA_CHECK(cq.numel() == ck.numel() && cq.numel() >= 2,
                "fmha_bwd_sm90: cu_seqlens_q and cu_seqlens_k must both have B+1 >= 2 entries");
    MLA_CHECK(max_seqlen_q.has_value() && max_seqlen_k.has_value(),
                "fmha_bwd_sm90: max_seqlen_q and max_seqlen_k are required with cu_seqlens");
    batch = cq.numel() - 1;
    tq = q.size(0);
    tk = k.size(0);
    sq = sk = 0;
    msq = *max_seqlen_q;
    msk = *max_seqlen_k;
    MLA_CHECK(msq >= 0 && msk >= 0, "fmha_bwd_sm90: max_seqlen_q/max_seqlen_k must be >= 0");
    // As in fmha_fwd_sm90: a bound above the packed rows cuts nothing, capped there it stays an int.
    msq = std::min(msq, tq);
    msk = std::min(msk, tk);
    check_shape(k, "k", {tk, hkv, q.size(-1)});
    check_shape(v, "v", {tk, hkv, dvd});
    check_shape(out, "out", {tq, hq, dvd});
    check_shape(dout, "dout", {tq, hq, dvd});
    check_shape(lse, "lse", {hq, tq});
  } else {
    batch = q.size(0);
    sq = q.size(1);
    sk = k.size(1);
    tq = batch * sq;
    tk = batch * sk;
    msq = max_seqlen_q.value_or(sq);
    msk = max_seqlen_k.value_or(sk);
    MLA_CHECK(msq == sq && msk == sk, "fmha_bwd_sm90: max_seqlen_q/max_seqlen_k must match the dense lengths");
    check_shape(k, "k", {batch, sk, hkv, q.size(-1)});
    check_shape(v, "v", {batch, sk, hkv, dvd});
    check_shape(out, "out", {batch, sq, hq, dvd});
    check_shape(dout, "dout", {batch, sq, hq, dvd});
    check_shape(lse, "lse", {batch, hq, sq});
  }
  if (rope != nullptr) {
    std::vector<int64_t> dq_shape(q.sizes().begin(), q.sizes().end());
    dq_shape.back() = d;  // dq stays whole: (..., Hq, Dn + Dr)
    check_shape(dq, "dq", dq_shape);
  } else {
    check_shape(dq, "dq", q.sizes());
  }
  check_shape(dk, "dk", k.sizes());
  FmhaBwdSm90RopeParts rp{};
  if (rope != nullptr) set_rope_parts(*rope, q, k, varlen, rp);
  check_shape(dv, "dv", v.sizes());
  MLA_CHECK(tq < (int64_t(1) << 31) && tk < (int64_t(1) << 31), "fmha_bwd_sm90: too many rows");

  c10::cuda::CUDAGuard guard(q.device());
  const mla::DeviceInfo& dev = mla::device_info(q.get_device());
  MLA_CHECK(dev.major == 9 && dev.minor == 0, "fmha_bwd_sm90: needs an SM90 (compute capability 9.0) GPU, got ",
              dev.major, ".", dev.minor);

  auto zero_grads = [&] {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    if (rope != nullptr) rope->dk_pe.zero_();
  };
  // Nothing to attend: zero gradients (no launch needed).
  if (q.size(0) == 0 || k.size(0) == 0 || (!varlen && (sq == 0 || sk == 0)) || hq == 0) {
    zero_grads();
    return;
  }

  constexpr int BM = kFmhaBwdSm90BlockM;
  const int64_t scratch_rows = (tq + batch * BM + BM - 1) / BM * BM;
  auto fopt = q.options().dtype(at::kFloat);
  at::Tensor lse_log2 = at::empty({hq, scratch_rows}, fopt);
  at::Tensor dpsum = at::empty({hq, scratch_rows}, fopt);
  at::Tensor dq_accum = at::empty({hq, scratch_rows, d}, fopt);
  at::Tensor dq_sem = at::empty({deterministic ? hq * (scratch_rows / BM) : 1}, q.options().dtype(at::kInt));
  // The order in which the compact varlen grids take the sequences (longest first, FmhaProblemParams::seq_order),
  // written by the launcher before the kernels. Deterministic mode keeps the main kernel's grid over max_seqlen x
  // batch, where the order does not apply.
  const bool ordered = varlen && opt.compact_varlen && opt.longest_first && !deterministic &&
                       batch <= kSeqOrderMaxBatch;
  at::Tensor seq_order = at::empty({ordered ? batch : 0}, q.options().dtype(at::kInt));
  // The kernels must not depend on what the workspace held before: the preprocess writes every row of lse_log2
  // and dpsum the main kernel reads, and clears every dq_accum block and semaphore, and the order kernel writes
  // every entry of seq_order. The tests check that with options['poison_workspace'], which fills all of it with
  // 0xff bytes (NaN, -1) first.
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();  // q's device (guard above)
  if (opt.poison_workspace) {
    for (const at::Tensor* t : {&lse_log2, &dpsum, &dq_accum, &dq_sem, &seq_order}) {
      if (t->numel() == 0) continue;
      MLA_CUDA_CHECK(cudaMemsetAsync(t->data_ptr(), 0xff, t->nbytes(), stream),
                     "fmha_bwd_sm90: poisoning the workspace");
    }
  }
  if (varlen && opt.zero_whole_grads) {
    zero_grads();
  } else if (varlen) {
    // The rows that no sequence covers get gradient 0; the kernels write only the covered ones.
    FmhaBwdSm90ZeroRows z{};
    z.batch = int(batch);
    auto add = [&](const at::Tensor& t, const at::Tensor& cu, int64_t max_seqlen) {
      z.t[z.count++] = FmhaBwdSm90GradRows{t.data_ptr(), t.stride(0), t.stride(1), int(t.size(0)), int(t.size(1)),
                                           int(t.size(2)), cu.data_ptr<int>(), int(max_seqlen)};
    };
    add(dq, *cu_seqlens_q, msq);
    add(dk, *cu_seqlens_k, msk);
    add(dv, *cu_seqlens_k, msk);
    if (rope != nullptr) add(rope->dk_pe, *cu_seqlens_k, msk);
    MLA_CUDA_CHECK(fmha_bwd_sm90_zero_uncovered_rows(z, stream), "fmha_bwd_sm90: zeroing the uncovered rows");
  }

  FmhaBwdSm90Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.lse_log2 = lse_log2.data_ptr<float>();
  p.dpsum = dpsum.data_ptr<float>();
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dq_sem = dq_sem.data_ptr<int>();
  p.seq_order = ordered ? seq_order.data_ptr<int>() : nullptr;
  p.scratch_rows = scratch_rows;
  p.cu_seqlens_q = varlen ? cu_seqlens_q->data_ptr<int>() : nullptr;
  p.cu_seqlens_k = varlen ? cu_seqlens_k->data_ptr<int>() : nullptr;
  auto set3 = [&](const at::Tensor& t, int64_t& bs, int64_t& rs, int64_t& hs) {
    if (varlen) {
      bs = 0;
      rs = t.stride(0);
      hs = t.stride(1);
    } else {
      bs = t.stride(0);
      rs = t.stride(1);
      hs = t.stride(2);
    }
  };
  set3(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  set3(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  set3(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  set3(out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  set3(dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  set3(dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  set3(dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  set3(dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  if (varlen) {
    p.lse_batch_stride = 0;
    p.lse_head_stride = lse.stride(0);
  } else {
    p.lse_batch_stride = lse.stride(0);
    p.lse_head_stride = lse.stride(1);
  }
  p.batch = int(batch);
  p.hq = int(hq);
  p.hkv = int(hkv);
  p.head_dim_qk = int(d);
  p.head_dim_v = int(dvd);
  p.seqlen_q = int(msq);  // dense: the lengths (msq == sq); varlen: the bound
  p.seqlen_k = int(msk);
  p.rows_q = int(varlen ? tq : sq);
  p.rows_k = int(varlen ? tk : sk);
  p.softmax_scale = float(softmax_scale);
  p.scale_log2 = float(softmax_scale * M_LOG2E);
  p.causal = causal;
  p.bottom_right = bottom_right;
  p.deterministic = deterministic;
  p.is_bf16 = q.scalar_type() == at::kBFloat16;

  if (rope != nullptr) {
    MLA_CUDA_CHECK(fmha_bwd_sm90_run_mla_192_128(p, rp, opt, dev.l2_bytes, stream),
                   "fmha_bwd_sm90: launching the MLA-native kernels");
    return;
  }
  auto* const run =
      d == 192 ? fmha_bwd_sm90_run_192_128 : d == 128 ? fmha_bwd_sm90_run_128_128 : fmha_bwd_sm90_run_64_64;
  MLA_CUDA_CHECK(run(p, opt, dev.l2_bytes, stream), "fmha_bwd_sm90: launching the kernels (head dims ", d, ", ", dvd,
                 ")");
}

}  // namespace

void bwd(at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out, at::Tensor lse,
         at::Tensor dq, at::Tensor dk, at::Tensor dv, std::optional<at::Tensor> cu_seqlens_q,
         std::optional<at::Tensor> cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
         std::optional<int64_t> max_seqlen_k, double softmax_scale, bool causal, bool bottom_right,
         bool deterministic) {
  bwd_impl(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
           softmax_scale, causal, bottom_right, deterministic, FmhaBwdSm90Options{});
}

void bwd_with_options(at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out, at::Tensor lse,
                      at::Tensor dq, at::Tensor dk, at::Tensor dv, std::optional<at::Tensor> cu_seqlens_q,
                      std::optional<at::Tensor> cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
                      std::optional<int64_t> max_seqlen_k, double softmax_scale, bool causal, bool bottom_right,
                      bool deterministic, const py::dict& options) {
  const FmhaBwdSm90Options opt = parse_options(options);
  bwd_impl(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
           softmax_scale, causal, bottom_right, deterministic, opt);
}

void bwd_mla(at::Tensor dout, at::Tensor q_nope, at::Tensor q_pe, at::Tensor k_nope, at::Tensor k_pe, at::Tensor v,
             at::Tensor out, at::Tensor lse, at::Tensor dq, at::Tensor dk_nope, at::Tensor dk_pe, at::Tensor dv,
             std::optional<at::Tensor> cu_seqlens_q, std::optional<at::Tensor> cu_seqlens_k,
             std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k, double softmax_scale,
             bool causal, bool bottom_right, bool deterministic) {
  const RopeInputs rope{q_pe, k_pe, dk_pe};
  bwd_impl(dout, q_nope, k_nope, v, out, lse, dq, dk_nope, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
           max_seqlen_k, softmax_scale, causal, bottom_right, deterministic, FmhaBwdSm90Options{}, &rope);
}

void bwd_mla_with_options(at::Tensor dout, at::Tensor q_nope, at::Tensor q_pe, at::Tensor k_nope, at::Tensor k_pe,
                          at::Tensor v, at::Tensor out, at::Tensor lse, at::Tensor dq, at::Tensor dk_nope,
                          at::Tensor dk_pe, at::Tensor dv, std::optional<at::Tensor> cu_seqlens_q,
                          std::optional<at::Tensor> cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
                          std::optional<int64_t> max_seqlen_k, double softmax_scale, bool causal, bool bottom_right,
                          bool deterministic, const py::dict& options) {
  const FmhaBwdSm90Options opt = parse_options(options);
  const RopeInputs rope{q_pe, k_pe, dk_pe};
  bwd_impl(dout, q_nope, k_nope, v, out, lse, dq, dk_nope, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
           max_seqlen_k, softmax_scale, causal, bottom_right, deterministic, opt, &rope);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mla_autograd SM90 fused attention backward (wgmma, TMA, warp-specialized)";
  m.def("bwd", &bwd, "fused attention backward (SM90)", py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("softmax_scale"),
        py::arg("causal"), py::arg("bottom_right"), py::arg("deterministic"));
  m.def("bwd_with_options", &bwd_with_options,
        "bwd with launch options, for tests and benchmarks: options = {'l2_group': N} forces N (kv head, batch) "
        "pairs per launch group (0: all interleaved), {'poison_workspace': True} fills the fp32 workspace with NaN "
        "first, {'compact_varlen': False} / {'longest_first': False} the packed grids over max_seqlen x batch / in "
        "cu_seqlens order, {'dq_wg_barriers': False} one dQ barrier pair for both consumer warpgroups, "
        "{'zero_whole_grads': True} packed batches clear all of dq, dk, dv first; {} is bwd",
        py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dq"),
        py::arg("dk"), py::arg("dv"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("softmax_scale"), py::arg("causal"), py::arg("bottom_right"),
        py::arg("deterministic"), py::arg("options"));
  m.def("bwd_mla", &bwd_mla,
        "the MLA-native 192/128 backward: q_nope/q_pe and k_nope/k_pe read in place (k_pe of 1 or Hkv heads); dq "
        "(..., Hq, 192) whole, dk in two parts: dk_nope (k_nope's shape, any TMA-legal strides) and dk_pe (..., Hkv, 64), "
        "per kv head (the caller sums a shared k_pe's over the heads)",
        py::arg("dout"), py::arg("q_nope"), py::arg("q_pe"), py::arg("k_nope"), py::arg("k_pe"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk_nope"), py::arg("dk_pe"), py::arg("dv"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
        py::arg("softmax_scale"), py::arg("causal"), py::arg("bottom_right"), py::arg("deterministic"));
  m.def("bwd_mla_with_options", &bwd_mla_with_options, "bwd_mla with bwd_with_options' launch options",
        py::arg("dout"), py::arg("q_nope"), py::arg("q_pe"), py::arg("k_nope"), py::arg("k_pe"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk_nope"), py::arg("dk_pe"), py::arg("dv"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
        py::arg("softmax_scale"), py::arg("causal"), py::arg("bottom_right"), py::arg("deterministic"),
        py::arg("options"));
}
