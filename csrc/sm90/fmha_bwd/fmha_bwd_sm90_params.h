// Parameters of the SM90 fused attention backward (family fmha_bwd_sm90). Plain struct shared by
// the host api (g++) and the kernels (nvcc). All strides are in elements; every tensor has a unit
// last-dim stride. Dense: row index = position in the sequence, batch stride used. Varlen: batch
// stride 0 and sequence b starts at row cu_seqlens[b].
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/fmha_params.h"

// q, k, v and the problem (common/fmha_params.h), then what the backward reads besides, writes and uses as
// scratch, and how it is launched.
struct FmhaBwdSm90Params : FmhaProblemParams {
  // inputs: the forward's out and lse, and dout (shaped like out)
  const void* o;
  const void* dout;
  const float* lse;
  // outputs, shaped like q, k, v
  void* dq;
  void* dk;
  void* dv;
  // fp32 scratch, per query head `scratch_rows` rows; sequence b starts at scratch row
  // round_down(row0_b + b*BM, BM), row0_b = cu_seqlens_q[b] (varlen) or b*seqlen_q (dense).
  float* lse_log2;   // (Hq, scratch_rows)
  float* dpsum;      // (Hq, scratch_rows)
  float* dq_accum;   // (Hq, scratch_rows, D), columns permuted within groups of 16 (see kernel)
  int* dq_sem;       // (Hq, scratch_rows / BM) deterministic-mode semaphores (or nullptr)
  int64_t scratch_rows;

  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t lse_batch_stride, lse_head_stride;   // lse row stride is 1

  float scale_log2;                // softmax_scale * log2(e)
  bool deterministic;
  // Main kernel launch order (set by the launcher): grouped_tile (sm90_attn_common.cuh) over
  // (kv head, batch) pairs x K/V blocks, this many pairs per group, K/V block 0 (the longest under a
  // causal mask) first. 1 = one pair after another; hkv * batch = every pair interleaved.
  int pair_group;
  // Compact varlen grids (set by the launcher; 0: the grids over max_seqlen x batch, most of whose CTAs find
  // their block past their sequence's end where lengths differ). kv_slots > 0: the main kernel's grid is
  // (kv_slots, Hkv, 1), the K/V blocks that hold keys numbered sequence after sequence (VarlenNumbering over
  // cu_seqlens_k) in grouped_tile's order with the kv heads as its pairs. q_slots > 0: the preprocess and
  // postprocess grids are (q_slots, Hq, 1) over the M-blocks that hold queries. Each is (rows + batch *
  // (block - 1)) / block, the most blocks that sequences which do not overlap can hold.
  int kv_slots, q_slots;
  // dK/dV leave through smem and a TMA store for K/V blocks that lie entirely inside their sequence
  // (set by the launcher when dk/dv allow TMA: 16-byte aligned base and strides); the other blocks,
  // and every block when false, store from registers.
  bool dkv_tma;
  // The consumer warpgroups hand their halves of each M-block's dQ to the reducer warp through a barrier pair
  // each (true, set by the launcher from FmhaBwdSm90Options::dq_wg_barriers), or through one pair shared by both
  // (false): a warpgroup then waits at its dQ store for the other to reach the same store.
  bool dq_wg_barriers;
};

// The rope parts of the MLA-native backward (fmha_bwd_sm90_run_mla_192_128), which reads MLA's split query and key
// where they are and writes the key's gradient in two parts: FmhaBwdSm90Params then describes q_nope (B, Sq, Hq, 128)
// / (Tq, Hq, 128) as q, k_nope (B, Sk, Hkv, 128) / (Tk, Hkv, 128) as k and dk_nope (k_nope's shape, any strides that
// keep TMA's rules, e.g. the key half of a [dk_nope | dv] buffer) as dk, with head_dim_qk = 192 (dq stays whole,
// (..., Hq, 192)); this struct the rope parts: q_pe (B, Sq, Hq, 64) / (Tq, Hq, 64), k_pe (B, Sk, 1 or Hkv, 64) /
// (Tk, 1 or Hkv, 64), and dk_pe (B, Sk, Hkv, 64) / (Tk, Hkv, 64), the rope key's gradient per kv head (summed over the
// heads by the caller when k_pe has one). Strides in elements, pointers and strides 16-byte aligned (batch strides
// unused in varlen; the head stride of a one-head k_pe too).
struct FmhaBwdSm90RopeParts {
  const void* q_pe;
  const void* k_pe;
  void* dk_pe;
  int64_t q_pe_row_stride, q_pe_head_stride, q_pe_batch_stride;
  int64_t k_pe_row_stride, k_pe_head_stride, k_pe_batch_stride;
  int64_t dk_pe_row_stride, dk_pe_head_stride, dk_pe_batch_stride;
  int k_pe_heads;  // 1: one rope key shared by every kv head; else hkv
};

