// SM90 (Hopper) fused attention forward: warp-specialized TMA + wgmma kernel.
//
// CTA = 1 producer warpgroup (warp 0 loads by TMA, warp 1 schedules tiles) + kNWG consumer warpgroups
// (64 query rows each).
//   Scheduler: the coordinates of each tile the CTA runs (fmha_fwd_sm90_scheduler.cuh) into a two-slot ring.
//   Loader: per tile, Q (own mbarrier), then per key block (last block first) K(n) and V(n) into a
//             kStages-deep ring of full/empty mbarriers (separate K and V barriers).
//   Consumers: S = Q K^T (SS wgmma, Q and K in smem), online softmax in exp2 with the scale folded,
//             P converted in registers, O += P V (RS wgmma, V read MN-major from smem).
//             Intra-warpgroup overlap: QK of block j and PV of block j-1 are issued back to back;
//             the softmax of block j runs while PV(j-1) is in flight.
//   Epilogue: O through per-warp staging rows in smem (stmatrix in, 16-byte chunks out), LSE from
//             registers, both with row predicates (no TMA store: varlen tiles may cross a sequence end; the
//             caller provides no padding).
// Persistent: one CTA per SM runs tile after tile; its K/V ring and Q barrier carry over from tile to tile,
// so the loader fetches the next tile's Q and first K/V blocks while the consumers finish this tile's last
// blocks and its epilogue (a tile's fixed cost: fill, drain, epilogue, CTA start). Which tiles, in which
// order, and how they are assigned (statically, or dynamically where tiles differ in cost): the scheduler's
// header and run_fmha_fwd_sm90_impl below.
#pragma once

// wgmma N = 176 (the 128/128 unmasked key block) is one of CuTe's "extended" shapes; without this the
// selector splits it into narrower instructions. Only the fmha_fwd_sm90 TUs include this header.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/array.h>
#include <cutlass/numeric_types.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "common/cuda_check.h"
#include "sm90/fmha_fwd/fmha_fwd_sm90_config.h"
#include "sm90/fmha_fwd/fmha_fwd_sm90_params.h"
#include "sm90/fmha_fwd/fmha_fwd_sm90_scheduler.cuh"
#include "sm90/sm90_attn_common.cuh"
#include "sm90/sm90_seq_order.cuh"

namespace mla_sm90 {

using namespace cute;

// Schedule: the producer loads K(n), V(n) per block; each consumer warpgroup issues QK(n) and PV(n+1)
// back to back and rescales O right after PV(n+1) completes. FA3's alternatives (K(n) ahead of V(n+1)
// with the rescale deferred past the next QK issue; pingpong between the consumer warpgroups) measured
// no faster than it (docs/kernels/fmha_fwd_sm90.md).
template <class Element_, int kDqk_, int kDv_, int kBlockN_ = FmhaFwdSm90Config<kDqk_, kDv_>::kBlockN>
struct FwdTraits {
  using Element = Element_;
  using Cfg = FmhaFwdSm90Config<kDqk_, kDv_>;
  static constexpr int kDqk = kDqk_, kDv = kDv_;
  static constexpr int kBM = Cfg::kBlockM, kBN = kBlockN_;
  static constexpr int kNWG = Cfg::kConsumerWG, kStages = Cfg::kStages;
  static constexpr int kThreads = 128 * (kNWG + 1);
  static constexpr int kMmaWarps = 4 * kNWG;
  static_assert(kBM == 64 * kNWG, "each consumer warpgroup owns 64 query rows");

  using BM = Int<kBM>;
  using BN = Int<kBN>;
  using DQK = Int<kDqk>;
  using DV = Int<kDv>;

  using AtomLayout = Layout<Shape<Int<kNWG>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, BN, DQK>>(), AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, DV, BN>, GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));

  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BM, DQK>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<BM, DQK>{}));
  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BN, DQK>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<BN, DQK, Int<kStages>>{}));
  // V^T (Dv, BN) per stage, Dv contiguous (MN-major B operand of the PV wgmma); atoms ordered along BN
  // first so each 64-column chunk of V is one dense TMA box.
  using SmemAtomVt = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::MN, Element, DV, BN>());
  using SmemLayoutVt = decltype(tile_to_shape(SmemAtomVt{}, Shape<DV, BN, Int<kStages>>{}, Step<_2, _1, _3>{}));

  // Global tensors seen by TMA: (rows, d, head, batch) for Q/K, (d, rows, head, batch) for V^T.
  using GShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GStrideT = Stride<_1, int64_t, int64_t, int64_t>;

  using TMA_Q = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GShape{}, GStride{}),
      SmemLayoutQ{}, Shape<BM, DQK>{}, _1{}));
  using TMA_K = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GShape{}, GStride{}),
      take<0, 2>(SmemLayoutK{}), Shape<BN, DQK>{}, _1{}));
  using TMA_V = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GShape{}, GStrideT{}),
      take<0, 2>(SmemLayoutVt{}), Shape<DV, BN>{}, _1{}));

  // What tma_q / tma_k load: every column of the Q / K tile. FwdTraitsMla narrows these to the nope columns
  // and loads the rope columns through descriptors of their own (RopeLoads).
  static constexpr bool kMlaParts = false;
  using DQKLoad = DQK;
  using SmemLayoutQLoad = SmemLayoutQ;
  using SmemLayoutKLoad = SmemLayoutK;

  // The transaction bytes of a Q / K / V stage: the whole tile, however many descriptors fill it.
  static constexpr uint32_t kBytesQ = kBM * kDqk * sizeof(Element);
  static constexpr uint32_t kBytesK = kBN * kDqk * sizeof(Element);
  static constexpr uint32_t kBytesV = kBN * kDv * sizeof(Element);

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutVt>, 1024> v;
    // The epilogue's staging rows: 64 columns of O per pass, each consumer warp its own 16 rows (128 B each,
    // 16-byte chunks swizzled by row), so a warp stages and stores its rows with no barrier but __syncwarp.
    cute::array_aligned<Element, kBM * 64, 128> o_stage;
    alignas(16) uint64_t bar_q;
    uint64_t empty_q;  // the consumers' last QK of a tile has read Q: the next tile's Q may be loaded
    // The scheduler warp hands each tile's coordinates to the loader and the consumers through a two-slot
    // ring (h < 0 ends the loop): full = coordinates written, empty = the loader and every consumer warp
    // have read them.
    uint64_t tile_full[2];
    uint64_t tile_empty[2];
    uint64_t tile_wanted;  // the loader has issued its current tile's loads (or has none to issue)
    FwdTileCoord tile[2];
    uint64_t full_k[kStages];
    uint64_t empty_k[kStages];
    uint64_t full_v[kStages];
    uint64_t empty_v[kStages];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared storage exceeds the 227 KiB opt-in limit");

  struct KernelParams {
    FmhaFwdSm90Params p;
    TMA_Q tma_q;
    TMA_K tma_k;
    TMA_V tma_v;
    GShape shape_q, shape_k, shape_vt;
  };
};

