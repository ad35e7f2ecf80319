// SM90 fused attention backward (family fmha_bwd_sm90): preprocess, main wgmma kernel, dQ
// postprocess, and the host launcher template. Included by fmha_bwd_sm90_hdim*.cu only.
//
// Main kernel (one CTA = one K/V block of one kv head of one sequence, 384 threads):
//   WG0: producer; one thread loads K/V once (TMA) and streams Q/dO tiles (and, swapped, the M-block's
//        lse/dpsum) through a kStages mbarrier pipeline for every (query head of the GQA group,
//        M-block) the block must visit.
//   WG1/WG2: consumers (setmaxnreg 240), two schedules (fmha_bwd_sm90_config.h):
//        unswapped (d = 192): every wgmma reads both operands from smem and the two WGs split the N
//          dimension of each GEMM; P^T and dS^T go through smem.
//        swapped (kSwapSdP, d <= 128): S^T/dP^T with the WGs splitting the keys; dV and dK are RS
//          wgmma on the P^T/dS^T registers; only dS^T goes through smem (for dQ).
// dQ: the consumers write each M-block's fp32 dQ to smem; warp 1 of the producer WG adds the block to
// dq_accum in global memory with one bulk reduce (cp.reduce.async.bulk .add.f32), off the consumers'
// critical path (per-thread float4 atomics there cost about a quarter of the kernel's time). The
// block keeps one layout in smem and gmem (see dq_store_pos); the postprocess undoes it.
// Deterministic mode orders the reduces of one M-block by a semaphore (K/V block order), so the
// float sums happen in a fixed order.
// dK/dV: summed over the GQA group in registers (the CTA loops over the group's query heads), so
// no fp32 dK/dV workspace and no cross-CTA reduction; written once at the end, staged in the K/V tiles'
// smem and stored by TMA (store_dkv_tma) where the block lies inside its sequence.
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
#include "sm90_attn_common.cuh"

