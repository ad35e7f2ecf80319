// Shared pieces of the SM90 fused attention backward (family fmha_bwd_sm90): per-sequence geometry,
// the dQ accumulator's storage layout, the 16-bit element types. Included by the other
// fmha_bwd_sm90_*.cuh headers; fmha_bwd_sm90_kernel.cuh describes the whole.
#pragma once

// wgmma N = 48 (BN/2 at d=192) is one of CuTe's "extended" shapes; without this the selector falls
// back to three N = 16 instructions. Only the fmha_bwd_sm90 TUs include this header.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cassert>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <climits>
#include <cstdint>

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include "fmha_bwd_sm90_config.h"
#include "fmha_bwd_sm90_params.h"
#include "sm90/sm90_attn_common.cuh"

namespace fmha_bwd_sm90 {

using namespace cute;

// ------------------------------------------------------------------------------------------------
// A sequence's lengths and first rows (the forward's SeqInfo) and its first row of the fp32 scratch.
struct Seq : mla_sm90::SeqInfo {
  int64_t scratch_start;  // a multiple of BM: round_down(row0 + b * BM, BM), row0 = offset_q (varlen) or b * seqlen_q
};

template <int BM>
__device__ __forceinline__ Seq get_seq(const FmhaBwdSm90Params& p, int b) {
  const mla_sm90::SeqInfo si(p, b);
  const int64_t row0 = p.cu_seqlens_q != nullptr ? si.offset_q : int64_t(b) * p.seqlen_q;
  return Seq{si, (row0 + int64_t(b) * BM) / BM * BM};
}

// The M-block m and sequence b of a preprocess / postprocess CTA (query head blockIdx.y): grid
// (ceil(max_seqlen_q / BM), Hq, B), or with p.q_slots grid (q_slots, Hq, 1) over the M-blocks that hold queries,
// numbered sequence after sequence; false past the last of those. Warp-collective there, as cta_coords.
template <int BM>
__device__ __forceinline__ bool row_block_coords(const FmhaBwdSm90Params& p, int& m, int& b) {
  if (p.q_slots > 0) {
    mla_sm90::VarlenNumbering<BM, false> numbering;
    const mla_sm90::VarlenNumber v = numbering.find(p, blockIdx.x, 1);
    m = v.r;
    b = v.b;
    return v.b >= 0;
  }
  m = blockIdx.x;
  b = blockIdx.z;
  return true;
}

// Position of column c inside the permuted dq_accum row: within each group of 16 columns the
// wgmma accumulator of one thread holds columns {2t, 2t+1, 2t+8, 2t+9}; they are stored at 4t..4t+3.
__host__ __device__ __forceinline__ int dq_perm_pos(int c) {
  int w = c & 15;
  return (c & ~15) + 4 * ((w & 7) >> 1) + 2 * (w >> 3) + (w & 1);
}
// Storage position of (row r of the M-block, column c): odd rows also swap neighbouring groups of 16
// columns, because the 8 threads of one 16-byte store phase cover two rows whose 64-byte runs would
// otherwise hit the same smem banks (rows are a multiple of 128 B apart). Needs D % 32 == 0.
__host__ __device__ __forceinline__ int dq_store_pos(int r, int c) { return dq_perm_pos(c) ^ ((r & 1) << 4); }

// Store addresses built from base registers (store_dq_block, the swapped dS^T stores; see there), kept as
// functions so that tests/sm90/fmha_bwd_sm90_addr_check.cu checks these very expressions against CuTe's
// partition on the host (P: float* in the kernel, an int offset from 0 in the check).
template <int D, class P>
__host__ __device__ __forceinline__ P dq_base_even(P sdq, int r0, int c0) { return sdq + r0 * D + dq_store_pos(r0, c0); }
template <int D, class P>
__host__ __device__ __forceinline__ P dq_base_odd(P sdq, int r0, int c0) { return sdq + r0 * D + dq_store_pos(r0, c0 + 16) - 16; }
template <int D, class P>
__host__ __device__ __forceinline__ P dq_chunk_addr(P even, P odd, int dr, int dc) { return ((dc >> 4) & 1 ? odd : even) + dr * D + dc; }
// The inverse, as the postprocess reads it: 16-byte vector c4 of a stored row r holds columns col, col + 1,
// col + 8 and col + 9 of that row, col = dq_vec_col(r, c4).
__host__ __device__ __forceinline__ int dq_vec_col(int r, int c4) { return (((c4 >> 2) ^ (r & 1)) << 4) + 2 * (c4 & 3); }
// Pair q (0..15) of a thread's dS^T stores from the address of its pair 0 (SW128 keys-major buffer).
__host__ __device__ __forceinline__ uint32_t ds_pair_addr(uint32_t base, int q) {
  return (base ^ uint32_t((q >> 1) << 4)) + uint32_t((q & 1) * 1024);
}

// ------------------------------------------------------------------------------------------------
template <class T> struct CuteType;
template <> struct CuteType<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct CuteType<__half> { using type = cutlass::half_t; };

}  // namespace fmha_bwd_sm90