// The MLA-native 192/128 forward: Q = [q_nope | q_pe] and K = [k_nope | k_pe] read where they are, each part
// through its own TMA descriptor, into the very smem tiles of FwdTraits<Element, 192, 128> (the consumers, the
// barriers and their transaction bytes are that kernel's). With the 128-byte swizzle a 192-column K-major tile
// is three 64-column chunks, chunk c at element c * rows * 64 (a multiple of 1024 elements = 2 KiB, so every
// chunk starts on the swizzle's 1 KiB period): columns 0..127 (nope) are chunks 0-1 and columns 128..191
// (rope) chunk 2, which the rope descriptor writes as a 64-column tile of its own. k_pe has one head (the rope
// key every kv head shares: its descriptor's head extent is 1 and its head coordinate 0) or Hkv.
template <class Element_>
struct FwdTraitsMla : FwdTraits<Element_, 192, 128> {
  using Base = FwdTraits<Element_, 192, 128>;
  using Element = Element_;
  using typename Base::BM;
  using typename Base::BN;
  using typename Base::GShape;
  using typename Base::GStride;
  using typename Base::SmemLayoutQ;
  using typename Base::SmemLayoutK;
  static constexpr int kDn = 128, kDr = 64;
  static constexpr int kBM = Base::kBM, kBN = Base::kBN, kDqk = Base::kDqk, kStages = Base::kStages;
  static_assert(kDn + kDr == kDqk && kDn % 64 == 0, "the nope/rope split falls on a 64-column swizzle chunk");
  using DN = Int<kDn>;
  using DR = Int<kDr>;

  // Columns [0, w) of the Q tile and of every K stage, as layouts of their own: the tile's layout composed
  // with the column-major coordinates of a narrower tile (the K stage stride stays the 192-column one). The
  // rope part is the same layout at a pointer kDn columns (kDn / 64 chunks) into the tile.
  template <class W>
  using QCols = decltype(composition(SmemLayoutQ{}, Layout<Shape<BM, W>, Stride<_1, BM>>{}));
  template <class W>
  using KCols = decltype(composition(SmemLayoutK{},
                                     Layout<Shape<BN, W, Int<kStages>>, Stride<_1, BN, Int<kBN * kDqk>>>{}));
  using SmemLayoutQPe = QCols<DR>;
  using SmemLayoutKPe = KCols<DR>;

  static constexpr bool kMlaParts = true;
  using DQKLoad = DN;
  using SmemLayoutQLoad = QCols<DN>;
  using SmemLayoutKLoad = KCols<DN>;

  template <class SmemLayout, class Cols>
  using TmaOf = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GShape{}, GStride{}),
      SmemLayout{}, Cols{}, _1{}));
  using TMA_Q = TmaOf<SmemLayoutQLoad, Shape<BM, DN>>;
  using TMA_K = TmaOf<decltype(take<0, 2>(SmemLayoutKLoad{})), Shape<BN, DN>>;
  using TMA_QPe = TmaOf<SmemLayoutQPe, Shape<BM, DR>>;
  using TMA_KPe = TmaOf<decltype(take<0, 2>(SmemLayoutKPe{})), Shape<BN, DR>>;

  // FwdTraits' parameters with tma_q / tma_k (and shape_q / shape_k) over q_nope / k_nope, then the rope parts.
  struct KernelParams {
    FmhaFwdSm90Params p;
    TMA_Q tma_q;
    TMA_K tma_k;
    typename Base::TMA_V tma_v;
    GShape shape_q, shape_k, shape_vt;
    TMA_QPe tma_q_pe;
    TMA_KPe tma_k_pe;
    GShape shape_q_pe, shape_k_pe;
    int k_pe_shared;  // k_pe has one head: its head coordinate is 0 for every kv head
  };
};

// The rope columns of a tile's Q and K, loaded by the producer right after tma_q / tma_k load the rest, onto
// the same barrier (whose transaction count is the whole tile's). Nothing for traits whose tma_q / tma_k load
// whole tiles. The coordinates are the nope part's: the same rows, query head, kv head (or 0) and batch.
template <class KT, bool = KT::kMlaParts>
struct RopeLoads {
  CUTE_DEVICE RopeLoads(typename KT::KernelParams const&, typename KT::SharedStorage&, FwdTile const&, int, int,
                        int) {}
  CUTE_DEVICE void q(uint64_t&) const {}
  CUTE_DEVICE void k(uint64_t&, int, int) const {}
};

template <class KT>
struct RopeLoads<KT, true> {
  using BM = typename KT::BM;
  using BN = typename KT::BN;
  using DR = typename KT::DR;
  typename KT::KernelParams const& kp;
  typename KT::SharedStorage& ss;
  int h, h_pe, b_q, b_k, offset_q, offset_k, m_block;