namespace fmha_bwd_sm90 {

using namespace cute;

#define FMHA_BWD_CUDA_CHECK(expr)                                                              \
  do {                                                                                         \
    cudaError_t err__ = (expr);                                                                \
    if (err__ != cudaSuccess) {                                                                \
      throw std::runtime_error(std::string("fmha_bwd_sm90: CUDA error: ") +                    \
                               cudaGetErrorString(err__) + " at " __FILE__ ":" +               \
                               std::to_string(__LINE__));                                      \
    }                                                                                          \
  } while (0)

// ------------------------------------------------------------------------------------------------
// Per-sequence geometry shared by all kernels.
struct Seq {
  int len_q, len_k;
  int64_t start_q, start_k;  // first row of the sequence in the q/k tensors (0 for dense)
  int64_t scratch_start;     // first scratch row of the sequence (multiple of BM)
};

template <int BM>
__device__ __forceinline__ Seq get_seq(const FmhaBwdSm90Params& p, int b) {
  Seq s;
  int64_t row0;
  if (p.cu_seqlens_q != nullptr) {
    int q0 = p.cu_seqlens_q[b], q1 = p.cu_seqlens_q[b + 1];
    int k0 = p.cu_seqlens_k[b], k1 = p.cu_seqlens_k[b + 1];
    s.len_q = q1 - q0;
    s.len_k = k1 - k0;
    s.start_q = q0;
    s.start_k = k0;
    row0 = q0;
  } else {
    s.len_q = p.seqlen_q;
    s.len_k = p.seqlen_k;
    s.start_q = 0;
    s.start_k = 0;
    row0 = int64_t(b) * p.seqlen_q;
  }
  s.scratch_start = (row0 + int64_t(b) * BM) / BM * BM;
  return s;
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

// Preprocess: dpsum = rowsum(dO * O) (fp32), lse_log2 = lse * log2(e) (+inf for rows with no key
// and padding rows, so P = 0 there), clear the dQ accumulator block and its semaphore.
// Grid (ceil(max_seqlen_q / BM), Hq, B), 256 threads (4 per row).
template <class Element, int D, int DV, int BM>
__global__ void __launch_bounds__(256) fmha_bwd_sm90_preprocess(const FmhaBwdSm90Params p) {
  static_assert(BM * 4 == 256, "4 threads per row");
  static_assert(DV % 32 == 0, "dv multiple of 32");
  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const Seq s = get_seq<BM>(p, b);
  if (m * BM >= s.len_q) return;
  const int tid = threadIdx.x;
  const int r = tid >> 2, part = tid & 3;
  const int i = m * BM + r;
  float acc = 0.f;
  if (i < s.len_q) {
    const Element* o = static_cast<const Element*>(p.o) + b * p.o_batch_stride +
                       (s.start_q + i) * p.o_row_stride + h * p.o_head_stride;
    const Element* d = static_cast<const Element*>(p.dout) + b * p.do_batch_stride +
                       (s.start_q + i) * p.do_row_stride + h * p.do_head_stride;
#pragma unroll
    for (int c = part * 8; c < DV; c += 32) {
      uint4 ov = *reinterpret_cast<const uint4*>(o + c);
      uint4 dv = *reinterpret_cast<const uint4*>(d + c);
      const Element* oe = reinterpret_cast<const Element*>(&ov);
      const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += float(oe[e]) * float(de[e]);
    }
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  const int64_t srow = int64_t(h) * p.scratch_rows + s.scratch_start + int64_t(m) * BM + r;
  if (part == 0) {
    float l2 = INFINITY;
    if (i < s.len_q) {
      float l = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + s.start_q + i];
      l2 = (l == -INFINITY) ? INFINITY : l * float(M_LOG2E);
      if (l2 != l2) l2 = INFINITY;  // NaN lse: treat as "no key"
    }
    p.lse_log2[srow] = l2;
    p.dpsum[srow] = (i < s.len_q) ? acc : 0.f;
  }
  // clear the fp32 dQ accumulator rows of this block
  float4* acc4 = reinterpret_cast<float4*>(p.dq_accum +
                                           (int64_t(h) * p.scratch_rows + s.scratch_start + int64_t(m) * BM) * D);
  for (int idx = tid; idx < BM * D / 4; idx += 256) acc4[idx] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (p.deterministic && tid == 0) {
    p.dq_sem[int64_t(h) * (p.scratch_rows / BM) + s.scratch_start / BM + m] = 0;
  }
}

// ------------------------------------------------------------------------------------------------
// Postprocess: dq = softmax_scale * dq_accum (undo the column permutation), cast, store.
// Grid (ceil(max_seqlen_q / BM), Hq, B), 256 threads. Consecutive lanes read consecutive 16-byte vectors
// of the block (one warp instruction = 512 contiguous bytes), all of a thread's loads before its stores.
// Each vector holds two column pairs (dq_vec_col): two 4-byte stores of the converted pairs.
template <class Element, int D, int BM>
__global__ void __launch_bounds__(256) fmha_bwd_sm90_postprocess(const FmhaBwdSm90Params p) {
  static_assert(D % 32 == 0, "head dim multiple of 32 (pairs of 16-column groups)");
  constexpr int kRowVecs = D / 4;
  constexpr int kVecs = BM * kRowVecs / 256;  // per thread
  static_assert(BM * kRowVecs % 256 == 0, "whole vectors per thread");
  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const Seq s = get_seq<BM>(p, b);
  if (m * BM >= s.len_q) return;
  const float4* src = reinterpret_cast<const float4*>(
      p.dq_accum + (int64_t(h) * p.scratch_rows + s.scratch_start + int64_t(m) * BM) * D);
  float4 x[kVecs];
  CUTE_UNROLL
  for (int k = 0; k < kVecs; ++k) {
    const int f = threadIdx.x + 256 * k;
    x[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m * BM + f / kRowVecs < s.len_q) x[k] = __ldcs(src + f);
  }
  using CuteElement = typename CuteType<Element>::type;  // same bits, with cutlass's converters
  using Pair = cutlass::Array<CuteElement, 2>;
  cutlass::NumericArrayConverter<CuteElement, float, 2, cutlass::FloatRoundStyle::round_to_nearest> conv;
  CUTE_UNROLL
  for (int k = 0; k < kVecs; ++k) {
    const int f = threadIdx.x + 256 * k;
    const int r = f / kRowVecs, c4 = f % kRowVecs, i = m * BM + r;
    if (i >= s.len_q) continue;
    const int col = dq_vec_col(r, c4);
    Element* dst = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + (s.start_q + i) * p.dq_row_stride +
                   h * p.dq_head_stride + col;
    cutlass::Array<float, 2> lo, hi;
    lo[0] = x[k].x * p.softmax_scale; lo[1] = x[k].y * p.softmax_scale;
    hi[0] = x[k].z * p.softmax_scale; hi[1] = x[k].w * p.softmax_scale;
    *reinterpret_cast<Pair*>(dst) = conv(lo);
    *reinterpret_cast<Pair*>(dst + 8) = conv(hi);
  }
}

// ------------------------------------------------------------------------------------------------
// Main kernel traits.
template <class Element_, int D_, int DV_>
struct Traits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  using Cfg = FmhaBwdSm90Config<D_, DV_>;
  static constexpr int D = D_, DV = DV_;
  static constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, Stages = Cfg::kStages;
  static constexpr bool Swap = Cfg::kSwapSdP;
  static constexpr int kThreads = 384;
  static_assert(!Swap || BN == 128, "swapped: the two consumer WGs own 64 keys each");
  static_assert(BM == 64, "one 64-row wgmma atom per M-block");
  static_assert(D % 64 == 0 && DV % 64 == 0, "head dims multiple of 64");
  static_assert((BN / 2) % 8 == 0 && (D / 2) % 16 == 0, "per-WG N tiles");

  using BMt = Int<BM>; using BNt = Int<BN>; using Dt = Int<D>; using DVt = Int<DV>;

  // smem layouts. Q, dO, V: K-major SW128. K: K-major with a swizzle whose width divides D/2 (the
  // dQ GEMM reads K as an MN-major operand split at D/2 between the WGs). P^T, dS^T: (BN, BM)
  // K-major SW128 (keys x queries), read K-major by dV/dK and MN-major (as P, dS) by dQ.
  using AtomSW128 = decltype(GMMA::Layout_K_SW128_Atom<Element>{});
  using AtomK = std::conditional_t<(D / 2) % 64 == 0, decltype(GMMA::Layout_K_SW128_Atom<Element>{}),
                                   decltype(GMMA::Layout_K_SW64_Atom<Element>{})>;
  using SmemLayoutQ = decltype(tile_to_shape(AtomSW128{}, make_shape(BMt{}, Dt{}, Int<Stages>{})));
  using SmemLayoutdO = decltype(tile_to_shape(AtomSW128{}, make_shape(BMt{}, DVt{}, Int<Stages>{})));
  using SmemLayoutK = decltype(tile_to_shape(AtomK{}, make_shape(BNt{}, Dt{})));
  using SmemLayoutV = decltype(tile_to_shape(AtomSW128{}, make_shape(BNt{}, DVt{})));
  using SmemLayoutPt = decltype(tile_to_shape(AtomSW128{}, make_shape(BNt{}, BMt{})));
  // transposed views
  using SmemLayoutQt = decltype(composition(SmemLayoutQ{}, make_layout(make_shape(Dt{}, BMt{}, Int<Stages>{}),
                                                                       make_stride(BMt{}, _1{}, Int<BM * D>{}))));
  using SmemLayoutdOt = decltype(composition(SmemLayoutdO{}, make_layout(make_shape(DVt{}, BMt{}, Int<Stages>{}),
                                                                         make_stride(BMt{}, _1{}, Int<BM * DV>{}))));
  using SmemLayoutKt = decltype(composition(SmemLayoutK{}, make_layout(make_shape(Dt{}, BNt{}),
                                                                       make_stride(BNt{}, _1{}))));
  using SmemLayoutP = decltype(composition(SmemLayoutPt{}, make_layout(make_shape(BMt{}, BNt{}),
                                                                       make_stride(BNt{}, _1{}))));
  using SmemLayoutVt = decltype(composition(SmemLayoutV{}, make_layout(make_shape(DVt{}, BNt{}),
                                                                       make_stride(BNt{}, _1{}))));

  // Transposing stmatrix for P^T / dS^T and the dK^T / dV^T epilogue: four 8x8 blocks (16 columns of a
  // WG's N tile) per instruction where N / 2 allows, else two.
  using StsmT = std::conditional_t<(BN / 2) % 16 == 0, SM90_U16x8_STSM_T, SM90_U16x4_STSM_T>;
  using AtomLayout = Layout<Shape<_1, _2, _1>>;  // two consumer WGs along N
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<BN / 2>, _16>, GMMA::Major::K, GMMA::Major::K>(),
      AtomLayout{}));
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<BN / 2>, _16>, GMMA::Major::MN, GMMA::Major::K>(),
      AtomLayout{}));
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<D / 2>, _16>, GMMA::Major::MN, GMMA::Major::MN>(),
      AtomLayout{}));
  // Swapped schedule: the WGs split M = BN (keys). S^T = K Q^T, dP^T = V dO^T (SS);
  // dV = P^T dO, dK = dS^T Q (RS: P^T/dS^T from registers, dO/Q read MN-major as dO^T/Q^T).
  using AtomLayoutKeys = Layout<Shape<_2, _1, _1>>;
  using TiledMmaSdPt = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, BMt, _16>, GMMA::Major::K, GMMA::Major::K>(),
      AtomLayoutKeys{}));
  using TiledMmadVs = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, DVt, _16>, GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayoutKeys{}));
  using TiledMmadKs = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Dt, _16>, GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayoutKeys{}));

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> dout;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    array_aligned<Element, cosize_v<SmemLayoutPt>, 1024> pt;   // swapped: the second dS^T buffer
    array_aligned<Element, cosize_v<SmemLayoutPt>, 1024> dst;
    array_aligned<float, BM * D, 128> dq;  // fp32 dQ of one M-block, dq_store_pos layout
    // swapped only: lse_log2 / dpsum of each stage's M-block (the unswapped schedule reads them from
    // global memory; one element keeps the smem budget at BN = 112)
    array_aligned<float, Swap ? Stages * BM : 1, 128> lse;
    array_aligned<float, Swap ? Stages * BM : 1, 128> dps;
    alignas(8) uint64_t full_bar[Stages];
    alignas(8) uint64_t empty_bar[Stages];
    alignas(8) uint64_t kv_bar;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget");

  static constexpr uint32_t kBytesQ = BM * D * sizeof(Element);
  static constexpr uint32_t kBytesdO = BM * DV * sizeof(Element);
  static constexpr uint32_t kBytesRowStats = Swap ? 2 * BM * sizeof(float) : 0;  // lse + dpsum per stage
  static constexpr uint32_t kBytesK = BN * D * sizeof(Element);
  static constexpr uint32_t kBytesV = BN * DV * sizeof(Element);

  // gmem view of q/k/v/dout for TMA: (rows, dim, head, batch)
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemLayout = Layout<GmemShape, GmemStride>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                      take<0, 2>(SmemLayoutQ{}), Shape<BMt, Dt>{}, _1{}));
  using TmadO = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                       take<0, 2>(SmemLayoutdO{}), Shape<BMt, DVt>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                      SmemLayoutK{}, Shape<BNt, Dt>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                      SmemLayoutV{}, Shape<BNt, DVt>{}, _1{}));
  // dK / dV stores (store_dkv_tma): the K / V tiles' smem layouts, reused as staging
  using TmadK = decltype(make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                       SmemLayoutK{}, Shape<BNt, Dt>{}, _1{}));
  using TmadV = decltype(make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                       SmemLayoutV{}, Shape<BNt, DVt>{}, _1{}));
};

template <class Tr>
struct MainArgs {
  FmhaBwdSm90Params p;
  typename Tr::TmaQ tma_q;
  typename Tr::TmadO tma_do;
  typename Tr::TmaK tma_k;
  typename Tr::TmaV tma_v;
  typename Tr::TmadK tma_dk;  // valid when p.dkv_tma
  typename Tr::TmadV tma_dv;
  typename Tr::GmemShape shape_q, shape_do, shape_k, shape_v;
};

// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// Named barriers (CUTLASS adds its reserved count). DqEmpty/DqFull: 256 consumers + the reducer warp.
enum BarrierId : int { kBarPwg0 = 1, kBarPwg1 = 2, kBardSFree = 3, kBarDsReady = 4, kBarDqEmpty = 5, kBarDqFull = 6 };
constexpr int kDqBarThreads = 256 + 32;

