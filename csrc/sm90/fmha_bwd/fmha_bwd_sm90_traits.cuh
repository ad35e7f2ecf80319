// Main-kernel traits of the SM90 fused attention backward (family fmha_bwd_sm90): tiles, smem layouts, TMA
// and MMA types, the kernel arguments, the named barriers and the PTX helpers that the producer and the
// consumer warpgroups share (fmha_bwd_sm90_kernel.cuh describes the whole).
#pragma once

#include "fmha_bwd_sm90_common.cuh"

namespace fmha_bwd_sm90 {

using namespace cute;

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
  // TraitsMla: Q and K come in two parts each and dK leaves in two (the MLA-native backward)
  static constexpr bool kMla = false;

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

  // The dK / dV accumulators of the schedule, their (row, col) shapes and how the epilogue stages them for
  // the TMA store: unswapped, dK^T / dV^T (dims x keys), written as K / V rows (keys) by a transposing
  // stmatrix into transposed views of the K / V tiles; swapped, dK / dV (keys x dims), as the tiles are.
  using TiledMmadK = std::conditional_t<Swap, TiledMmadKs, TiledMmadKV>;
  using TiledMmadV = std::conditional_t<Swap, TiledMmadVs, TiledMmadKV>;
  using ShapedK = std::conditional_t<Swap, Shape<BNt, Dt>, Shape<Dt, BNt>>;
  using ShapedV = std::conditional_t<Swap, Shape<BNt, DVt>, Shape<DVt, BNt>>;
  using StsmdKV = std::conditional_t<Swap, SM90_U32x4_STSM_N, StsmT>;
  using SmemLayoutdKStage = std::conditional_t<Swap, SmemLayoutK, SmemLayoutKt>;
  using SmemLayoutdVStage = std::conditional_t<Swap, SmemLayoutV, SmemLayoutVt>;

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
    // this CTA's (K/V block, kv head, sequence), written once at the start for the dK/dV epilogue: on the
    // compact varlen grid they come from a scan of cu_seqlens_k, which the epilogue need not run again
    int coords[3];
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

// The MLA-native 192/128 backward: Q = [q_nope | q_pe] and K = [k_nope | k_pe] read where they are, each part
// through its own TMA descriptor, into the very smem tiles of Traits<Element, 192, 128> (the consumers, barriers
// and transaction bytes are that kernel's), and dK stored as dk_nope and dk_pe. Both tiles are K-major chunks of
// whole rows: Q's 128-byte swizzle makes 64-column chunks (chunk c of a stage at c * BM * 64 elements), K's 64-byte
// swizzle 32-column chunks (chunk c at c * BN * 32), so columns 0..127 (nope) are the first 128 * rows elements of
// a tile and the rope columns the rest, starting on a multiple of the swizzle period (1 KiB): each part is the
// tile's layout restricted to its columns, at its own base. k_pe has one head (the rope key every kv head shares:
// its descriptor's head extent is 1 and its head coordinate 0) or Hkv.
template <class Element_>
struct TraitsMla : Traits<Element_, 192, 128> {
  using Base = Traits<Element_, 192, 128>;
  using typename Base::BMt;
  using typename Base::BNt;
  using typename Base::GmemLayout;
  static constexpr bool kMla = true;
  static constexpr int kDn = 128, kDr = 64;
  static constexpr int BM = Base::BM, BN = Base::BN, Stages = Base::Stages;
  static_assert(kDn + kDr == Base::D && kDn % 64 == 0, "the nope/rope split falls on a swizzle chunk of Q and K");
  static_assert((BM * kDn) % 512 == 0 && (BN * kDn) % 512 == 0, "each part starts on the swizzle period");
  using DN = Int<kDn>;
  using DR = Int<kDr>;

  // Columns [0, W) of every Q stage and of the K tile as layouts of their own: the tile's layout composed with
  // the column-major coordinates of a narrower tile (Q's stage stride stays the 192-column one). A rope part is
  // the same layout at a pointer kDn columns (kDn * rows elements) into the tile.
  template <int W>
  using QCols = decltype(composition(typename Base::SmemLayoutQ{},
                                     Layout<Shape<BMt, Int<W>, Int<Stages>>, Stride<_1, BMt, Int<BM * Base::D>>>{}));
  template <int W>
  using KCols = decltype(composition(typename Base::SmemLayoutK{}, Layout<Shape<BNt, Int<W>>, Stride<_1, BNt>>{}));
  using SmemLayoutQNope = QCols<kDn>;
  using SmemLayoutQPe = QCols<kDr>;
  using SmemLayoutKNope = KCols<kDn>;
  using SmemLayoutKPe = KCols<kDr>;