  CUTE_DEVICE RopeLoads(typename KT::KernelParams const& kp_, typename KT::SharedStorage& ss_, FwdTile const& tile,
                        int h_kv, int b_tma_q, int b_tma_k)
      : kp(kp_), ss(ss_), h(tile.h), h_pe(kp_.k_pe_shared ? 0 : h_kv), b_q(b_tma_q), b_k(b_tma_k),
        offset_q(int(tile.si.offset_q)), offset_k(int(tile.si.offset_k)), m_block(tile.m_block) {}

  CUTE_DEVICE void q(uint64_t& bar) const {
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data() + KT::kBM * KT::kDn), typename KT::SmemLayoutQPe{});
    Tensor mQ = kp.tma_q_pe.get_tma_tensor(kp.shape_q_pe)(_, _, h, b_q);
    Tensor gQ = local_tile(domain_offset(make_coord(offset_q, _0{}), mQ), Shape<BM, DR>{}, make_coord(m_block, _0{}));
    auto [tQg, tQs] = tma_partition(kp.tma_q_pe, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    copy(kp.tma_q_pe.with(bar, 0), tQg, tQs);
  }

  // Key block n into ring stage `stage`.
  CUTE_DEVICE void k(uint64_t& bar, int n, int stage) const {
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data() + KT::kBN * KT::kDn), typename KT::SmemLayoutKPe{});
    Tensor mK = kp.tma_k_pe.get_tma_tensor(kp.shape_k_pe)(_, _, h_pe, b_k);
    Tensor gK = local_tile(domain_offset(make_coord(offset_k, _0{}), mK), Shape<BN, DR>{}, make_coord(_, _0{}));
    auto [tKg, tKs] = tma_partition(kp.tma_k_pe, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    copy(kp.tma_k_pe.with(bar, 0), tKg(_, n), tKs(_, stage));
  }
};

// Online softmax state for the rows a thread holds (R rows, quad-shared).
template <int R>
struct OnlineSoftmax {
  float row_max[R];
  float row_sum[R];  // thread-partial, quad-reduced at the end

  CUTE_DEVICE void init() {
    CUTE_UNROLL
    for (int r = 0; r < R; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
  }

  // S (rows, cols) view of the fp32 scores; turned into unnormalised probabilities in place.
  // alpha: factor to rescale the previous O/sum by.
  template <class TS>
  CUTE_DEVICE void step(TS& S, float c, float (&alpha)[R]) {
    CUTE_UNROLL
    for (int r = 0; r < R; ++r) {
      float m_old = row_max[r];
      // The row max in four independent chains (a max is exact in any order): one chain of 32 dependent
      // FMNMX per row was the softmax's longest latency path.
      constexpr int kCols = decltype(size<1>(S))::value;
      static_assert(kCols % 4 == 0);
      float mx4[4] = {m_old, S(r, 0), S(r, 1), S(r, 2)};
      mx4[0] = fmaxf(mx4[0], S(r, 3));
      CUTE_UNROLL
      for (int j = 4; j < kCols; j += 4) {
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) mx4[i] = fmaxf(mx4[i], S(r, j + i));
      }
      float mx = quad_max(fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3])));
      row_max[r] = mx;
      // A row with no visible key so far keeps -inf; subtract 0 then so p = exp2(-inf) = 0, no NaN.
      float mc = (mx == -INFINITY) ? 0.f : mx * c;
      alpha[r] = fast_exp2(m_old * c - mc);  // m_old = -inf -> 0
      float s = 0.f;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(S); ++j) {
        float pj = fast_exp2(fmaf(S(r, j), c, -mc));
        S(r, j) = pj;
        s += pj;
      }
      row_sum[r] = row_sum[r] * alpha[r] + s;
    }
  }
};

// ------------------------------------------------------------------------------------------------
// Launch order: grouped_tile (sm90_attn_common.cuh) over (head-batch pair hb = h + hq * b, M-block), with
// rank r -> M-block num_m - 1 - r (the longest under a causal mask first). With every head interleaved
// (a single group of all pairs) the H=128, S=4096 causal 192/128 forward ran at 87% of DRAM bandwidth
// (ncu, H200): resident CTAs of ~130 different heads, each streaming its own K/V.