__device__ __forceinline__ void st_shared_u32_addr(uint32_t smem_addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(smem_addr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_shared_v4(const float* smem_ptr, float4 v) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(cute::cast_smem_ptr_to_uint(smem_ptr)), "f"(v.x),
               "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, const float* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :
               : "l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// ------------------------------------------------------------------------------------------------
// What one CTA of the main kernel does (uniform over the CTA).
struct CtaWork {
  Seq sq;
  int n_block, hkv, b;
  int m_min, n_m;    // M-blocks [m_min, m_min + n_m) of every query head of the group
  int group, off;    // query heads per kv head; causal diagonal offset (Sk - Sq bottom-right, else 0)
  int total_iters;   // group * n_m

  // The first M-block whose steps need no mask; the steps of [m_min, first) need it. All steps of a
  // K/V block that crosses seq_k do; under a causal mask the M-blocks holding a query that some key
  // of the block must not see (key - off > query). Rows past seq_q need none (lse_log2 = +inf).
  template <int BM, int BN>
  __device__ __forceinline__ int first_unmasked_m(bool causal) const {
    const int end = m_min + n_m;
    if ((n_block + 1) * BN > sq.len_k) return end;
    if (!causal) return m_min;
    const int x = (n_block + 1) * BN - 1 - off;  // query q needs no mask iff q >= x
    const int m = x <= 0 ? 0 : (x + BM - 1) / BM;
    return m < m_min ? m_min : (m > end ? end : m);
  }
};

// The (K/V block, kv head, batch) of this CTA in the launch order of p.pair_group. In deterministic
// mode block n waits for block n-1's dQ adds of the same pair: every grouping dispatches n-1 first.
__device__ __forceinline__ void cta_coords(const FmhaBwdSm90Params& p, int& n_block, int& hkv, int& b) {
  const int lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const mla_sm90::GroupedTile t = mla_sm90::grouped_tile(lin, gridDim.y * gridDim.z, gridDim.x, p.pair_group);
  n_block = t.rank;
  hkv = t.pair % gridDim.y;
  b = t.pair / gridDim.y;
}

// The CtaWork of this CTA. Called by each warpgroup role after its setmaxnreg, so that the values
// are computed where they are used instead of living across the warpgroup split (held there, they
// spilled under the producer's 24 registers).
template <int BM, int BN>
__device__ __forceinline__ CtaWork make_cta_work(const FmhaBwdSm90Params& p, int n_block, int hkv, int b) {
  CtaWork w;
  w.sq = get_seq<BM>(p, b);
  w.n_block = n_block; w.hkv = hkv; w.b = b;
  w.off = p.bottom_right ? w.sq.len_k - w.sq.len_q : 0;
  const int m_max = (w.sq.len_q + BM - 1) / BM;
  w.m_min = 0;
  if (p.causal) {
    int x = n_block * BN - w.off;
    w.m_min = x <= 0 ? 0 : x / BM;
  }
  w.n_m = m_max > w.m_min ? m_max - w.m_min : 0;
  w.group = p.hq / p.hkv;
  w.total_iters = w.group * w.n_m;
  return w;
}

// The smem operand tensors: Q, dO (stages), K, V, and the transposed views Q^T, dO^T, K^T.
template <class Tr>
__device__ __forceinline__ auto smem_operands(typename Tr::SharedStorage& ss) {
  return cute::make_tuple(make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{}),
                          make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutdO{}),
                          make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{}),
                          make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{}),
                          make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQt{}),
                          make_tensor(make_smem_ptr(ss.dout.data()), typename Tr::SmemLayoutdOt{}),
                          make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKt{}));
}

// The fp32 dQ of one M-block (this thread's part of the dQ accumulator, D/2 columns per WG) into the
// smem block the reducer warp adds to dq_accum: waits until the previous block has been read, stores
// 16 bytes at a time in the dq_store_pos layout, fences for the bulk copy's async proxy, signals.
template <int D, class TAcc, class TCoord>
__device__ __forceinline__ void store_dq_block(const TAcc& tdQrdQ, const TCoord& tdQcdQ, float* sdq) {
  static_assert(decltype(rank<0>(tdQrdQ))::value == 3, "GMMA accumulator layout");
  constexpr int kChunks = decltype(size<0, 2>(tdQrdQ))::value;
  static_assert(kChunks % 2 == 0 && D % 32 == 0, "pairs of 8-column chunks; dq_store_pos swizzle");
  // Every store address comes from two per-thread bases plus a compile-time offset (otherwise the
  // kChunks addresses are loop-invariant values the consumers keep, or spill, across their loop).
  // Chunk (h, j) of this thread sits at row r0 + dr, column c0 + dc, where dr (0 or 8) is even and
  // dc = 8j (j even) is a multiple of 16; so dq_perm_pos(c0 + dc) = dq_perm_pos(c0) + dc, the row
  // parity (the swizzle bit) is r0's, and toggling bit 4 commutes with adding a multiple of 32:
  //   dq_store_pos(r0 + dr, c0 + dc) = dq_store_pos(r0, c0) + dc                if dc / 16 is even,
  //                                  = dq_store_pos(r0, c0 + 16) - 16 + dc      if dc / 16 is odd.
  // (Checked for every thread and head dim by tests/sm90/fmha_bwd_sm90_addr_check.cu.)
  const auto cd00 = tdQcdQ(make_coord(make_coord(0, 0, 0), 0, 0));
  const int r0 = get<0>(cd00), c0 = get<1>(cd00);
  float* const sdq_even = dq_base_even<D>(sdq, r0, c0);
  float* const sdq_odd = dq_base_odd<D>(sdq, r0, c0);
  cutlass::arch::NamedBarrier::sync(kDqBarThreads, kBarDqEmpty);  // the previous block has been read
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    CUTE_UNROLL
    for (int j = 0; j < kChunks; j += 2) {
      auto cc = make_coord(make_coord(0, h, j), 0, 0);
      const int dr = get<0>(tdQcdQ(cc)) - r0, dc = get<1>(tdQcdQ(cc)) - c0;  // compile-time after folding
      assert((dr & 1) == 0 && (dc & 15) == 0);
      float4 v = make_float4(tdQrdQ(make_coord(make_coord(0, h, j), 0, 0)),
                             tdQrdQ(make_coord(make_coord(1, h, j), 0, 0)),
                             tdQrdQ(make_coord(make_coord(0, h, j + 1), 0, 0)),
                             tdQrdQ(make_coord(make_coord(1, h, j + 1), 0, 0)));
      // 16-byte aligned: 4 | dq_store_pos
      st_shared_v4(dq_chunk_addr<D>(sdq_even, sdq_odd, dr, dc), v);
    }
  }
  cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> the bulk copy's async proxy
  cutlass::arch::NamedBarrier::arrive(kDqBarThreads, kBarDqFull);
}

// ------------------------------------------------------------------------------------------------
// dK/dV epilogue by TMA store, for a K/V block that lies entirely inside its sequence (a box crossing
// the sequence end would write into the next sequence of a varlen batch). Both consumer warpgroups
// stage their bf16/fp16 dK, dV fragments with stmatrix into the K and V tiles' own smem (no GEMM reads
// them any more once both warpgroups are past their last GEMM); one thread then issues two TMA stores.
// This replaces ~100 predicated 2- or 4-byte global stores per thread, which cost the H200 about 2% of
// the 192/128 causal backward (A/B).
// r2s_k / r2s_v: tiled stmatrix copies for this thread, dst_k / dst_v: the K / V smem in the
// accumulators' (row, col) orientation (transposed views for the unswapped dK^T / dV^T).
template <class Tr>
__device__ __forceinline__ bool dkv_tma_ok(const FmhaBwdSm90Params& p, int n_block, int len_k) {
  return p.dkv_tma && (n_block + 1) * Tr::BN <= len_k;
}

template <class Tr, class R2SK, class R2SV, class Frag16K, class Frag16V, class DstK, class DstV>
__device__ __forceinline__ void store_dkv_tma(const MainArgs<Tr>& args, typename Tr::SharedStorage& ss, int tidx,
                                              const R2SK& r2s_k, const Frag16K& dk16, const DstK& dst_k,
                                              const R2SV& r2s_v, const Frag16V& dv16, const DstV& dst_v) {
  constexpr int BN = Tr::BN, D = Tr::D, DV = Tr::DV, BM = Tr::BM;
  const FmhaBwdSm90Params& p = args.p;
  auto thr_k = r2s_k.get_thread_slice(tidx);
  auto thr_v = r2s_v.get_thread_slice(tidx);
  // both warpgroups are past their last GEMM (the dQ GEMM reads all of K, so the other warpgroup's rows)
  cutlass::arch::NamedBarrier::sync(256, kBarDsReady);
  copy(r2s_k, thr_k.retile_S(dk16), thr_k.partition_D(dst_k));
  copy(r2s_v, thr_v.retile_S(dv16), thr_v.partition_D(dst_v));
  cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> the TMA store's async proxy
  cutlass::arch::NamedBarrier::sync(256, kBarDsReady);
  if (tidx == 0) {
    // the block's coordinates again (a few integer ops): kept from before the loop they spilled
    int n_block, hkv, b;
    cta_coords(p, n_block, hkv, b);
    const Seq sq = get_seq<BM>(p, b);
    const int bcoord = p.cu_seqlens_q != nullptr ? 0 : b;
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
    Tensor mdK = domain_offset(make_coord(int(sq.start_k), _0{}),
                               args.tma_dk.get_tma_tensor(args.shape_k)(_, _, hkv, bcoord));
    Tensor mdV = domain_offset(make_coord(int(sq.start_k), _0{}),
                               args.tma_dv.get_tma_tensor(args.shape_v)(_, _, hkv, bcoord));
    Tensor gdK = local_tile(mdK, Shape<Int<BN>, Int<D>>{}, make_coord(n_block, _0{}));
    Tensor gdV = local_tile(mdV, Shape<Int<BN>, Int<DV>>{}, make_coord(n_block, _0{}));
    auto [tdKgdK, tdKsdK] = tma_partition(args.tma_dk, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gdK));
    auto [tdVgdV, tdVsdV] = tma_partition(args.tma_dv, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gdV));
    copy(args.tma_dk, tdKsdK, tdKgdK);
    copy(args.tma_dv, tdVsdV, tdVgdV);
    tma_store_arrive();
    tma_store_wait<0>();  // the smem tiles are read before the CTA (and its smem) goes
  }
}

