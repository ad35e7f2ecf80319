// Host/device parameter block of the SM90 forward attention kernel (plain C++: the g++-compiled
// API layer fills it, the nvcc-compiled launchers read it). Strides are in elements.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

struct FmhaFwdSm90Params {
  // Pointers (16-byte aligned).
  void const* q;
  void const* k;
  void const* v;
  void* o;
  float* lse;

  // q (B, Sq, Hq, Dqk) dense or (Tq, Hq, Dqk) varlen: row / head / batch strides (batch unused in varlen).
  int64_t q_row_stride, q_head_stride, q_batch_stride;
  int64_t k_row_stride, k_head_stride, k_batch_stride;
  int64_t v_row_stride, v_head_stride, v_batch_stride;
  int64_t o_row_stride, o_head_stride, o_batch_stride;
  // lse (B, Hq, Sq) dense or (Hq, Tq) varlen; the row stride is 1.
  int64_t lse_head_stride, lse_batch_stride;

  int batch;             // number of sequences
  int hq, hkv;           // query heads, key/value heads (hq % hkv == 0)
  int dqk, dv;           // head dims
  int seqlen_q, seqlen_k;  // dense: lengths; varlen: max lengths
  int rows_q, rows_k;    // rows of the q/k tensors along the sequence dim (dense: Sq/Sk; varlen: Tq/Tk)
  int const* cu_seqlens_q;  // nullptr when dense
  int const* cu_seqlens_k;

  // Launch order (set by the launcher): heads are taken in groups of this many (head, batch) pairs whose
  // K/V fit in L2 together; see grouped_tile in sm90_attn_common.cuh.
  int l2_head_group;
  int num_m_blocks;  // M-blocks per (head, batch) pair: ceil(seqlen_q / kBlockM); tiles = batch * hq * this
  // One int32, zero at launch (the host layer clears it on the stream): the dynamic tile scheduler's
  // counter of tiles taken beyond the first gridDim.x; nullptr (set by the launcher) for static assignment.
  int* tile_counter;

  float softmax_scale;
  bool causal;
  bool bottom_right;
  bool is_bf16;
};

// Host-side launch options: what the test-only entry fwd_with_options can set (tests, benchmarks); fwd uses
// the defaults. Never part of the kernel's parameters.
struct FmhaFwdSm90Options {
  // (head, batch) pairs per L2 launch group: negative = the launcher's choice (l2_head_group in
  // fmha_fwd_sm90_kernel.cuh), 0 = every pair interleaved, N > 0 = N (at most all pairs).
  int l2_head_group = -1;
  // CTAs of the persistent grid: 0 = the launcher's choice (one per SM for dense unmasked inputs, one per
  // tile for varlen or causal ones), N > 0 = N (at most one per tile; tests run many tiles per CTA with it).
  int ctas = 0;
  // Tile assignment: -1 = the launcher's choice (static; a persistent grid for dense unmasked problems,
  // one CTA per tile otherwise), 0 = static with a persistent grid for dense causal problems too,
  // 1 = dynamic on a persistent grid (one CTA per SM unless ctas says otherwise).
  int scheduler = -1;
};

// Launchers, one per head-dim pair (each in its own translation unit).
cudaError_t fmha_fwd_sm90_launch_192_128(FmhaFwdSm90Params const& p, FmhaFwdSm90Options const& opt,
                                         cudaStream_t stream);
cudaError_t fmha_fwd_sm90_launch_128_128(FmhaFwdSm90Params const& p, FmhaFwdSm90Options const& opt,
                                         cudaStream_t stream);
cudaError_t fmha_fwd_sm90_launch_64_64(FmhaFwdSm90Params const& p, FmhaFwdSm90Options const& opt,
                                       cudaStream_t stream);