template <class KT>
__global__ void __launch_bounds__(KT::kThreads, 1)
fmha_fwd_sm90_kernel(CUTE_GRID_CONSTANT typename KT::KernelParams const kp) {
  using Element = typename KT::Element;
  constexpr int kBM = KT::kBM, kBN = KT::kBN, kStages = KT::kStages;
  using BM = typename KT::BM;
  using BN = typename KT::BN;
  using DQK = typename KT::DQK;
  using DV = typename KT::DV;
  using DQKLoad = typename KT::DQKLoad;
  using SharedStorage = typename KT::SharedStorage;
  using ClusterBarrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);
  FmhaFwdSm90Params const& p = kp.p;

  int const warp_idx = cutlass::canonical_warp_idx_sync();
  int const wg_idx = cutlass::canonical_warp_group_idx();
  int const lane = threadIdx.x % 32;

  int const num_hb = p.hq * p.batch;
  int const num_m = p.num_m_blocks;
  bool const varlen = p.cu_seqlens_q != nullptr;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename KT::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename KT::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename KT::SmemLayoutVt{});

  if (warp_idx == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
    if constexpr (KT::kMlaParts) {
      cute::prefetch_tma_descriptor(kp.tma_q_pe.get_tma_descriptor());
      cute::prefetch_tma_descriptor(kp.tma_k_pe.get_tma_descriptor());
    }
    TxBarrier::init(&ss.bar_q, 1);
    ClusterBarrier::init(&ss.empty_q, KT::kMmaWarps);
    ClusterBarrier::init(&ss.tile_full[0], 1);
    ClusterBarrier::init(&ss.tile_full[1], 1);
    ClusterBarrier::init(&ss.tile_empty[0], KT::kMmaWarps + 1);  // every consumer warp and the loader
    ClusterBarrier::init(&ss.tile_empty[1], KT::kMmaWarps + 1);
    ClusterBarrier::init(&ss.tile_wanted, 1);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      TxBarrier::init(&ss.full_k[s], 1);
      TxBarrier::init(&ss.full_v[s], 1);
      ClusterBarrier::init(&ss.empty_k[s], KT::kMmaWarps);
      ClusterBarrier::init(&ss.empty_v[s], KT::kMmaWarps);
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (wg_idx == 0) {
    // ================================ producer ================================
    cutlass::arch::warpgroup_reg_dealloc<KT::Cfg::kProducerRegs>();
    if (warp_idx == 1) {
      // Scheduler warp: tile coordinates into the two-slot ring, read by the loader and every consumer warp
      // (FwdTileScheduler's decode and next are warp-collective).
      FwdTileScheduler<kBM> sched(p, num_hb, num_m);
      int t = sched.first();
      for (uint32_t j = 0;; ++j) {
        if (j > 0) {
          // Tile j is taken when the loader has issued tile j - 1's loads, not earlier: under dynamic
          // assignment a tile taken a tile ahead waits behind this CTA's current one while another SM may
          // idle (at B=1 H=16 S=16384 causal, taking tiles as their slot freed measured 9% slower than one CTA
          // per tile).
          if (lane == 0) ClusterBarrier::wait(&ss.tile_wanted, (j - 1) & 1u);
          __syncwarp();
          t = sched.next(t);
        }
        FwdTileCoord const coord = sched.decode(t);
        int const slot = int(j & 1u);
        if (lane == 0) {
          ClusterBarrier::wait(&ss.tile_empty[slot], ((j >> 1) & 1u) ^ 1u);  // from the completed phase
          ss.tile[slot] = coord;
          ClusterBarrier::arrive(&ss.tile_full[slot]);
        }
        __syncwarp();
        if (coord.h < 0) break;
      }
    } else if (warp_idx == 0 && cute::elect_one_sync()) {
      // Loader: K(n), V(n) per block, one stage counter for both rings (block n uses the same stage in both);
      // the rings and the Q barrier's phase run on from one tile to the next.
      int stage = 0;
      uint32_t phase = 1;    // the producer waits on "empty" starting from the completed phase
      uint32_t q_phase = 1;  // likewise for "Q empty"
      int slot = 0;
      uint32_t slot_phase = 0;
      for (;;) {
        ClusterBarrier::wait(&ss.tile_full[slot], slot_phase);
        FwdTileCoord const coord = ss.tile[slot];
        ClusterBarrier::arrive(&ss.tile_empty[slot]);
        if (++slot == 2) { slot = 0; slot_phase ^= 1; }
        if (coord.h < 0) break;
        FwdTile const tile = FwdTile::at<kBM, kBN>(p, coord);
        if (!tile.template loads<kBM>()) {
          ClusterBarrier::arrive(&ss.tile_wanted);
          continue;
        }
        int const h_kv = tile.h / (p.hq / p.hkv);
        int const b_tma_q = p.cu_seqlens_q != nullptr ? 0 : tile.b;
        int const b_tma_k = p.cu_seqlens_k != nullptr ? 0 : tile.b;
        Tensor mQ = kp.tma_q.get_tma_tensor(kp.shape_q)(_, _, tile.h, b_tma_q);
        Tensor gQ = local_tile(domain_offset(make_coord(int(tile.si.offset_q), _0{}), mQ), Shape<BM, DQKLoad>{},
                               make_coord(tile.m_block, _0{}));
        Tensor mK = kp.tma_k.get_tma_tensor(kp.shape_k)(_, _, h_kv, b_tma_k);
        Tensor gK = local_tile(domain_offset(make_coord(int(tile.si.offset_k), _0{}), mK), Shape<BN, DQKLoad>{},
                               make_coord(_, _0{}));  // (BN, D, nblk)
        Tensor mVt = kp.tma_v.get_tma_tensor(kp.shape_vt)(_, _, h_kv, b_tma_k);
        Tensor gVt = local_tile(domain_offset(make_coord(_0{}, int(tile.si.offset_k)), mVt), Shape<DV, BN>{},
                                make_coord(_0{}, _));  // (Dv, BN, nblk)

        // sQ / sK themselves, or their nope columns where RopeLoads loads the rest
        Tensor sQl = make_tensor(make_smem_ptr(ss.q.data()), typename KT::SmemLayoutQLoad{});
        Tensor sKl = make_tensor(make_smem_ptr(ss.k.data()), typename KT::SmemLayoutKLoad{});
        auto [tQg, tQs] = tma_partition(kp.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQl), group_modes<0, 2>(gQ));
        auto [tKg, tKs] = tma_partition(kp.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sKl), group_modes<0, 2>(gK));
        auto [tVg, tVs] = tma_partition(kp.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sVt), group_modes<0, 2>(gVt));
        RopeLoads<KT> const rope(kp, ss, tile, h_kv, b_tma_q, b_tma_k);

        ClusterBarrier::wait(&ss.empty_q, q_phase);
        q_phase ^= 1;
        TxBarrier::arrive_and_expect_tx(&ss.bar_q, KT::kBytesQ);
        copy(kp.tma_q.with(ss.bar_q, 0), tQg, tQs);
        rope.q(ss.bar_q);

        CUTE_NO_UNROLL
        for (int n = tile.n_max - 1; n >= tile.n_min; --n) {
          ClusterBarrier::wait(&ss.empty_k[stage], phase);
          TxBarrier::arrive_and_expect_tx(&ss.full_k[stage], KT::kBytesK);
          copy(kp.tma_k.with(ss.full_k[stage], 0), tKg(_, n), tKs(_, stage));
          rope.k(ss.full_k[stage], n, stage);
          ClusterBarrier::wait(&ss.empty_v[stage], phase);
          TxBarrier::arrive_and_expect_tx(&ss.full_v[stage], KT::kBytesV);
          copy(kp.tma_v.with(ss.full_v[stage], 0), tVg(_, n), tVs(_, stage));
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
        ClusterBarrier::arrive(&ss.tile_wanted);  // every load of this tile is issued: the next tile, please
      }
    }
  } else {
    // ================================ consumers ================================
    cutlass::arch::warpgroup_reg_alloc<KT::Cfg::kConsumerRegs>();
    int const tid = threadIdx.x - 128;

    typename KT::TiledMmaQK mma_qk;
    typename KT::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(tid);
    auto thr_pv = mma_pv.get_thread_slice(tid);
    // The smem operands' descriptors depend on the warpgroup alone: partitioned for the warpgroup's first thread,
    // from canonical_warp_group_idx (broadcast from lane 0, so the compiler knows it is warp-uniform), they are
    // computed in uniform registers. Partitioned by `tid`, every descriptor was computed per thread and moved to
    // a uniform register before each wgmma (R2UR alone was 11% of the executed instructions). The ring stages
    // that index tSrK / tOrV go through uniform() for the same reason.
    auto wg_qk = mma_qk.get_thread_slice((wg_idx - 1) * 128);
    auto wg_pv = mma_pv.get_thread_slice((wg_idx - 1) * 128);

    Tensor tSrQ = wg_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
    Tensor tSrK = wg_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = wg_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<BM, BN>{});
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<BM, DV>{});
    Tensor tOrP = make_tensor<Element>(acc_to_A_regs(tSrS.layout()));

    Tensor S_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
    Tensor O_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
    Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<BM, BN>{}));
    Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
    constexpr int R = decltype(size<0>(S_rc))::value;

    float const c = p.softmax_scale * float(M_LOG2E);
    auto release = [&](uint64_t* bar) {
      if (lane == 0) ClusterBarrier::arrive(bar);
    };
    // The K/V rings and the Q barrier's phase run on from one tile to the next (as the producer's do).
    // Tile n of this CTA is in ring slot n % 2 with phase n / 2 % 2 (one counter: the consumers' loop state
    // is at the register limit).
    int stage = 0;
    uint32_t phase = 0;
    uint32_t q_phase = 0;

    for (uint32_t tiles_read = 0;; ++tiles_read) {
      int const tile_slot = int(tiles_read & 1u);
      ClusterBarrier::wait(&ss.tile_full[tile_slot], (tiles_read >> 1) & 1u);
      FwdTileCoord const coord = ss.tile[tile_slot];
      __syncwarp();
      if (lane == 0) ClusterBarrier::arrive(&ss.tile_empty[tile_slot]);
      if (coord.h < 0) break;
      FwdTile const tile = FwdTile::at<kBM, kBN>(p, coord);
      if (!tile.template has_rows<kBM>()) continue;  // a guard: every scheduled tile has rows
      MaskInfo const& mi = tile.mi;
      int const m_block = tile.m_block, n_min = tile.n_min, n_max = tile.n_max;
      int const row0 = m_block * kBM;
      // Key blocks from here up cross seqlen_k or the causal diagonal (the loop visits them first): one
      // comparison per block instead of block_needs_mask's 64-bit bound arithmetic on the softmax's critical path.
      int const n_masked = uniform(mi.template first_masked_block<kBM, kBN>(m_block));

      OnlineSoftmax<R> sm;
      sm.init();
      clear(tOrO);

      if (n_max > n_min) {
        TxBarrier::wait(&ss.bar_q, q_phase);
        q_phase ^= 1;
        float alpha[R];
        // O *= alpha (row-wise), after PV(n+1) completes.
        auto rescale_o = [&]() {
          CUTE_UNROLL
          for (int r = 0; r < R; ++r) {
            CUTE_UNROLL
            for (int j = 0; j < size<1>(O_rc); ++j) O_rc(r, j) *= alpha[r];
          }
        };

        // ---- first (last-index) key block: peeled, no PV yet ----
        int n = n_max - 1;
        TxBarrier::wait(&ss.full_k[stage], phase);
        wg_gemm<false>(mma_qk, tSrQ, tSrK(_, _, _, uniform(stage)), tSrS, true);
        warpgroup_wait<0>();
        release(&ss.empty_k[stage]);
        if (n == n_min) release(&ss.empty_q);  // the tile's last QK has read Q
        if (n >= n_masked) apply_mask(S_rc, cS_rc, mi, row0, n * kBN);
        sm.step(S_rc, c, alpha);
        convert_frag(tSrS, tOrP);
        int v_stage = stage;
        uint32_t v_phase = phase;
        if (++stage == kStages) { stage = 0; phase ^= 1; }
        bool first_pv = true;

        // ---- steady state: QK(n) and PV(n+1) in flight together ----
        for (n = n_max - 2; n >= n_min; --n) {
          TxBarrier::wait(&ss.full_k[stage], phase);
          wg_gemm<false>(mma_qk, tSrQ, tSrK(_, _, _, uniform(stage)), tSrS, true);
          TxBarrier::wait(&ss.full_v[v_stage], v_phase);
          wg_gemm<true>(mma_pv, tOrP, tOrV(_, _, _, uniform(v_stage)), tOrO, first_pv);
          warpgroup_wait<1>();
          release(&ss.empty_k[stage]);
          if (n == n_min) release(&ss.empty_q);
          // The softmax is written out in both arms of the mask branch, so that it ends the branch's basic
          // block and PV(n+1)'s wait opens the next one. ptxas moves a wgmma wait to the top of the basic block
          // that holds it: with one softmax after the branch (in the wait's block), the SASS waited for
          // PV(n+1) before the softmax, and the softmax never ran under this warpgroup's own PV.
          if (n >= n_masked) {
            apply_mask(S_rc, cS_rc, mi, row0, n * kBN);
            sm.step(S_rc, c, alpha);
          } else {
            sm.step(S_rc, c, alpha);
          }
          warpgroup_wait<0>();
          release(&ss.empty_v[v_stage]);
          rescale_o();
          convert_frag(tSrS, tOrP);
          v_stage = stage;
          v_phase = phase;
          if (++stage == kStages) { stage = 0; phase ^= 1; }
          first_pv = false;
        }

        // ---- last PV ----
        TxBarrier::wait(&ss.full_v[v_stage], v_phase);
        wg_gemm<true>(mma_pv, tOrP, tOrV(_, _, _, uniform(v_stage)), tOrO, first_pv);
        warpgroup_wait<0>();
        release(&ss.empty_v[v_stage]);
      }

      // ---- finalize: normalise, LSE ----
      float lse_r[R];
      CUTE_UNROLL
      for (int r = 0; r < R; ++r) {
        float sum = quad_sum(sm.row_sum[r]);
        bool dead = !(sum > 0.f);  // no visible key (0) or NaN
        float inv = dead ? 0.f : 1.f / sum;
        lse_r[r] = dead ? -INFINITY : sm.row_max[r] * p.softmax_scale + logf(sum);
        CUTE_UNROLL
        for (int j = 0; j < size<1>(O_rc); ++j) O_rc(r, j) *= inv;
      }

      // ---- epilogue: O through smem staging rows, LSE from registers, both with row predicates ----
      int const rows_left = tile.si.seqlen_q - row0;
      int const b_dense = varlen ? 0 : tile.b;
      Element* o_tile = static_cast<Element*>(p.o) + (tile.si.offset_q + int64_t(row0)) * p.o_row_stride +
                        int64_t(tile.h) * p.o_head_stride + int64_t(b_dense) * p.o_batch_stride;
      Tensor rO = make_tensor<Element>(tOrO.layout());
      convert_frag(tOrO, rO);
      if (p.staged_epilogue) {
        // O leaves each consumer warp through its own staging rows in smem, 64 columns per pass: in by stmatrix
        // (a thread's 4 consecutive 32-bit pairs of a 16-column block, rows q / q + 8 of the low then the high 8
        // columns, are its parts of that block's four 8x8 matrices), back as 16-byte chunks, out as whole 128-byte
        // row segments (8 lanes per row) under the row predicate (docs/kernels/fmha_fwd_sm90.md, Epilogue).
        static_assert(KT::kDv % 64 == 0, "the staged epilogue takes O 64 columns at a time");
        int const warp_row0 = (warp_idx - 4) * 16;  // consumer warp w (warps 4..) holds rows 16 (w - 4) ..
        uint32_t const* rO32 = reinterpret_cast<uint32_t const*>(rO.data());
        char* stage_rows = reinterpret_cast<char*>(ss.o_stage.data()) + warp_row0 * 128;
        uint32_t const stage_s = uint32_t(__cvta_generic_to_shared(stage_rows));
        // stmatrix: lanes 8m..8m+7 address the rows of matrix m (rows 0-7 / 8-15 of the block, its low / high 8
        // columns). 16-byte chunk c of row r sits at chunk c ^ (r % 8), so that neither a matrix's 8 rows nor a
        // row's 8 chunks share banks. The __syncwarp between the stmatrix and the reads orders them.
        int const m = lane / 8;
        int const st_row = (m & 1) * 8 + lane % 8;
        CUTE_UNROLL
        for (int pass = 0; pass < KT::kDv / 64; ++pass) {
          __syncwarp();  // the previous pass's reads are done
          CUTE_UNROLL
          for (int c = 0; c < 4; ++c) {
            int const cb = pass * 4 + c;
            int const chunk = c * 2 + (m >> 1);
            uint32_t const addr = stage_s + st_row * 128 + ((chunk ^ (st_row & 7)) << 4);
            asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                         "r"(rO32[4 * cb]), "r"(rO32[4 * cb + 1]), "r"(rO32[4 * cb + 2]), "r"(rO32[4 * cb + 3]));
          }
          __syncwarp();
          CUTE_UNROLL
          for (int k = 0; k < 4; ++k) {
            int const idx = lane + 32 * k;
            int const rr = idx / 8, chunk = idx % 8;
            uint4 const v = *reinterpret_cast<uint4 const*>(stage_rows + rr * 128 + ((chunk ^ (rr & 7)) << 4));
            if (warp_row0 + rr < rows_left) {
              *reinterpret_cast<uint4*>(o_tile + int64_t(warp_row0 + rr) * p.o_row_stride + pass * 64 + chunk * 8) = v;
            }
          }
        }
      } else {
        // From the accumulator layout (fwd_with_options' staged_epilogue False, the other side of the A/B that chose
        // the staged one): a 4-byte store per column pair, each warp instruction 8 rows in 16-byte pieces.
        Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<BM, DV>{}));
        CUTE_UNROLL
        for (int i = 0; i < size(rO); i += 2) {
          int r = get<0>(cO(i));
          int col = get<1>(cO(i));
          if (r < rows_left) {
            *reinterpret_cast<uint32_t*>(o_tile + int64_t(r) * p.o_row_stride + col) =
                *reinterpret_cast<uint32_t const*>(&rO(i));
          }
        }
      }
      if (lane % 4 == 0) {
        float* lse_tile = p.lse + int64_t(tile.h) * p.lse_head_stride + int64_t(b_dense) * p.lse_batch_stride +
                          tile.si.offset_q + row0;
        CUTE_UNROLL
        for (int r = 0; r < R; ++r) {
          int row = get<0>(cS_rc(r, 0));
          if (row < rows_left) lse_tile[row] = lse_r[r];
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// (head, batch) pairs per L2 group (grouped_tile): as many as have their K/V in a quarter of the device's L2.
// Smaller groups measured faster (H200, 60 MB L2, B=2 H=16 S=8192, kernel TF/s over three runs, 2 / 6-7 (half
// the L2) / 8 pairs per group: 192/128 649 / 643 / 635, 128/128 617 / 604 / 601; all heads interleaved: 593 /
// 561). A quarter of the L2 gives 3 pairs there: 642 / 608.
// `forced` (FmhaFwdSm90Options::l2_head_group, from fwd_with_options) overrides it: N pairs per group, 0 all
// heads interleaved; negative: this choice.
inline int l2_head_group(FmhaFwdSm90Params const& p, int num_hb, int forced, int l2_bytes) {
  if (forced == 0) return num_hb;
  if (forced > 0) return forced < num_hb ? forced : num_hb;
  // K/V bytes per query head (GQA: a K/V head serves hq / hkv consecutive query heads)
  double const per_head = double(p.seqlen_k) * (p.head_dim_qk + p.head_dim_v) * 2.0 * p.hkv / p.hq;
  int64_t g = per_head > 0 ? int64_t(0.25 * l2_bytes / per_head) : num_hb;
  if (g < 1) g = 1;
  return g < num_hb ? int(g) : num_hb;
}

// ------------------------------------------------------------------------------------------------
// The batch extent of the global tensors TMA sees: one entry for packed (varlen) tensors, whose batch stride is
// then never used and is kept a valid multiple of 16 bytes.
struct FwdBatch {
  bool varlen_q, varlen_k;
  int nb_q, nb_k;
  explicit FwdBatch(FmhaFwdSm90Params const& p)
      : varlen_q(p.cu_seqlens_q != nullptr), varlen_k(p.cu_seqlens_k != nullptr),
        nb_q(varlen_q ? 1 : p.batch), nb_k(varlen_k ? 1 : p.batch) {}
  int64_t q_stride(int64_t s) const { return varlen_q ? 8 : s; }
  int64_t k_stride(int64_t s) const { return varlen_k ? 8 : s; }
};

// What every launch shares once its descriptors are made: the grid over the tiles, the L2 launch groups, the
// scheduler's choice and the kernel.
template <class KT>
cudaError_t launch_fmha_fwd_sm90(FmhaFwdSm90Params const& p, typename KT::KernelParams& kp,
                                 FmhaFwdSm90Options const& opt, mla::DeviceInfo const& dev, cudaStream_t stream) {
  int const num_m = (p.seqlen_q + KT::kBM - 1) / KT::kBM;
  if (num_m == 0 || p.batch == 0 || p.hq == 0) return cudaSuccess;
  int const num_hb = p.hq * p.batch;
  if (int64_t(num_hb) * num_m >= (int64_t(1) << 31)) return cudaErrorInvalidConfiguration;
  int const num_tiles = num_hb * num_m;
  kp.p.l2_head_group = l2_head_group(p, num_hb, opt.l2_head_group, dev.l2_bytes);
  kp.p.num_m_blocks = num_m;
  kp.p.staged_epilogue = opt.staged_epilogue;
  // A persistent grid, one CTA per SM (one fits: the shared storage takes most of an SM). Unmasked dense
  // tiles all cost the same and are assigned statically (CTA c: c, c + gridDim.x, ...). Causal tiles cost 1
  // to num_m key blocks and varlen ones up to the longest sequence's: they are assigned dynamically
  // (fmha_fwd_sm90_scheduler.cuh), which measured 3-18% faster than one CTA per tile on causal problems at
  // S <= 4096 and level at S = 16384, where a static assignment was 24% slower (some CTAs draw mostly long
  // tiles). Varlen tiles exist only as a list of the sequences' own M-blocks, so varlen is always
  // persistent. opt.ctas forces a grid of that many CTAs, opt.scheduler the assignment.
  bool const dynamic = fmha_fwd_sm90_dynamic_tiles(p, opt);
  if (dynamic && p.tile_counter == nullptr) return cudaErrorInvalidValue;
  // The order of a packed batch's sequences (longest first), and with it the dynamic counter's zero.
  if (p.seq_order != nullptr) MLA_CUDA_TRY(launch_seq_order(p, p.tile_counter, stream));
  int const ctas = opt.ctas > 0 ? opt.ctas : dev.sm_count;
  dim3 grid(unsigned(ctas < num_tiles ? ctas : num_tiles), 1, 1);
  dim3 block(KT::kThreads, 1, 1);
  MLA_CUDA_TRY(mla::opt_in_dynamic_smem<fmha_fwd_sm90_kernel<KT>>(KT::kSmemBytes));
  fmha_fwd_sm90_kernel<KT><<<grid, block, KT::kSmemBytes, stream>>>(kp);
  return cudaGetLastError();
}

// A (rows, d, heads, batch) global tensor as the Q / K descriptors read it (d unit-stride).
template <class KT>
auto fwd_gmem(void const* ptr, int rows, int d, int heads, int nb, int64_t row_stride, int64_t head_stride,
              int64_t batch_stride) {
  using Element = typename KT::Element;
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                     typename KT::GShape(make_shape(int32_t(rows), int32_t(d), int32_t(heads), int32_t(nb))),
                     make_stride(row_stride, _1{}, head_stride, batch_stride));
}

// V^T (Dv, rows, heads, batch) of a launch, as tma_v reads it.
template <class KT>
auto fwd_gmem_vt(FmhaFwdSm90Params const& p, FwdBatch const& bat) {
  using Element = typename KT::Element;
  typename KT::GShape shape = make_shape(int32_t(KT::kDv), int32_t(p.rows_k), int32_t(p.hkv), int32_t(bat.nb_k));
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v)), shape,
                     make_stride(_1{}, p.v_row_stride, p.v_head_stride, bat.k_stride(p.v_batch_stride)));
}

