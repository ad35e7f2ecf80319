// Host/device parameter block of the SM90 forward attention kernel (plain C++: the g++-compiled
// API layer fills it, the nvcc-compiled launchers read it). Strides are in elements.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "common/device_info.h"
#include "common/fmha_params.h"

// q, k, v and the problem (common/fmha_params.h), then what the forward writes and how it is launched.
struct FmhaFwdSm90Params : FmhaProblemParams {
  // out (B, Sq, Hq, head_dim_v) dense or (rows_q, Hq, head_dim_v) varlen, dtype of q; row / head / batch
  // strides (batch 0 varlen). 16-byte aligned.
  void* o;
  int64_t o_row_stride, o_head_stride, o_batch_stride;
  // lse fp32 (B, Hq, Sq) dense or (Hq, rows_q) varlen; the row stride is 1.
  float* lse;
  int64_t lse_head_stride, lse_batch_stride;

  // Launch order (set by the launcher): heads are taken in groups of this many (head, batch) pairs whose
  // K/V fit in L2 together; see grouped_tile in sm90_attn_common.cuh.
  int l2_head_group;
  int num_m_blocks;  // M-blocks per (head, batch) pair: ceil(seqlen_q / kBlockM); dense tiles = batch * hq * this
                     // (varlen: the longest sequence's, a bound)
  // One int32, zero at launch (cleared on the stream by the host layer, or with the sequence order by the
  // launcher, where fmha_fwd_sm90_dynamic_tiles): the dynamic tile scheduler's count of tiles taken beyond the
  // first gridDim.x; nullptr otherwise.
  int* tile_counter;
  // Set by the launcher from FmhaFwdSm90Options::staged_epilogue: true, O leaves through the consumer warps'
  // staging rows in smem; false, by 4-byte stores from the accumulator layout.
  bool staged_epilogue;
};

// The rope parts of the MLA-native forward (fmha_fwd_sm90_launch_mla_192_128), which reads MLA's split query and
// key where they are instead of a concatenated q / k: FmhaFwdSm90Params then describes q_nope (B, Sq, Hq, 128) /
// (Tq, Hq, 128) as q and k_nope (B, Sk, Hkv, 128) / (Tk, Hkv, 128) as k, with head_dim_qk = 192, and this the rope parts
// q_pe (B, Sq, Hq, 64) / (Tq, Hq, 64) and k_pe (B, Sk, 1 or Hkv, 64) / (Tk, 1 or Hkv, 64). Strides in elements,
// pointers and strides 16-byte aligned (batch strides unused in varlen; the head stride of a one-head k_pe too).
struct FmhaFwdSm90RopeParts {
  void const* q_pe;
  void const* k_pe;
  int64_t q_pe_row_stride, q_pe_head_stride, q_pe_batch_stride;
  int64_t k_pe_row_stride, k_pe_head_stride, k_pe_batch_stride;
  int k_pe_heads;  // 1: one rope key shared by every kv head; else hkv
};

// Host-side launch options: what the test-only entry fwd_with_options can set (tests, benchmarks); fwd uses
// the defaults. Never part of the kernel's parameters.
struct FmhaFwdSm90Options {
  // (head, batch) pairs per L2 launch group: negative = the launcher's choice (l2_head_group in
  // fmha_fwd_sm90_kernel.cuh), 0 = every pair interleaved, N > 0 = N (at most all pairs).
  int l2_head_group = -1;
  // CTAs of the persistent grid: 0 = one per SM, N > 0 = N (at most one per tile: a grid of at least the
  // tile count with static assignment runs one tile per CTA; tests run many tiles per CTA with small N).
  int ctas = 0;
  // Tile assignment: -1 = the launcher's choice (fmha_fwd_sm90_dynamic_tiles), 0 = static, 1 = dynamic.
  int scheduler = -1;
  // Key-block width without a causal mask: true = the config's kBlockNNoMask (wider where it differs),
  // false = kBlockN, the causal tile's.
  bool wide_keys = true;
  // Packed batches of at most kSeqOrderMaxBatch sequences: tiles numbered longest sequence first
  // (FmhaProblemParams::seq_order); false: in cu_seqlens order. The outputs are the same bits either way.
  bool longest_first = true;
  // O through the consumer warps' staging rows in smem (true), or by 4-byte stores straight from the accumulator
  // layout (false, the epilogue the staged one was measured against). The same bits either way.
  bool staged_epilogue = true;
};

// Whether a launch assigns tiles dynamically, from p.tile_counter: where the options say so, else where
// tiles differ in cost (a causal mask, varlen). Read by the host layer (which then zeroes the counter) and
// by the launcher.
inline bool fmha_fwd_sm90_dynamic_tiles(FmhaFwdSm90Params const& p, FmhaFwdSm90Options const& opt) {
  if (opt.scheduler >= 0) return opt.scheduler == 1;
  return p.causal || p.cu_seqlens_q != nullptr;
}

// Launchers, one per head-dim pair (each in its own translation unit): launch the kernel on `stream` and
// return the first CUDA error (common/cuda_check.h). dev: the device's attributes (mla::device_info), which
// size the grid (sm_count) and the L2 launch groups (l2_bytes).
cudaError_t fmha_fwd_sm90_launch_192_128(FmhaFwdSm90Params const& p, FmhaFwdSm90Options const& opt,
                                         mla::DeviceInfo const& dev, cudaStream_t stream);
cudaError_t fmha_fwd_sm90_launch_128_128(FmhaFwdSm90Params const& p, FmhaFwdSm90Options const& opt,
                                         mla::DeviceInfo const& dev, cudaStream_t stream);
// q_nope / q_pe and k_nope / k_pe read in place: the results of fmha_fwd_sm90_launch_192_128 on the concatenated
// q = [q_nope | q_pe], k = [k_nope | k_pe] (k_pe broadcast over the kv heads when it has one), bit for bit.
cudaError_t fmha_fwd_sm90_launch_mla_192_128(FmhaFwdSm90Params const& p, FmhaFwdSm90RopeParts const& rope,
                                             FmhaFwdSm90Options const& opt, mla::DeviceInfo const& dev,
                                             cudaStream_t stream);
cudaError_t fmha_fwd_sm90_launch_64_64(FmhaFwdSm90Params const& p, FmhaFwdSm90Options const& opt,
                                       mla::DeviceInfo const& dev, cudaStream_t stream);

// Writes p.seq_order, the order in which the varlen schedules take p's sequences (longest first; p.batch <=
// kSeqOrderMaxBatch, p.cu_seqlens_q / _k set) on `stream`; the host layer's test-only entry seq_order.
cudaError_t fmha_fwd_sm90_seq_order(FmhaProblemParams const& p, cudaStream_t stream);
