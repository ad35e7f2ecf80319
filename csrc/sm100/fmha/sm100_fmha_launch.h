// Plain C++ interface between the host api (.cpp, compiled by the host compiler, no CUTLASS) and the
// SM100 kernel instantiations (.cu, compiled for sm_100a only). Shared by fmha_fwd_sm100 and
// fmha_bwd_sm100. Everything here is host-side data; nothing in this header launches work. Every
// launcher declared here returns its cudaError_t, which the host api checks (common/cuda_check.h).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace mla_sm100 {

enum class Mask : int { kNone = 0, kCausalTopLeft = 1, kCausalBottomRight = 2 };
enum class DType : int { kBF16 = 0, kFP16 = 1 };
// Head-dim configuration: (d_qk, d_vo) = (192, 128) ("MLA") or (128, 128).
enum class HeadDims : int { kMla192x128 = 0, kMha128x128 = 1 };

inline const char* mask_name(Mask m) {
  switch (m) {
    case Mask::kNone: return "residual";
    case Mask::kCausalTopLeft: return "causal_top_left";
    default: return "causal_bottom_right";
  }
}
inline const char* dtype_name(DType d) { return d == DType::kBF16 ? "bf16" : "fp16"; }
inline const char* head_dims_name(HeadDims h) { return h == HeadDims::kMla192x128 ? "192x128" : "128x128"; }

// The one of four per-(dtype, head dims) entry points (the translation units below) that serves dt, hd.
template <class Fn>
Fn pick_variant(DType dt, HeadDims hd, Fn bf16_mla, Fn bf16_mha, Fn fp16_mla, Fn fp16_mha) {
  const bool mla = hd == HeadDims::kMla192x128;
  return dt == DType::kBF16 ? (mla ? bf16_mla : bf16_mha) : (mla ? fp16_mla : fp16_mha);
}

// ---------------------------------------------------------------------------------------------
// Forward: one launch of the CUTLASS example-77 forward kernel.
// Strides are in elements and already validated to fit in int32 by the host planner.
// Always the variable-length problem shape (dense = cu_seqlens arange * S): batch strides are 0
// for q/k/v/o and rows are offset by cu[b]; lse rows are offset by cu[b] too, plus b * lse_batch_stride.
struct FwdLaunch {
  DType dtype;
  HeadDims head_dims;
  Mask mask;
  int max_seqlen_q, max_seqlen_k;  // >= every sequence length (max_seqlen_q sets the grid)
  int total_q, total_k;  // rows of q / k (TMA extents)
  int batch;        // batches in the launch (after the cu_seqlens rewrite)
  int h_r, h_k;     // query heads = h_r * h_k; query head h uses kv head h / h_r
  const int* cu_q;  // device, batch + 1 entries
  const int* cu_k;
  const void* q; int q_row_stride, q_head_stride, q_batch_stride;  // q[b][s][h][d] (h = h_r + h_r_count * h_k)
  const void* k; int k_row_stride, k_head_stride, k_batch_stride;  // per kv head
  const void* v; int v_row_stride, v_head_stride, v_batch_stride;
  void* o;       int o_row_stride, o_head_stride, o_batch_stride;
  float* lse;    int lse_head_stride, lse_batch_stride;             // lse row (sequence) stride is 1
  float softmax_scale;
  int sm_count;
  // example 77's CausalIndividualTileScheduler (causal masks, query heads a multiple of 8); else the
  // IndividualTileScheduler (see sm100_fmha_fwd_impl.cuh)
  bool causal_scheduler;
};

// Shared memory (bytes) the kernel of a variant needs; 0 if the variant is not compiled in.
int fwd_smem_bytes(DType dt, HeadDims hd, Mask m);
cudaError_t fwd_launch(FwdLaunch const& p, cudaStream_t stream);

// per-translation-unit entry points (one per (dtype, head dims)), dispatching on mask
#define MLA_SM100_FWD_DECL(NAME)                                   \
  cudaError_t NAME(FwdLaunch const& p, cudaStream_t stream);       \
  int NAME##_smem(Mask m);