// Host-side launch options: what the test-only entry bwd_with_options can set (tests, benchmarks); bwd uses
// the defaults. Never part of the kernels' parameters.
struct FmhaBwdSm90Options {
  // (kv head, batch) pairs per launch group of the main kernel: negative = the launcher's choice
  // (pair_group in fmha_bwd_sm90_scheduler.cuh), 0 = every pair interleaved, N > 0 = N (at most all pairs).
  int pair_group = -1;
  // Fill the fp32 workspace with 0xff bytes (NaN; -1 in the semaphores) before the kernels run, so that
  // a row or block they fail to write or clear shows up (host api only).
  bool poison_workspace = false;
  // Varlen: the compact grids (FmhaBwdSm90Params::kv_slots, q_slots) where they have fewer CTAs; false: the
  // grids over max_seqlen x batch (for A/B runs and tests).
  bool compact_varlen = true;
  // Packed batches of at most kSeqOrderMaxBatch sequences on the compact grids, not deterministic: the grids take
  // the sequences longest first (FmhaProblemParams::seq_order); false: in cu_seqlens order.
  bool longest_first = true;
  // FmhaBwdSm90Params::dq_wg_barriers (false: one barrier pair shared by both consumer warpgroups).
  bool dq_wg_barriers = true;
  // Packed batches: clear the whole of dq, dk and dv before the kernels (host api only) instead of zeroing the
  // rows that no sequence covers (fmha_bwd_sm90_zero_uncovered_rows); the same results, for A/B runs.
  bool zero_whole_grads = false;
};

// A 16-bit gradient of a packed batch for fmha_bwd_sm90_zero_uncovered_rows: (rows, heads, cols) elements at ptr
// with these strides (in elements; unit column stride), its sequences placed by cu_seqlens (batch + 1 int32 on the
// device) and cut at max_seqlen, as the kernels' FmhaProblemParams place them (rows_q / rows_k, seqlen_q / seqlen_k).
struct FmhaBwdSm90GradRows {
  void* ptr;
  int64_t row_stride, head_stride;
  int rows, heads, cols;
  const int* cu_seqlens;
  int max_seqlen;
};
constexpr int kFmhaBwdSm90ZeroRowsMaxTensors = 4;  // dq, dk, dv and an MLA-native call's dk_pe
struct FmhaBwdSm90ZeroRows {
  FmhaBwdSm90GradRows t[kFmhaBwdSm90ZeroRowsMaxTensors];
  int count;  // tensors in t
  int batch;  // sequences
};

// Packed batches: writes 0 to every row of the `count` tensors that no sequence covers (what the other kernels
// leave unwritten), on `stream`, without reading cu_seqlens on the host; defined in fmha_bwd_sm90_zero_rows.cu.
cudaError_t fmha_bwd_sm90_zero_uncovered_rows(const FmhaBwdSm90ZeroRows& z, cudaStream_t stream);

// Host launchers, one per (head_dim, head_dim_v); defined in fmha_bwd_sm90_hdim*.cu. Each launches the three
// kernels on `stream` and returns the first launch error (common/cuda_check.h); l2_bytes is the device's L2
// size (mla::device_info), which sizes the main kernel's launch groups.
cudaError_t fmha_bwd_sm90_run_192_128(const FmhaBwdSm90Params& p, const FmhaBwdSm90Options& opt, int l2_bytes,
                                      cudaStream_t stream);
cudaError_t fmha_bwd_sm90_run_128_128(const FmhaBwdSm90Params& p, const FmhaBwdSm90Options& opt, int l2_bytes,
                                      cudaStream_t stream);
// q_nope / q_pe and k_nope / k_pe read in place, dk written as dk_nope and dk_pe: the results of
// fmha_bwd_sm90_run_192_128 on the concatenated q = [q_nope | q_pe], k = [k_nope | k_pe] (k_pe broadcast over the
// kv heads when it has one), bit for bit, dk = [dk_nope | dk_pe].
cudaError_t fmha_bwd_sm90_run_mla_192_128(const FmhaBwdSm90Params& p, const FmhaBwdSm90RopeParts& rope,
                                          const FmhaBwdSm90Options& opt, int l2_bytes, cudaStream_t stream);
cudaError_t fmha_bwd_sm90_run_64_64(const FmhaBwdSm90Params& p, const FmhaBwdSm90Options& opt, int l2_bytes,
                                    cudaStream_t stream);