  template <class Op, class SmemLayout, class Box>
  using TmaOf = decltype(make_tma_copy(Op{}, make_tensor(make_gmem_ptr(static_cast<Element_ const*>(nullptr)),
                                                         GmemLayout{}),
                                       SmemLayout{}, Box{}, _1{}));
  using TmaQNope = TmaOf<SM90_TMA_LOAD, decltype(take<0, 2>(SmemLayoutQNope{})), Shape<BMt, DN>>;
  using TmaQPe = TmaOf<SM90_TMA_LOAD, decltype(take<0, 2>(SmemLayoutQPe{})), Shape<BMt, DR>>;
  using TmaKNope = TmaOf<SM90_TMA_LOAD, SmemLayoutKNope, Shape<BNt, DN>>;
  using TmaKPe = TmaOf<SM90_TMA_LOAD, SmemLayoutKPe, Shape<BNt, DR>>;
  using TmadKNope = TmaOf<SM90_TMA_STORE, SmemLayoutKNope, Shape<BNt, DN>>;
  using TmadKPe = TmaOf<SM90_TMA_STORE, SmemLayoutKPe, Shape<BNt, DR>>;
};

// The main kernel's arguments: the parameters, the TMA descriptors and the (rows, dim, head, batch) extents they
// index. TraitsMla's: tma_q / tma_k / tma_dk (and shape_q / shape_k) over q_nope / k_nope / dk_nope, then the
// rope parts (MainArgs<TraitsMla> below).
template <class Tr, bool = Tr::kMla>
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

template <class Tr>
struct MainArgs<Tr, true> {
  FmhaBwdSm90Params p;
  typename Tr::TmaQNope tma_q;
  typename Tr::TmadO tma_do;
  typename Tr::TmaKNope tma_k;
  typename Tr::TmaV tma_v;
  typename Tr::TmadKNope tma_dk;  // valid when p.dkv_tma
  typename Tr::TmadV tma_dv;
  typename Tr::GmemShape shape_q, shape_do, shape_k, shape_v;
  typename Tr::TmaQPe tma_q_pe;
  typename Tr::TmaKPe tma_k_pe;
  typename Tr::TmadKPe tma_dk_pe;  // valid when p.dkv_tma
  typename Tr::GmemShape shape_q_pe, shape_k_pe, shape_dk_pe;
  FmhaBwdSm90RopeParts rope;  // the register epilogue's dk_pe pointer and strides
  int k_pe_shared;            // k_pe has one head: its head coordinate is 0 for every kv head
};

// ------------------------------------------------------------------------------------------------
// The TMA partition of one tile (or one part of an MLA-native tile): rows [block * R, (block + 1) * R) after `offset`
// (the sequence's first row) of head `head`, batch `bcoord` of the tensor `tma` describes (extents `gshape`), and the
// smem at `base` laid out as `smem_layout` ((R, C); for a part, the tile's layout restricted to its columns,
// TraitsMla). Returns (gmem side, smem side), for a load (load_tile_part) or a store (store_tile_part).
template <class Tma, class GShape, class SmemLayout, class Element>
__device__ __forceinline__ auto tma_tile_part(const Tma& tma, const GShape& gshape, const SmemLayout& smem_layout,
                                              Element* base, int offset, int block, int head, int bcoord) {
  Tensor s = make_tensor(make_smem_ptr(base), smem_layout);
  Tensor m = domain_offset(make_coord(offset, _0{}), tma.get_tma_tensor(gshape)(_, _, head, bcoord));
  Tensor g = local_tile(m, product_each(shape(smem_layout)), make_coord(block, _0{}));
  return tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
}

// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// Named barriers (CUTLASS adds its reserved count). DqEmpty/DqFull: 256 consumers + the reducer warp; with
// p.dq_wg_barriers, one pair per consumer warpgroup (kBarDqEmpty/kBarDqFull for WG 0, kBarDqEmpty1/kBarDqFull1
// for WG 1), each 128 consumers + the reducer warp.
enum BarrierId : int {
  kBarPwg0 = 1, kBarPwg1 = 2, kBardSFree = 3, kBarDsReady = 4, kBarDqEmpty = 5, kBarDqFull = 6,
  kBarDqEmpty1 = 7, kBarDqFull1 = 8
};
constexpr int kDqBarThreads = 256 + 32;
constexpr int kDqWgBarThreads = 128 + 32;
__device__ __forceinline__ int dq_empty_bar(int cwg) { return cwg == 0 ? kBarDqEmpty : kBarDqEmpty1; }
__device__ __forceinline__ int dq_full_bar(int cwg) { return cwg == 0 ? kBarDqFull : kBarDqFull1; }

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

}  // namespace fmha_bwd_sm90