// ------------------------------------------------------------------------------------------------
// Consumers, unswapped schedule (d = 192): both operands of every wgmma in smem, the two WGs split N.
template <class Tr>
__device__ __forceinline__ void consume_unswapped(const MainArgs<Tr>& args, typename Tr::SharedStorage& ss,
                                                  const CtaWork& w) {
  using Element = typename Tr::Element;
  constexpr int BM = Tr::BM, BN = Tr::BN, D = Tr::D, DV = Tr::DV, Stages = Tr::Stages;
  const FmhaBwdSm90Params& p = args.p;
  const Seq& sq = w.sq;
  const int n_block = w.n_block, hkv = w.hkv, b = w.b, m_min = w.m_min, n_m = w.n_m, group = w.group;
  const int off = w.off, total_iters = w.total_iters;
  const int tidx = threadIdx.x - 128;  // 0..255
  const int cwg = tidx / 128;          // consumer warpgroup 0/1

  auto [sQ, sdO, sK, sV, sQt, sdOt, sKt] = smem_operands<Tr>(ss);
  Tensor sPt = make_tensor(make_smem_ptr(ss.pt.data()), typename Tr::SmemLayoutPt{});
  Tensor sP = make_tensor(make_smem_ptr(ss.pt.data()), typename Tr::SmemLayoutP{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.dst.data()), typename Tr::SmemLayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.dst.data()), typename Tr::SmemLayoutP{});

  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmadKV mma_dkv;
  typename Tr::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(tidx);

  Tensor tdVrdOt = thr_dkv.partition_fragment_A(sdOt);
  Tensor tdVrPt = thr_dkv.partition_fragment_B(sPt);
  Tensor tdKrQt = thr_dkv.partition_fragment_A(sQt);
  Tensor tdKrdSt = thr_dkv.partition_fragment_B(sdSt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);

  // P and dS leave the accumulators through transposing stmatrix (8x8 blocks of 16-bit values, one
  // 16-byte smem row per key): the P^T/dS^T buffers are keys-major with the queries contiguous.
  auto r2s_pds = make_tiled_copy_C(Copy_Atom<typename Tr::StsmT, Element>{}, mma_sdp);
  auto thr_r2s = r2s_pds.get_thread_slice(tidx);
  Tensor tPsP = thr_r2s.partition_D(sP);
  Tensor tdSsdS = thr_r2s.partition_D(sdS);

  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<DV>, Int<BN>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<D>, Int<BN>>{});
  // dK^T/dV^T start from their first GEMM (zero-initialising wgmma), not from clear(): zeros written
  // by other instructions while the first S/dP GEMMs run would serialize the wgmma pipeline.

  Tensor cS = make_identity_tensor(Shape<Int<BM>, Int<BN>>{});
  Tensor tScS = thr_sdp.partition_C(cS);
  Tensor cdQ = make_identity_tensor(Shape<Int<BM>, Int<D>>{});
  Tensor tdQcdQ = thr_dq.partition_C(cdQ);

  if (total_iters > 0) cutlass::arch::ClusterTransactionBarrier::wait(&ss.kv_bar, 0);

  int stage = 0;
  uint32_t phase = 0;
  // Steps before m_unmasked (within each query head) apply the seq_k bound and the causal diagonal;
  // the others skip that index math. (Two compiled copies of the step, as the swapped schedule has,
  // spill about 900 bytes at d = 192; a uniform branch around the mask loop does not.)
  const int m_unmasked = w.template first_unmasked_m<BM, BN>(p.causal);
  // Each thread holds two rows of S (row_a and row_a + 8, the wgmma accumulator layout).
  const int row_a = get<0>(tScS(0));

  // Software pipeline across steps: S and dP of step it + 1 are issued as soon as step it's dQ block
  // is stored, while its dK^T GEMM still runs, so the tensor cores do not drain at every step
  // boundary (the two consumer warpgroups run in lockstep, so their bubbles would coincide). The
  // accumulators of S and dP are dead by then (dS is in smem), so no register is added at the peak.
  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<BM>, Int<BN>>{});
  Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<BM>, Int<BN>>{});
  // The lse/dpsum of a step are loaded when its S/dP are issued: the GEMMs hide the L2 latency
  // (loaded after a warpgroup_wait they would add two round trips to every step).
  float lse_a, lse_b, dps_a, dps_b;
  auto issue_sdp = [&](int it_next, int st, uint32_t ph) {
    const int gn = it_next / n_m, mn = m_min + it_next % n_m;
    const int64_t srow = int64_t(hkv * group + gn) * p.scratch_rows + sq.scratch_start + int64_t(mn) * BM;
    lse_a = __ldg(p.lse_log2 + srow + row_a); lse_b = __ldg(p.lse_log2 + srow + row_a + 8);
    dps_a = __ldg(p.dpsum + srow + row_a); dps_b = __ldg(p.dpsum + srow + row_a + 8);
    cutlass::arch::ClusterTransactionBarrier::wait(&ss.full_bar[st], ph);
    // The operand descriptors from smem bases hidden behind an empty asm: descriptors hoisted out of the
    // loop (they are loop-invariant) stay live through it and spilled at BN = 112.
    Element* q_base = ss.q.data();
    Element* k_base = ss.k.data();
    Element* do_base = ss.dout.data();
    Element* v_base = ss.v.data();
    asm volatile("" : "+l"(q_base), "+l"(k_base), "+l"(do_base), "+l"(v_base));
    Tensor tSrQ = thr_sdp.partition_fragment_A(make_tensor(make_smem_ptr(q_base), typename Tr::SmemLayoutQ{}));
    Tensor tSrK = thr_sdp.partition_fragment_B(make_tensor(make_smem_ptr(k_base), typename Tr::SmemLayoutK{}));
    Tensor tdPrdO = thr_sdp.partition_fragment_A(make_tensor(make_smem_ptr(do_base), typename Tr::SmemLayoutdO{}));
    Tensor tdPrV = thr_sdp.partition_fragment_B(make_tensor(make_smem_ptr(v_base), typename Tr::SmemLayoutV{}));
    mla_sm90::wg_gemm<false>(mma_sdp, tSrQ(_, _, _, st), tSrK, tSrS, true);
    mla_sm90::wg_gemm<false>(mma_sdp, tdPrdO(_, _, _, st), tdPrV, tdPrdP, true);
  };
  // The loop sits inside the branch that issues the first step's GEMMs: where both paths met, the
  // accumulators' undefined value on the other path became non-wgmma definitions (zeros, spilled) and
  // ptxas serialized the wgmma pipeline (C7515).
  if (total_iters > 0) {
    issue_sdp(0, 0, 0);
    for (int it = 0;; ++it) {
      const int m = m_min + it % n_m;
      const bool need_mask = m < m_unmasked;
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);

      // P = exp2(S * scale_log2 - lse_log2), masked to 0 (masked scores set to -inf first). P and then dS
      // live in tPf, not in the S accumulator: the next step's S GEMM is issued while this step's dK^T
      // runs, and accumulator registers written by other instructions would make ptxas serialize the
      // wgmma pipeline (C7515).
      Tensor tPf = make_tensor_like<float>(tSrS);
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) tPf(i) = tSrS(i);
      if (need_mask) {
        const int q0 = m * BM, k0 = n_block * BN;
        // the coordinates are rebuilt here from an opaque thread index: kept live across the loop for
        // the masked steps they cost two spilled registers once the TMA epilogue was added
        int tidx_m = tidx;
        asm volatile("" : "+r"(tidx_m));
        Tensor tScSm = mma_sdp.get_thread_slice(tidx_m).partition_C(cS);
        CUTE_UNROLL
        for (int i = 0; i < size(tPf); ++i) {
          const int qi = q0 + get<0>(tScSm(i)), kj = k0 + get<1>(tScSm(i));
          const bool valid = kj < sq.len_k && (!p.causal || kj <= qi + off);
          if (!valid) tPf(i) = -INFINITY;
        }
      }
      CUTE_UNROLL
      for (int i = 0; i < size(tPf); ++i) {
        const int row = get<0>(tScS(i));
        const float lse2 = row == row_a ? lse_a : lse_b;
        tPf(i) = mla_sm90::fast_exp2(fmaf(tPf(i), p.scale_log2, -lse2));  // exp2(-inf) = 0
      }
      {
        Tensor tPrP = make_tensor_like<Element>(tPf);
        mla_sm90::convert_frag(tPf, tPrP);  // packed cvt (two values per instruction)
        copy(r2s_pds, thr_r2s.retile_S(tPrP), tPsP);
      }
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(128, kBarPwg0 + cwg);  // this WG's P^T columns complete
      // dV^T += dO^T P  (reads only this WG's keys of P^T)
      mla_sm90::wg_gemm<false>(mma_dkv, tdVrdOt(_, _, _, stage), tdVrPt, tdVrdV, it == 0);
      warpgroup_wait<1>();  // dP done
      warpgroup_fence_operand(tdPrdP);

      // dS = P * (dP - dpsum)
      CUTE_UNROLL
      for (int i = 0; i < size(tPf); ++i) {
        const int row = get<0>(tScS(i));
        tPf(i) = tPf(i) * (tdPrdP(i) - (row == row_a ? dps_a : dps_b));
      }
      Tensor tdSrdS = make_tensor_like<Element>(tPf);
      mla_sm90::convert_frag(tPf, tdSrdS);
      // the other WG's dQ GEMM of the previous step must be done reading dS
      cutlass::arch::NamedBarrier::sync(256, kBardSFree);
      copy(r2s_pds, thr_r2s.retile_S(tdSrdS), tdSsdS);
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(256, kBarDsReady);

      // dQ = dS K ; dK^T += Q^T dS. The dQ smem store below overlaps the dK^T GEMM.
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<BM>, Int<D>>{});
      mla_sm90::wg_gemm<false>(mma_dq, tdQrdS, tdQrKt, tdQrdQ, true);
      mla_sm90::wg_gemm<false>(mma_dkv, tdKrQt(_, _, _, stage), tdKrdSt, tdKrdK, it == 0);
      warpgroup_wait<1>();  // dV^T and dQ done; dK^T may still run
      warpgroup_fence_operand(tdQrdQ);

      store_dq_block<D>(tdQrdQ, tdQcdQ, ss.dq.data());
      // this stage's Q/dO are released once dK^T (the last GEMM reading them) is done
      if (it + 1 == total_iters) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(tdKrdK);
        warpgroup_fence_operand(tdVrdV);
        cutlass::arch::ClusterBarrier::arrive(&ss.empty_bar[stage]);
        break;  // the only exit: no GEMM is left in flight on it
      }
      const int next_stage = stage + 1 == Stages ? 0 : stage + 1;
      const uint32_t next_phase = stage + 1 == Stages ? phase ^ 1 : phase;
      issue_sdp(it + 1, next_stage, next_phase);
      warpgroup_wait<2>();  // dK^T done; the next step's S and dP may still run
      warpgroup_fence_operand(tdKrdK);
      warpgroup_fence_operand(tdVrdV);
      cutlass::arch::ClusterBarrier::arrive(&ss.empty_bar[stage]);
      stage = next_stage;
      phase = next_phase;
    }
  } else {
    clear(tdVrdV);  // keys that no query sees: zero gradients
    clear(tdKrdK);
  }

  // ---------------------------------------------------------------- epilogue: dK, dV
  // A K/V block inside its sequence leaves by TMA store (store_dkv_tma): the accumulators are dK^T/dV^T
  // here, so the stmatrix transposes. Blocks that cross the sequence end store from registers, predicated.
  if (dkv_tma_ok<Tr>(p, n_block, sq.len_k)) {
    CUTE_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.softmax_scale;
    Tensor tdKr16 = make_tensor_like<Element>(tdKrdK);
    Tensor tdVr16 = make_tensor_like<Element>(tdVrdV);
    mla_sm90::convert_frag(tdKrdK, tdKr16);
    mla_sm90::convert_frag(tdVrdV, tdVr16);
    // The staging addresses are derived from bases hidden behind an empty asm: hoisted above the loop
    // (they are loop-invariant) they stayed live through it and spilled.
    Element* k_base = ss.k.data();
    Element* v_base = ss.v.data();
    asm volatile("" : "+l"(k_base), "+l"(v_base));
    Tensor sdKt = make_tensor(make_smem_ptr(k_base), typename Tr::SmemLayoutKt{});  // (D, BN) view
    Tensor sdVt = make_tensor(make_smem_ptr(v_base), typename Tr::SmemLayoutVt{});  // (DV, BN) view
    int tidx_s = tidx;  // opaque: the staging offsets must not be shared with (and kept live from) the loop's
    asm volatile("" : "+r"(tidx_s));
    // dK^T / dV^T rows are dims: a transposing stmatrix writes them as K/V rows (keys)
    auto r2s = make_tiled_copy_C(Copy_Atom<typename Tr::StsmT, Element>{}, mma_dkv);
    store_dkv_tma<Tr>(args, ss, tidx_s, r2s, tdKr16, sdKt, r2s, tdVr16, sdVt);
    return;
  }
  {
    // coordinates from an opaque thread index, so that nothing for them stays live through the loop
    int tidx_e = tidx;
    asm volatile("" : "+r"(tidx_e));
    auto thr_dkv_e = mma_dkv.get_thread_slice(tidx_e);
    Tensor cdV = make_identity_tensor(Shape<Int<DV>, Int<BN>>{});
    Tensor tdVcdV = thr_dkv_e.partition_C(cdV);
    Element* dv = static_cast<Element*>(p.dv) + b * p.dv_batch_stride + sq.start_k * p.dv_row_stride +
                  hkv * p.dv_head_stride;
    CUTE_UNROLL
    for (int i = 0; i < size(tdVrdV); ++i) {
      const int dim = get<0>(tdVcdV(i)), key = n_block * BN + get<1>(tdVcdV(i));
      if (key < sq.len_k) dv[int64_t(key) * p.dv_row_stride + dim] = Element(tdVrdV(i));
    }
    Tensor cdK = make_identity_tensor(Shape<Int<D>, Int<BN>>{});
    Tensor tdKcdK = thr_dkv_e.partition_C(cdK);
    Element* dk = static_cast<Element*>(p.dk) + b * p.dk_batch_stride + sq.start_k * p.dk_row_stride +
                  hkv * p.dk_head_stride;
    CUTE_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) {
      const int dim = get<0>(tdKcdK(i)), key = n_block * BN + get<1>(tdKcdK(i));
      if (key < sq.len_k) dk[int64_t(key) * p.dk_row_stride + dim] = Element(tdKrdK(i) * p.softmax_scale);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Consumers, swapped schedule (kSwapSdP, d <= 128). Consumer WG c owns keys [64c, 64c + 64) of the
// K/V block. Per M-block:
//   S^T = K Q^T, dP^T = V dO^T (SS, issued back to back)
//   P^T = exp2(S^T * scale_log2 - lse_log2[query]) masked;  dV += P^T dO (RS, P^T from registers)
//   dS^T = P^T (dP^T - dpsum[query]);                       dK += dS^T Q (RS)
//   dS^T -> smem (buffer it % 2), both WGs' halves -> dQ = dS K (SS, the WGs split D)
// The dS^T buffers alternate, so a WG may store the next M-block's dS^T while the other WG's dQ GEMM
// still reads this one: one 256-thread barrier per step.
template <class Tr>
__device__ __forceinline__ void consume_swapped(const MainArgs<Tr>& args, typename Tr::SharedStorage& ss,
                                                const CtaWork& w) {
  using Element = typename Tr::Element;
  using BMt = typename Tr::BMt; using BNt = typename Tr::BNt; using Dt = typename Tr::Dt; using DVt = typename Tr::DVt;
  constexpr int BM = Tr::BM, BN = Tr::BN, D = Tr::D, Stages = Tr::Stages;
  const FmhaBwdSm90Params& p = args.p;
  const Seq& sq = w.sq;
  const int tidx = threadIdx.x - 128;  // 0..255

  auto [sQ, sdO, sK, sV, sQt, sdOt, sKt] = smem_operands<Tr>(ss);
  // dS^T buffers (keys x queries, queries contiguous) and their (queries x keys) views for dQ
  Tensor sdSt0 = make_tensor(make_smem_ptr(ss.dst.data()), typename Tr::SmemLayoutPt{});
  Tensor sdSt1 = make_tensor(make_smem_ptr(ss.pt.data()), typename Tr::SmemLayoutPt{});
  Tensor sdS0 = make_tensor(make_smem_ptr(ss.dst.data()), typename Tr::SmemLayoutP{});
  Tensor sdS1 = make_tensor(make_smem_ptr(ss.pt.data()), typename Tr::SmemLayoutP{});

  typename Tr::TiledMmaSdPt mma_sdp;
  typename Tr::TiledMmadVs mma_dv;
  typename Tr::TiledMmadKs mma_dk;
  typename Tr::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  auto thr_dv = mma_dv.get_thread_slice(tidx);
  auto thr_dk = mma_dk.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(tidx);

  Tensor tSrK = thr_sdp.partition_fragment_A(sK);    // (MMA, 1, D/16): this WG's 64 keys
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);    // (MMA, 1, D/16, Stages)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdOt = thr_dv.partition_fragment_B(sdOt);  // (MMA, 1, BM/16, Stages)
  Tensor tdKrQt = thr_dk.partition_fragment_B(sQt);
  Tensor tdQrdS0 = thr_dq.partition_fragment_A(sdS0);
  Tensor tdQrdS1 = thr_dq.partition_fragment_A(sdS1);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
  Tensor tdSsdS0 = thr_sdp.partition_C(sdSt0);
  Tensor tdSsdS1 = thr_sdp.partition_C(sdSt1);
  // smem addresses of this thread's first dS^T pair in each buffer (the rest: see the store)
  const uint32_t ds_addr0 = cute::cast_smem_ptr_to_uint(&tdSsdS0(0));
  const uint32_t ds_addr1 = cute::cast_smem_ptr_to_uint(&tdSsdS1(0));

  Tensor tdVrdV = partition_fragment_C(mma_dv, Shape<BNt, DVt>{});  // (keys, dv) rows of this WG
  Tensor tdKrdK = partition_fragment_C(mma_dk, Shape<BNt, Dt>{});
  clear(tdVrdV);
  clear(tdKrdK);

  // (key, query) coordinates of this thread's S^T elements in the (row, col) view: rows are keys,
  // columns queries; columns 2c and 2c + 1 are adjacent queries (one 8-byte lse/dpsum load).
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<BNt, BMt>{}));
  Tensor cS_rc = make_tensor(cS.data(), mla_sm90::acc_rowcol(cS.layout()));
  Tensor cdQ = make_identity_tensor(Shape<BMt, Dt>{});
  Tensor tdQcdQ = thr_dq.partition_C(cdQ);

  if (w.total_iters > 0) cutlass::arch::ClusterTransactionBarrier::wait(&ss.kv_bar, 0);

  const int key0 = w.n_block * BN;
  int stage = 0;
  uint32_t phase = 0;
  int it = 0;  // step counter over the whole CTA (selects the dS^T buffer)

  // One M-block step. kMask: apply the seq_k bound and the causal diagonal; steps whose block is
  // entirely visible skip that index math (it costs more issue slots than the exp itself).
  auto step = [&](int m, auto mask_tag) {
    constexpr bool kMask = decltype(mask_tag)::value;
    const int q0 = m * BM;
    cutlass::arch::ClusterTransactionBarrier::wait(&ss.full_bar[stage], phase);

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<BNt, BMt>{});
    Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<BNt, BMt>{});
    mla_sm90::wg_gemm<false>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS, true);
    mla_sm90::wg_gemm<false>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tdPrdP, true);
    Tensor S_rc = make_tensor(tSrS.data(), mla_sm90::acc_rowcol(tSrS.layout()));
    Tensor dP_rc = make_tensor(tdPrdP.data(), mla_sm90::acc_rowcol(tdPrdP.layout()));
    const float* lse_s = ss.lse.data() + stage * BM;
    const float* dps_s = ss.dps.data() + stage * BM;
    warpgroup_wait<1>();  // S^T done
    warpgroup_fence_operand(tSrS);

    // P^T = exp2(S^T * scale_log2 - lse_log2); masked scores become -inf, so P = 0 there without a
    // branch. Query rows past the sequence end have lse_log2 = +inf (preprocess): P = 0 as well.
    CUTE_UNROLL
    for (int c = 0; c < size<1>(S_rc); c += 2) {
      const int qc = get<1>(cS_rc(0, c));
      const float2 l2 = *reinterpret_cast<const float2*>(lse_s + qc);
      CUTE_UNROLL
      for (int r = 0; r < size<0>(S_rc); ++r) {
        if constexpr (kMask) {
          const int key = key0 + get<0>(cS_rc(r, c));
          // key visible to query q iff key < len_k and (!causal or key - off <= q)
          const int qmin = p.causal ? key - w.off - q0 : INT_MIN;  // smallest visible query column
          const bool in_k = key < sq.len_k;
          if (!(in_k && qc >= qmin)) S_rc(r, c) = -INFINITY;
          if (!(in_k && qc + 1 >= qmin)) S_rc(r, c + 1) = -INFINITY;
        }
        S_rc(r, c) = mla_sm90::fast_exp2(fmaf(S_rc(r, c), p.scale_log2, -l2.x));
        S_rc(r, c + 1) = mla_sm90::fast_exp2(fmaf(S_rc(r, c + 1), p.scale_log2, -l2.y));
      }
    }
    Tensor tPrP = make_tensor<Element>(mla_sm90::acc_to_A_regs(tSrS.layout()));
    mla_sm90::convert_frag(tSrS, tPrP);
    mla_sm90::wg_gemm<true>(mma_dv, tPrP, tdVrdOt(_, _, _, stage), tdVrdV, false);
    warpgroup_wait<1>();  // dP^T done; dV may still run
    warpgroup_fence_operand(tdPrdP);

    // dS^T = P^T (dP^T - dpsum)
    CUTE_UNROLL
    for (int c = 0; c < size<1>(dP_rc); c += 2) {
      const float2 d2 = *reinterpret_cast<const float2*>(dps_s + get<1>(cS_rc(0, c)));
      CUTE_UNROLL
      for (int r = 0; r < size<0>(dP_rc); ++r) {
        dP_rc(r, c) = S_rc(r, c) * (dP_rc(r, c) - d2.x);
        dP_rc(r, c + 1) = S_rc(r, c + 1) * (dP_rc(r, c + 1) - d2.y);
      }
    }
    Tensor tdSr = make_tensor<Element>(mla_sm90::acc_to_A_regs(tdPrdP.layout()));
    mla_sm90::convert_frag(tdPrdP, tdSr);

    // dS^T to smem for dQ: adjacent queries are adjacent in smem (a 16-byte swizzle unit keeps
    // them together), so each pair is one 4-byte st.shared. The C-layout view of the converted
    // registers has the same element order as the accumulator.
    // Pair q = i / 2 of the thread is key row r0 + 8 (q & 1), queries 8 (q >> 1) + 2t, + 1. In the
    // SW128 keys-major buffer (128-byte key rows, 1024-byte aligned; the 128-byte swizzle XORs the
    // 16-byte unit index, bits 4-6 of the address, with the key row mod 8, bits 7-9) its address is
    // the address of pair 0 with (q >> 1) XORed into bits 4-6, plus 1024 for the row + 8: one base
    // register per buffer instead of 16 loop-invariant addresses (which spilled). Checked for every
    // thread and both buffers against &tdSsdS0(i) / &tdSsdS1(i) by tests/sm90/fmha_bwd_sm90_addr_check.cu.
    {
      Tensor tdSr_c = make_tensor(tdSr.data(), tdPrdP.layout());
      static_assert(decltype(cosize(tdPrdP.layout()))::value == decltype(size(tdPrdP))::value, "compact accumulator");
      static_assert(BM * sizeof(Element) == 128 && decltype(size(tdSr_c))::value == 32, "layout the formula assumes");
      const uint32_t ds_base = (it & 1) ? ds_addr1 : ds_addr0;
      CUTE_UNROLL
      for (int i = 0; i < size(tdSr_c); i += 2) {
        const int q = i / 2;
        cutlass::Array<Element, 2> pair;
        pair[0] = tdSr_c(i);
        pair[1] = tdSr_c(i + 1);
        st_shared_u32_addr(ds_pair_addr(ds_base, q), reinterpret_cast<const uint32_t&>(pair));
      }
    }
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(256, kBarDsReady);  // both WGs' keys of dS^T are in smem

    // dQ first, then dK: the dQ smem store overlaps the dK GEMM (FlashAttention-3's order)
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<BMt, Dt>{});
    if (it & 1) mla_sm90::wg_gemm<false>(mma_dq, tdQrdS1, tdQrKt, tdQrdQ, true);
    else mla_sm90::wg_gemm<false>(mma_dq, tdQrdS0, tdQrKt, tdQrdQ, true);
    mla_sm90::wg_gemm<true>(mma_dk, tdSr, tdKrQt(_, _, _, stage), tdKrdK, false);
    warpgroup_wait<1>();  // dV, dQ done; dK runs during the dQ store
    warpgroup_fence_operand(tdQrdQ);
    store_dq_block<D>(tdQrdQ, tdQcdQ, ss.dq.data());
    warpgroup_wait<0>();  // P^T/dS^T registers and this stage's Q/dO are free
    warpgroup_fence_operand(tdKrdK);
    warpgroup_fence_operand(tdVrdV);
    cutlass::arch::ClusterBarrier::arrive(&ss.empty_bar[stage]);
    if (++stage == Stages) { stage = 0; phase ^= 1; }
    ++it;
  };

  const int m_unmasked = w.template first_unmasked_m<BM, BN>(p.causal);
  for (int g = 0; g < w.group; ++g) {
    for (int m = w.m_min; m < m_unmasked; ++m) step(m, cute::true_type{});
    for (int m = m_unmasked; m < w.m_min + w.n_m; ++m) step(m, cute::false_type{});
  }

  // ---------------------------------------------------------------- epilogue: dK, dV
  // Rows are keys, columns dims, as in the K/V tiles: a plain stmatrix stages them for the TMA store.
  if (dkv_tma_ok<Tr>(p, w.n_block, sq.len_k)) {
    Tensor tdVr16 = make_tensor_like<Element>(tdVrdV);
    mla_sm90::convert_frag(tdVrdV, tdVr16);
    CUTE_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.softmax_scale;
    Tensor tdKr16 = make_tensor_like<Element>(tdKrdK);
    mla_sm90::convert_frag(tdKrdK, tdKr16);
    Tensor sdK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
    Tensor sdV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
    store_dkv_tma<Tr>(args, ss, tidx, make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dk), tdKr16, sdK,
                      make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dv), tdVr16, sdV);
    return;
  }
  // blocks crossing the sequence end: adjacent dims of a thread form one predicated 4-byte store
  auto store_rows = [&](const auto& acc, const auto& thr, auto shape, Element* base, int64_t row_stride, float scale) {
    Tensor cc = thr.partition_C(make_identity_tensor(shape));
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int key = key0 + get<0>(cc(i)), dim = get<1>(cc(i));
      if (key < sq.len_k) {
        cutlass::Array<Element, 2> pair;
        pair[0] = Element(acc(i) * scale);
        pair[1] = Element(acc(i + 1) * scale);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(base + int64_t(key) * row_stride + dim) = pair;
      }
    }
  };
  Element* dv = static_cast<Element*>(p.dv) + w.b * p.dv_batch_stride + sq.start_k * p.dv_row_stride +
                w.hkv * p.dv_head_stride;
  Element* dk = static_cast<Element*>(p.dk) + w.b * p.dk_batch_stride + sq.start_k * p.dk_row_stride +
                w.hkv * p.dk_head_stride;
  store_rows(tdVrdV, thr_dv, Shape<BNt, DVt>{}, dv, p.dv_row_stride, 1.f);
  store_rows(tdKrdK, thr_dk, Shape<BNt, Dt>{}, dk, p.dk_row_stride, p.softmax_scale);
}