template <class Element, int kDqk, int kDv, int kBlockN = FmhaFwdSm90Config<kDqk, kDv>::kBlockN>
cudaError_t run_fmha_fwd_sm90_impl(FmhaFwdSm90Params const& p, FmhaFwdSm90Options const& opt,
                                   mla::DeviceInfo const& dev, cudaStream_t stream) {
  using KT = FwdTraits<Element, kDqk, kDv, kBlockN>;
  FwdBatch const bat(p);
  Tensor mQ = fwd_gmem<KT>(p.q, p.rows_q, kDqk, p.hq, bat.nb_q, p.q_row_stride, p.q_head_stride,
                           bat.q_stride(p.q_batch_stride));
  Tensor mK = fwd_gmem<KT>(p.k, p.rows_k, kDqk, p.hkv, bat.nb_k, p.k_row_stride, p.k_head_stride,
                           bat.k_stride(p.k_batch_stride));
  Tensor mVt = fwd_gmem_vt<KT>(p, bat);

  typename KT::KernelParams kp{
      p,
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename KT::SmemLayoutQ{}, Shape<typename KT::BM, typename KT::DQK>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename KT::SmemLayoutK{}), Shape<typename KT::BN, typename KT::DQK>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mVt, take<0, 2>(typename KT::SmemLayoutVt{}), Shape<typename KT::DV, typename KT::BN>{}, _1{}),
      mQ.shape(), mK.shape(), mVt.shape()};
  return launch_fmha_fwd_sm90<KT>(p, kp, opt, dev, stream);
}