MLA_SM100_FWD_DECL(fwd_bf16_mla)
MLA_SM100_FWD_DECL(fwd_bf16_mha)
MLA_SM100_FWD_DECL(fwd_fp16_mla)
MLA_SM100_FWD_DECL(fwd_fp16_mha)
#undef MLA_SM100_FWD_DECL

// ---------------------------------------------------------------------------------------------
// Backward: main kernel of example 77 (128x128 kernel or the MLA kernel), always with the
// variable-length problem shape (dense calls pass cu = arange * S). Our own pre/post kernels.
struct BwdLaunch {
  DType dtype;
  HeadDims head_dims;
  Mask mask;
  int max_seqlen_q, max_seqlen_k, total_q, total_k;
  int batch;
  int h_r, h_k;               // MLA kernel: h_r must be 1 (the api expands GQA)
  const int* cu_q; const int* cu_k;
  const void* q;  int q_row_stride, q_head_stride;
  const void* k;  int k_row_stride, k_head_stride;
  const void* v;  int v_row_stride, v_head_stride;
  const void* dout; int do_row_stride, do_head_stride;
  void* dk; int dk_row_stride, dk_head_stride;
  void* dv; int dv_row_stride, dv_head_stride;
  // workspace (ours): [b][h][qp] scaled lse, [b][h][qp] -sum(O*dO), [b][h][qp][dp] fp32 dQ
  const float* scaled_lse; const float* neg_sum_odo; float* dq_acc;
  int qp, dp;                 // padded max_seqlen_q (round 8) and padded d_qk (round 8)
  float softmax_scale;
};
int bwd_smem_bytes(DType dt, HeadDims hd, Mask m);
cudaError_t bwd_launch(BwdLaunch const& p, cudaStream_t stream);

#define MLA_SM100_BWD_DECL(NAME)                                   \
  cudaError_t NAME(BwdLaunch const& p, cudaStream_t stream);       \
  int NAME##_smem(Mask m);
MLA_SM100_BWD_DECL(bwd_bf16_mla)
MLA_SM100_BWD_DECL(bwd_bf16_mha)
MLA_SM100_BWD_DECL(bwd_fp16_mla)
MLA_SM100_BWD_DECL(bwd_fp16_mha)
#undef MLA_SM100_BWD_DECL

// Our preprocess: for every (b, h, q < len_q(b)):
//   neg_sum_odo[b][h][q] = -sum_d float(O) * float(dO)     (fp32 products and sum)
//   scaled_lse[b][h][q]  = lse == -inf ? -inf : -log2(e) * lse
// with rows q in [len_q(b), qp) zeroed. Offsets in int64.
struct BwdPrep {
  DType dtype;
  int batch, hq, d_vo, qp;
  const int* cu_q;                    // absolute row offsets of the batch (device)
  const void* o;  int64_t o_row_stride, o_head_stride;
  const void* dout; int64_t do_row_stride, do_head_stride;
  // lse element of (b, h, q): lse[(lse_rows_from_cu ? cu[b] + q : q) + b * lse_batch_stride + h * lse_head_stride]
  const float* lse; int64_t lse_head_stride, lse_batch_stride; bool lse_rows_from_cu;
  float* scaled_lse; float* neg_sum_odo;
};
cudaError_t bwd_prep_launch(BwdPrep const& p, cudaStream_t stream);

// dQ[cu[b] + q][h][d] = scale * dq_acc[b][h][q][d] for q < len_q(b), d < d_qk.
struct BwdConvert {
  DType dtype;
  int batch, hq, d_qk, qp, dp, max_seqlen_q;
  const int* cu_q;
  const float* dq_acc;
  void* dq; int64_t dq_row_stride, dq_head_stride;
  float scale;
};
cudaError_t bwd_convert_launch(BwdConvert const& p, cudaStream_t stream);

}  // namespace mla_sm100