// ------------------------------------------------------------------------------------------------
// Main kernel: producer warpgroup, then one of the two consumer schedules.
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1) fmha_bwd_sm90_main(const __grid_constant__ MainArgs<Tr> args) {
  using Element = typename Tr::Element;
  constexpr int BM = Tr::BM, BN = Tr::BN, D = Tr::D, DV = Tr::DV, Stages = Tr::Stages;
  using SS = typename Tr::SharedStorage;
  extern __shared__ __align__(1024) char smem_raw[];
  SS& ss = *reinterpret_cast<SS*>(smem_raw);
  const FmhaBwdSm90Params& p = args.p;

  int n_block, hkv, b;
  cta_coords(p, n_block, hkv, b);
  // whole CTA, before any barrier; the rest of the CTA's geometry is computed after the warpgroup
  // split (make_cta_work), so that only the block coordinates live across it
  if (n_block * BN >= get_seq<BM>(p, b).len_k) return;

  const int warp_group = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&ss.full_bar[s], 1);
      cutlass::arch::ClusterBarrier::init(&ss.empty_bar[s], 256);
    }
    cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_bar, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  auto [sQ, sdO, sK, sV, sQt, sdOt, sKt] = smem_operands<Tr>(ss);
  (void)sQt; (void)sdOt; (void)sKt;

  if (warp_group == 0) {
    // ---------------------------------------------------------------- producer
    // 24 + 2 x 240 = 504 = 3 x 168, the launch allocation: setmaxnreg only moves registers inside the
    // CTA's own pool, so the producer cannot keep more while the consumers take 240 (32 here hung the
    // consumers' setmaxnreg.inc on the H200). Fits 24 without spill when only the block coordinates
    // live across the split and the loops below keep running (hq, m) values (docs/kernels/fmha_bwd_sm90.md).
    cutlass::arch::warpgroup_reg_dealloc<24>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 1) {
      const CtaWork w = make_cta_work<BM, BN>(p, n_block, hkv, b);
      // dQ reducer: one bulk reduce per (query head, M-block), in the consumers' order: query heads
      // hq = hkv * group + g (g = 0 .. group-1), each with M-blocks m = m_min .. m_end-1 (running
      // values instead of it / n_m, it % n_m; n_m > 0 when total_iters > 0)
      if (w.total_iters > 0) {
        cutlass::arch::NamedBarrier::arrive(kDqBarThreads, kBarDqEmpty);  // the smem block starts free
        // scratch_start is a multiple of BM: scratch row of M-block m = (sblk + m) * BM
        const int sblk = int(w.sq.scratch_start / BM);
        const int m_min = w.m_min, m_end = w.m_min + w.n_m, hq_end = (hkv + 1) * w.group;
        int hq = hkv * w.group, m = m_min;
#pragma unroll 1
        while (hq < hq_end) {
          const int64_t srow0 = int64_t(hq) * p.scratch_rows + int64_t(sblk + m) * BM;
          cutlass::arch::NamedBarrier::sync(kDqBarThreads, kBarDqFull);
          if (lane == 0) {
            int* sem = p.deterministic ? p.dq_sem + int64_t(hq) * (p.scratch_rows / BM) + (sblk + m) : nullptr;
            if (sem != nullptr) {
              while (ld_acquire_gpu(sem) != n_block) { __nanosleep(64); }
            }
            bulk_reduce_add_f32(p.dq_accum + srow0 * D, ss.dq.data(), uint32_t(BM * D * sizeof(float)));
            if (sem != nullptr) {
              // the adds must have landed before the next K/V block's CTA may add to this M-block
              asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
              __threadfence();
              atomicAdd(sem, 1);
            } else {
              asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // smem block read
            }
          }
          __syncwarp();
          if (++m == m_end) { m = m_min; ++hq; }
          if (hq < hq_end) cutlass::arch::NamedBarrier::arrive(kDqBarThreads, kBarDqEmpty);  // not the last
        }
        if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
      }
    }
    if (threadIdx.x == 0) {
      const CtaWork w = make_cta_work<BM, BN>(p, n_block, hkv, b);
      if (w.total_iters > 0) {
        const int bcoord = p.cu_seqlens_q != nullptr ? 0 : b;
        // K, V of this block (once)
        Tensor mK = domain_offset(make_coord(int(w.sq.start_k), _0{}),
                                  args.tma_k.get_tma_tensor(args.shape_k)(_, _, hkv, bcoord));
        Tensor mV = domain_offset(make_coord(int(w.sq.start_k), _0{}),
                                  args.tma_v.get_tma_tensor(args.shape_v)(_, _, hkv, bcoord));
        Tensor gK = local_tile(mK, Shape<Int<BN>, Int<D>>{}, make_coord(n_block, _0{}));
        Tensor gV = local_tile(mV, Shape<Int<BN>, Int<DV>>{}, make_coord(n_block, _0{}));
        auto [tKgK, tKsK] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto [tVgV, tVsV] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_bar, Tr::kBytesK + Tr::kBytesV);
        copy(args.tma_k.with(ss.kv_bar), tKgK, tKsK);
        copy(args.tma_v.with(ss.kv_bar), tVgV, tVsV);

        Tensor mQall = args.tma_q.get_tma_tensor(args.shape_q);
        Tensor mdOall = args.tma_do.get_tma_tensor(args.shape_do);
        const int start_q = int(w.sq.start_q);
        const int sblk = int(w.sq.scratch_start / BM);  // see the reducer
        const int m_min = w.m_min, m_end = w.m_min + w.n_m, hq_end = (hkv + 1) * w.group;
        int stage = 0;
        uint32_t phase = 0;
        // query heads hq = hkv * group + g, each with M-blocks m_min .. m_end-1 (the reducer's order)
        int hq = hkv * w.group, m = m_min;
#pragma unroll 1
        while (hq < hq_end) {
          Tensor mQ = domain_offset(make_coord(start_q, _0{}), mQall(_, _, hq, bcoord));
          Tensor mdO = domain_offset(make_coord(start_q, _0{}), mdOall(_, _, hq, bcoord));
          Tensor gQ = local_tile(mQ, Shape<Int<BM>, Int<D>>{}, make_coord(m, _0{}));
          Tensor gdO = local_tile(mdO, Shape<Int<BM>, Int<DV>>{}, make_coord(m, _0{}));
          auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
          auto [tdOgdO, tdOsdO] = tma_partition(args.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
          cutlass::arch::ClusterBarrier::wait(&ss.empty_bar[stage], phase ^ 1);
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.full_bar[stage],
                                                                         Tr::kBytesQ + Tr::kBytesdO + Tr::kBytesRowStats);
          copy(args.tma_q.with(ss.full_bar[stage]), tQgQ, tQsQ(_, stage));
          copy(args.tma_do.with(ss.full_bar[stage]), tdOgdO, tdOsdO(_, stage));
          if constexpr (Tr::Swap) {
            // scratch rows of an M-block are 64 contiguous floats at a multiple of 64: 16-byte aligned
            const int64_t srow0 = int64_t(hq) * p.scratch_rows + int64_t(sblk + m) * BM;
            SM90_BULK_COPY_G2S::copy(p.lse_log2 + srow0, &ss.full_bar[stage], ss.lse.data() + stage * BM, BM * 4);
            SM90_BULK_COPY_G2S::copy(p.dpsum + srow0, &ss.full_bar[stage], ss.dps.data() + stage * BM, BM * 4);
          }
          if (++stage == Stages) { stage = 0; phase ^= 1; }
          if (++m == m_end) { m = m_min; ++hq; }
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<240>();
  const CtaWork w = make_cta_work<BM, BN>(p, n_block, hkv, b);
  if constexpr (Tr::Swap) {
    consume_swapped<Tr>(args, ss, w);
  } else {
    consume_unswapped<Tr>(args, ss, w);
  }
}

// ------------------------------------------------------------------------------------------------
// Host launcher.
// (kv head, batch) pairs per launch group of the main kernel (FmhaBwdSm90Params::pair_group).
// - Not causal: every CTA does the same work; one pair after another keeps that pair's Q/dO and dQ
//   accumulator hot in L2 while its K/V blocks run.
// - Causal, deterministic: every pair interleaved, so block n-1 (whose dQ adds block n waits for) runs
//   a whole round earlier: on the H200 that took 192/128 from 226 to 305 TF/s and 128/128 from 279 to 438.
// - Causal: work falls with the K/V block index. One pair after another starts each pair's longest CTA
//   last, so the grid's last wave is uneven; every pair interleaved streams all heads' Q/dO at once. In
//   between: groups of pairs whose Q, dO and fp32 dQ accumulator fit in a share of the L2, longest block
//   first inside a group; a power of two, so that groups divide the usual head counts (a small last group
//   brings the uneven tail back). H200, B=2 H=16 S=8192, kernel TF/s (one run; cuDNN moved 453-473 / 514-538
//   between the processes): pairs per group 1 / 2 / 3 / 4 / 6 / all:
//   192/128 443 / 456 / 455 / 457 / 450 / 419; 128/128 528 / 541 / 542 / 556 / 531 / 526.
// `forced` (FmhaBwdSm90Options::pair_group, from bwd_with_options) overrides it: N pairs per group, 0 all
// pairs interleaved; negative: this choice.
inline int pair_group(const FmhaBwdSm90Params& p, int forced) {
  const int pairs = p.hkv * p.batch;
  if (forced == 0) return pairs;
  if (forced > 0) return forced < pairs ? forced : pairs;
  if (!p.causal) return 1;
  if (p.deterministic) return pairs;
  const double per_pair = double(p.max_seqlen_q) * (p.hq / p.hkv) *
                          ((p.head_dim + p.head_dim_v) * 2.0 + p.head_dim * 4.0);
  const double fit = per_pair > 0 ? kFmhaBwdSm90L2GroupShare * mla_sm90::device_l2_bytes() / per_pair : pairs;
  int g = 1;
  while (2 * g <= fit && 2 * g <= pairs) g *= 2;
  return g;
}

template <class T, int D, int DV>
void run(const FmhaBwdSm90Params& p, const FmhaBwdSm90Options& opt, cudaStream_t stream) {
  using Element = typename CuteType<T>::type;
  using Tr = Traits<Element, D, DV>;
  constexpr int BM = Tr::BM, BN = Tr::BN;
  static_assert(BM == kFmhaBwdSm90BlockM, "scratch layout assumes one BM");
  const int grid_m = (p.max_seqlen_q + BM - 1) / BM;

  if (grid_m > 0) {
    dim3 grid(grid_m, p.hq, p.batch);
    fmha_bwd_sm90_preprocess<T, D, DV, BM><<<grid, 256, 0, stream>>>(p);
    FMHA_BWD_CUDA_CHECK(cudaGetLastError());
  }

  const bool varlen = p.cu_seqlens_q != nullptr;
  const int nb = varlen ? 1 : p.batch;
  auto make_gmem = [&](const void* ptr, int rows, int dim, int heads, int64_t row_stride, int64_t head_stride,
                       int64_t batch_stride) {
    // varlen: batch extent 1; give it a nonzero stride that is a multiple of 16 bytes
    int64_t bs = varlen ? row_stride * 8 : batch_stride;
    if (bs == 0) bs = 8;
    auto layout = make_layout(make_shape(int32_t(rows), int32_t(dim), int32_t(heads), int32_t(nb)),
                              make_stride(row_stride, _1{}, head_stride, bs));
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), layout);
  };
  const int rows_q = varlen ? p.total_q : p.seqlen_q;
  const int rows_k = varlen ? p.total_k : p.seqlen_k;
  auto gQ = make_gmem(p.q, rows_q, D, p.hq, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto gdO = make_gmem(p.dout, rows_q, DV, p.hq, p.do_row_stride, p.do_head_stride, p.do_batch_stride);
  auto gK = make_gmem(p.k, rows_k, D, p.hkv, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto gV = make_gmem(p.v, rows_k, DV, p.hkv, p.v_row_stride, p.v_head_stride, p.v_batch_stride);

  MainArgs<Tr> args{};
  args.p = p;
  args.p.pair_group = pair_group(p, opt.pair_group);
  args.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gQ, take<0, 2>(typename Tr::SmemLayoutQ{}), Shape<Int<BM>, Int<D>>{}, _1{});
  args.tma_do = make_tma_copy(SM90_TMA_LOAD{}, gdO, take<0, 2>(typename Tr::SmemLayoutdO{}), Shape<Int<BM>, Int<DV>>{}, _1{});
  args.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gK, typename Tr::SmemLayoutK{}, Shape<Int<BN>, Int<D>>{}, _1{});
  args.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gV, typename Tr::SmemLayoutV{}, Shape<Int<BN>, Int<DV>>{}, _1{});
  args.shape_q = gQ.shape();
  args.shape_do = gdO.shape();
  args.shape_k = gK.shape();
  args.shape_v = gV.shape();
  // dK/dV by TMA store (store_dkv_tma) where the outputs allow it: 16-byte aligned base and strides
  auto tma_ok = [](const void* ptr, std::initializer_list<int64_t> strides) {
    bool ok = reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
    for (int64_t st : strides) ok = ok && st % (16 / int64_t(sizeof(Element))) == 0;
    return ok;
  };
  args.p.dkv_tma = tma_ok(p.dk, {p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride}) &&
                   tma_ok(p.dv, {p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride});
  if (args.p.dkv_tma) {
    // the same (rows, dim, head, batch) extents as K and V, so the kernel indexes them with shape_k/shape_v
    auto gdK = make_gmem(p.dk, rows_k, D, p.hkv, p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride);
    auto gdV = make_gmem(p.dv, rows_k, DV, p.hkv, p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride);
    args.tma_dk = make_tma_copy(SM90_TMA_STORE{}, gdK, typename Tr::SmemLayoutK{}, Shape<Int<BN>, Int<D>>{}, _1{});
    args.tma_dv = make_tma_copy(SM90_TMA_STORE{}, gdV, typename Tr::SmemLayoutV{}, Shape<Int<BN>, Int<DV>>{}, _1{});
  }

  const int grid_n = (p.max_seqlen_k + BN - 1) / BN;
  if (grid_n > 0) {
    auto kernel = fmha_bwd_sm90_main<Tr>;
    constexpr int smem = Tr::kSmemBytes;
    FMHA_BWD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    dim3 grid(grid_n, p.hkv, p.batch);
    kernel<<<grid, Tr::kThreads, smem, stream>>>(args);
    FMHA_BWD_CUDA_CHECK(cudaGetLastError());
  }

  if (grid_m > 0) {
    dim3 grid(grid_m, p.hq, p.batch);
    fmha_bwd_sm90_postprocess<T, D, BM><<<grid, 256, 0, stream>>>(p);
    FMHA_BWD_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace fmha_bwd_sm90