// The MLA-native 192/128 launch: p describes q_nope / k_nope (p.q, p.k and their strides; p.head_dim_qk = 192), rope the
// rope parts. Its tiles are those of the 192/128 launch on the concatenated q / k, masked or not (that config
// has one key block), so the two compute the same scores in the same order.
template <class Element>
cudaError_t run_fmha_fwd_sm90_mla(FmhaFwdSm90Params const& p, FmhaFwdSm90RopeParts const& rope,
                                  FmhaFwdSm90Options const& opt, mla::DeviceInfo const& dev, cudaStream_t stream) {
  using KT = FwdTraitsMla<Element>;
  static_assert(KT::Cfg::kBlockNNoMask == KT::kBN, "the concatenated 192/128 launch uses one key block width");
  FwdBatch const bat(p);
  Tensor mQ = fwd_gmem<KT>(p.q, p.rows_q, KT::kDn, p.hq, bat.nb_q, p.q_row_stride, p.q_head_stride,
                           bat.q_stride(p.q_batch_stride));
  Tensor mK = fwd_gmem<KT>(p.k, p.rows_k, KT::kDn, p.hkv, bat.nb_k, p.k_row_stride, p.k_head_stride,
                           bat.k_stride(p.k_batch_stride));
  Tensor mQpe = fwd_gmem<KT>(rope.q_pe, p.rows_q, KT::kDr, p.hq, bat.nb_q, rope.q_pe_row_stride,
                             rope.q_pe_head_stride, bat.q_stride(rope.q_pe_batch_stride));
  Tensor mKpe = fwd_gmem<KT>(rope.k_pe, p.rows_k, KT::kDr, rope.k_pe_heads, bat.nb_k, rope.k_pe_row_stride,
                             rope.k_pe_head_stride, bat.k_stride(rope.k_pe_batch_stride));
  Tensor mVt = fwd_gmem_vt<KT>(p, bat);

  using BM = typename KT::BM;
  using BN = typename KT::BN;
  typename KT::KernelParams kp{
      p,
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename KT::SmemLayoutQLoad{}, Shape<BM, typename KT::DN>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename KT::SmemLayoutKLoad{}), Shape<BN, typename KT::DN>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mVt, take<0, 2>(typename KT::SmemLayoutVt{}), Shape<typename KT::DV, BN>{}, _1{}),
      mQ.shape(), mK.shape(), mVt.shape(),
      make_tma_copy(SM90_TMA_LOAD{}, mQpe, typename KT::SmemLayoutQPe{}, Shape<BM, typename KT::DR>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mKpe, take<0, 2>(typename KT::SmemLayoutKPe{}), Shape<BN, typename KT::DR>{}, _1{}),
      mQpe.shape(), mKpe.shape(),
      rope.k_pe_heads == 1 ? 1 : 0};
  return launch_fmha_fwd_sm90<KT>(p, kp, opt, dev, stream);
}

// Unmasked problems take the config's wider key block where it has one (kBlockNNoMask), unless the options say not.
template <class Element, int kDqk, int kDv>
cudaError_t run_fmha_fwd_sm90(FmhaFwdSm90Params const& p, FmhaFwdSm90Options const& opt, mla::DeviceInfo const& dev,
                              cudaStream_t stream) {
  using Cfg = FmhaFwdSm90Config<kDqk, kDv>;
  if constexpr (Cfg::kBlockNNoMask != Cfg::kBlockN) {
    if (!p.causal && opt.wide_keys) return run_fmha_fwd_sm90_impl<Element, kDqk, kDv, Cfg::kBlockNNoMask>(p, opt, dev, stream);
  }
  return run_fmha_fwd_sm90_impl<Element, kDqk, kDv>(p, opt, dev, stream);
}

}  // namespace mla_sm90

#define MLA_FMHA_FWD_SM90_DEFINE_LAUNCHER(DQK, DV)                                                   \
  cudaError_t fmha_fwd_sm90_launch_##DQK##_##DV(FmhaFwdSm90Params const& p, FmhaFwdSm90Options const& opt,  \
                                                 mla::DeviceInfo const& dev, cudaStream_t stream) {          \
    return p.is_bf16 ? mla_sm90::run_fmha_fwd_sm90<cutlass::bfloat16_t, DQK, DV>(p, opt, dev, stream)      \
                     : mla_sm90::run_fmha_fwd_sm90<cutlass::half_t, DQK, DV>(p, opt, dev, stream);         \
  }

// The MLA-native launcher (fmha_fwd_sm90_hdim192_mla.cu), one for both 16-bit types.
#define MLA_FMHA_FWD_SM90_DEFINE_MLA_LAUNCHER()                                                                \
  cudaError_t fmha_fwd_sm90_launch_mla_192_128(FmhaFwdSm90Params const& p, FmhaFwdSm90RopeParts const& rope,   \
                                               FmhaFwdSm90Options const& opt, mla::DeviceInfo const& dev,      \
                                               cudaStream_t stream) {                                          \
    return p.is_bf16 ? mla_sm90::run_fmha_fwd_sm90_mla<cutlass::bfloat16_t>(p, rope, opt, dev, stream)        \
                     : mla_sm90::run_fmha_fwd_sm90_mla<cutlass::half_t>(p, rope, opt, dev, stream);           \
  }
