// Weight-absorbed MLA decode on Hopper: 64-row tiles with wgmma and TMA (sm_90a).
//
// A CTA takes one work item of the split-KV schedule (request b, KV range [kv_begin, kv_end)) for one m-block of
// 64 (token, head) rows, exactly as the mma.sync row-group kernel does (same grid, same schedule, same split
// workspace and merge kernel), and walks its range in blocks of 64 cache tokens:
//
//   WG0, one thread   the loader: each block's 64 x 576 tile by TMA, 64-column boxes of min(page, 32) rows, page
//                     ids read from block_table as it goes, into a two-stage ring (full: TMA bytes, one barrier per
//                     part of the tile's column groups; empty: the eight consumer warps). A box whose tokens lie
//                     past the item's range, or whose page id is outside the cache, is given the page coordinate
//                     num_pages: TMA fills it with zeros and reads nothing.
//   WG1 (S warpgroup) S = Q K^T (SS wgmma, 64 x 64 x 576, each part of the tile's columns issued as it lands),
//                     online softmax in base 2, P in registers for its own O[:, 0:256] += P V[:, 0:256] (RS wgmma,
//                     issued first) and then to shared memory for WG2, before the next block's QK, so that the PVs
//                     and that QK are in flight together.
//   WG2 (V warpgroup) O[:, 256:512] += P V[:, 256:512] (SS wgmma, P from shared memory) after rescaling its half.
//
// K and V share one tile: V is the first 512 columns of K, and the 128-byte swizzled K-major layout of a
// 64-column group of 64 tokens is also the MN-major layout of the V^T operand (the same bytes: token r at
// r x 128, value c at swizzled 16-byte chunk c / 8). Q (72 KB), two KV stages (144 KB) and P (8 KB) fill the
// opt-in shared memory.
//
// The last block of a request holds rows past its length (the end of the last page: uninitialised or poisoned
// memory). WG1 zeroes those rows of the tile before its QK, so 0 x NaN never reaches O; masked scores are -inf.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cuda_host_adapter.hpp>
#include <cutlass/numeric_types.h>

#include "common/cuda_check.h"
#include "sm80/mla_decode/mla_decode_sm80_kernel.cuh"
#include "sm80/mla_decode/mla_decode_sm80_launch.h"
#include "sm90/mla_decode/mla_decode_sm90_config.h"
#include "sm90/sm90_attn_common.cuh"

namespace mla_decode_sm90 {

using namespace cute;
namespace mds = mla_decode_sm80;
using Cfg = DecodeSm90Config;

// The kernel's arguments: the decode parameters and one TMA descriptor per cache tensor, each a 3-D view
// (columns, row in page, page) with a box of 64 columns x box_rows rows x 1 page.
struct Sm90DecodeArgs {
  CUtensorMap tma_ckv;  // (512, page_size, num_pages)
  CUtensorMap tma_kpe;  // (64, page_size, num_pages)
  mds::DecodeParams p;
  int box_rows;         // min(page_size, Cfg::kMaxBoxRows)
  int log2_box_rows;
  uint64_t cache_hint;  // L2 policy of the cache reads: evict-first unless several m-blocks of a request share them
};

template <class Elem>  // cutlass::bfloat16_t or cutlass::half_t
struct DecodeSm90Traits {
  using T = Elem;
  using BM = Int<Cfg::kBlockM>;
  using BN = Int<Cfg::kBlockN>;
  using DQK = Int<mds::kDimQK>;
  using DVH = Int<Cfg::kHalfV>;

  // Q and every KV stage: (rows, 576) in 128-byte swizzled K-major atoms of 8 rows x 64 columns, rows first, so a
  // 64-column group of 64 rows is 8 KB (group g at g x 8 KB, row r at r x 128 B inside it).
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<BM, DQK>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<BN, DQK, Int<Cfg::kStages>>{}));
  // Half of V^T (256 values x 64 tokens) of one stage: MN-major atoms (64 values x 8 tokens), tokens first, so
  // value group g of the half sits at g x 8 KB: the bytes of the K tile's column groups 4h .. 4h + 3.
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<DVH, BN>{}, Step<_2, _1>{}));
  // P (64 rows x 64 tokens), the A operand of WG2's PV: K-major.
  using SmemLayoutP = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<BM, BN>{}));

  using TiledMmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<BM, BN, DQK>>()));
  using TiledMmaPVrs = decltype(make_tiled_mma(
      GMMA::rs_op_selector<T, T, float, Shape<BM, DVH, BN>, GMMA::Major::K, GMMA::Major::MN>()));
  using TiledMmaPVss = decltype(make_tiled_mma(
      GMMA::ss_op_selector<T, T, float, Shape<BM, DVH, BN>, GMMA::Major::K, GMMA::Major::MN>()));

  static constexpr int kTileElems = Cfg::kBlockN * mds::kDimQK;
  static constexpr uint32_t kTileBytes = kTileElems * sizeof(T);

  struct SharedStorage {
    cute::array_aligned<T, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<T, cute::cosize_v<SmemLayoutK>, 1024> kv;
    cute::array_aligned<T, cute::cosize_v<SmemLayoutP>, 1024> p;
    float alpha[2][Cfg::kBlockM];  // the rescale factor of every row for block i in alpha[i % 2] (written before
                                   // P(i) is: WG2 has read alpha(i - 2) by the time P(i - 1) is published)
    float inv_l[Cfg::kBlockM];    // 1 / row sum at the end (0 for a row that saw nothing)
    alignas(8) uint64_t full[Cfg::kStages][Cfg::kTileParts];
    uint64_t empty[Cfg::kStages];
  };
  // + 1 KB: the dynamic region is aligned to 1024 bytes by hand (the static work-item slot comes first).
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes + mds::kStaticSmemBytes <= 227 * 1024, "shared storage exceeds the 227 KiB opt-in limit");
  static_assert(sizeof(T) == 2, "16-bit inputs");
};

// Named barriers (0 is __syncthreads): P(i) and alpha(i) published by WG1 / consumed by WG2; all 256 consumer
// threads (the Q tile, the final row sums); WG1 alone (zeroed tail rows before its QK).
enum : uint32_t { kBarPFull = 1, kBarPEmpty = 2, kBarConsumers = 3, kBarWg1 = 4 };

CUTE_DEVICE void bar_sync(uint32_t id, uint32_t n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
CUTE_DEVICE void bar_arrive(uint32_t id, uint32_t n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// The column groups [part_begin(p), part_begin(p + 1)) of a tile land on its stage's barrier p.
constexpr int kGroups = mds::kDimQK / 64;
CUTE_HOST_DEVICE constexpr int part_begin(int p) { return kGroups * p / Cfg::kTileParts; }
static_assert(Cfg::kTileParts >= 1 && Cfg::kTileParts <= kGroups, "tile parts");

// Byte offset of (row r, 16-byte chunk c of the 576 values) in a Q / KV tile of 64 rows (see SmemLayoutQ).
CUTE_DEVICE uint32_t tile_offset(int r, int c) {
  return uint32_t((c >> 3) * (Cfg::kBlockN * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Zero rows [r0, 64) of a KV tile (all 576 values), by the 128 threads of WG1 (t in [0, 128)).
CUTE_DEVICE void zero_tile_rows(uint8_t* tile, int r0, int t) {
  for (int idx = t; idx < (Cfg::kBlockN - r0) * 72; idx += 128) {
    const int r = r0 + idx / 72, c = idx % 72;
    *reinterpret_cast<uint4*>(tile + tile_offset(r, c)) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// This warpgroup's half of the output rows (columns col0 .. col0 + 255), times 1/l: to out (16-bit) when the request
// has one split, else to its split's fp32 workspace rows (mla_decode_sm80_params.h).
template <class Elem, class TO, class ThrMma>
CUTE_DEVICE void store_half(mds::DecodeParams const& p, mds::WorkItem const& w, int item, TO const& tOrO,
                            ThrMma const& thr, float const* inv_l, int row0, int rows_total, int col0) {
  Tensor O_rc = make_tensor(tOrO.data(), mla_sm90::acc_rowcol(tOrO.layout()));
  Tensor cO = thr.partition_C(make_identity_tensor(Shape<Int<Cfg::kBlockM>, Int<Cfg::kHalfV>>{}));
  Tensor cO_rc = make_tensor(cO.data(), mla_sm90::acc_rowcol(cO.layout()));
  CUTE_UNROLL
  for (int r = 0; r < size<0>(O_rc); ++r) {
    const int row = get<0>(cO_rc(r, 0));
    const int grow = row0 + row;
    if (grow >= rows_total) continue;
    const float inv = inv_l[row];
    if (w.final_out) {
      const int tq = grow / p.hq, h = grow - tq * p.hq;
      Elem* out = static_cast<Elem*>(p.out) + int64_t(w.b) * p.o_batch_stride + int64_t(tq) * p.o_row_stride +
                  int64_t(h) * p.o_head_stride + col0;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(O_rc); j += 2)
        *reinterpret_cast<uint32_t*>(out + get<1>(cO_rc(r, j))) = mds::pack2<Elem>(O_rc(r, j) * inv, O_rc(r, j + 1) * inv);
    } else {
      float* wo = p.ws_o + (int64_t(item) * rows_total + grow) * mds::kDimCkv + col0;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(O_rc); j += 2)
        *reinterpret_cast<float2*>(wo + get<1>(cO_rc(r, j))) = make_float2(O_rc(r, j) * inv, O_rc(r, j + 1) * inv);
    }
  }
}

// A smem-descriptor fragment whose base the compiler cannot hoist out of the main loop: the QK's 36 k-steps would
// otherwise keep 36 precomputed 64-bit descriptors alive across it (and spill); this way each is the base plus an
// immediate, formed just before its wgmma.
template <class Tensor_>
CUTE_DEVICE auto fresh_descriptors(Tensor_ const& t) {
  GMMA::DescriptorIterator it = t.data();
  asm volatile("" : "+r"(it.desc_.reg32_[0]), "+r"(it.desc_.reg32_[1]));
  return make_tensor(it, t.layout());
}

// f(Int<I>{}) for I in [I0, I1).
template <int I0, int I1, class F>
CUTE_DEVICE void static_for(F&& f) {
  if constexpr (I0 < I1) {
    f(Int<I0>{});
    static_for<I0 + 1, I1>(f);
  }
}

// op over row r of a (rows, cols) register tensor, as a tree (log2(cols) dependent steps, not cols).
template <class Tensor_, class Op>
CUTE_DEVICE float row_reduce(Tensor_ const& t, int r, Op op) {
  constexpr int kCols = decltype(size<1>(t))::value;
  static_assert((kCols & (kCols - 1)) == 0, "a power of two");
  float v[kCols];
  CUTE_UNROLL
  for (int j = 0; j < kCols; ++j) v[j] = t(r, j);
  // each level halves the live width; the indices stay compile-time constants
  static_for<0, cute::log_2(unsigned(kCols))>([&](auto level) {
    constexpr int w = kCols >> (decltype(level)::value + 1);
    CUTE_UNROLL
    for (int j = 0; j < w; ++j) v[j] = op(v[j], v[j + w]);
  });
  return v[0];
}

CUTE_DEVICE void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

template <class TmaElem, class Elem>
__global__ void __launch_bounds__(Cfg::kThreads, 1) mla_decode_sm90_kernel(CUTE_GRID_CONSTANT Sm90DecodeArgs const args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using KT = DecodeSm90Traits<TmaElem>;
  using T = typename KT::T;
  using BM = typename KT::BM;
  using BN = typename KT::BN;
  using DVH = typename KT::DVH;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kBN = Cfg::kBlockN;
  constexpr int kStages = Cfg::kStages;

  mds::DecodeParams const& p = args.p;
  const int item = blockIdx.y;
  const int mblock = blockIdx.x;
  const mds::WorkItem w = mds::work_item(p, item);  // every thread (PDL wait, inline schedule)
  if (w.b < 0) return;
  const int b = w.b, kv_begin = w.kv_begin, kv_end = w.kv_end;
  const int n_blocks = kv_end > kv_begin ? (kv_end - kv_begin + kBN - 1) / kBN : 0;
  const int L = mds::request_len(p, b);
  const int rows_total = p.seqlen_q * p.hq;
  const int row0 = mblock * Cfg::kBlockM;

  extern __shared__ char smem_raw[];
  char* const smem_base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  auto& ss = *reinterpret_cast<typename KT::SharedStorage*>(smem_base);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      for (int part = 0; part < Cfg::kTileParts; ++part) TxBarrier::init(&ss.full[s][part], 1);
      Barrier::init(&ss.empty[s], 8);  // one arrival per consumer warp
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (wg == 0) {
    // ================================ loader ================================
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kLoaderRegs>();
    if (warp == 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(&args.tma_ckv);
      cute::prefetch_tma_descriptor(&args.tma_kpe);
      const int* bt = p.block_table + int64_t(b) * p.bt_batch_stride;
      const int box_rows = args.box_rows;
      const int boxes = kBN >> args.log2_box_rows;  // <= kMaxBoxes: pages of at least kMinPageSize tokens
      constexpr int kMaxBoxes = Cfg::kBlockN / Cfg::kMinPageSize;
      const int page_mask = p.page_size - 1;
      for (int i = 0; i < n_blocks; ++i) {
        const int stage = i % kStages;
        const int t0 = kv_begin + i * kBN;
        // The block's page ids are read before the wait for its stage: a block-table read after it would put an
        // L2 round trip between the consumers freeing the stage and the first TMA copy into it, every block.
        int page[kMaxBoxes];
        CUTE_UNROLL
        for (int j = 0; j < kMaxBoxes; ++j) {
          const int tok = t0 + j * box_rows;
          page[j] = p.num_pages;  // outside the tensor: TMA writes zeros and reads nothing
          if (j < boxes && tok < kv_end) {
            const int id = __ldg(bt + (tok >> p.log2_page));
            if (unsigned(id) < unsigned(p.num_pages)) page[j] = id;
          }
        }
        if (i >= kStages) Barrier::wait(&ss.empty[stage], uint32_t((i / kStages - 1) & 1));
        char* const tile = reinterpret_cast<char*>(ss.kv.data() + stage * KT::kTileElems);
        // Part by part, in the order the QK reads them: the first k-steps can start while the rest is in flight.
        CUTE_UNROLL
        for (int part = 0; part < Cfg::kTileParts; ++part) {
          uint64_t* bar = &ss.full[stage][part];
          TxBarrier::arrive_and_expect_tx(bar, uint32_t(part_begin(part + 1) - part_begin(part)) * kBN * 128);
          CUTE_UNROLL
          for (int j = 0; j < kMaxBoxes; ++j) {
            if (j >= boxes) break;
            const int tok = t0 + j * box_rows;
            const int row = tok & page_mask;
            char* const dst = tile + j * box_rows * 128;
            CUTE_UNROLL
            for (int g = part_begin(part); g < part_begin(part + 1); ++g) {
              if (g < kGroups - 1)
                SM90_TMA_LOAD_3D::copy(&args.tma_ckv, bar, args.cache_hint, dst + g * (kBN * 128), g * 64, row,
                                       page[j]);
              else  // the rope columns
                SM90_TMA_LOAD_3D::copy(&args.tma_kpe, bar, args.cache_hint, dst + g * (kBN * 128), 0, row, page[j]);
            }
          }
        }
      }
    }
    return;
  }

  // ================================ consumers ================================
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  const int t = threadIdx.x % 128;   // thread in its warpgroup
  const int ct = threadIdx.x - 128;  // thread among the 256 consumers

  // ---- Q tile: rows (token, head) row0 .. row0 + 63 of request b, zero past Sq x H ----
  {
    char* const sq = reinterpret_cast<char*>(ss.q.data());
    // A thread's 16-byte chunks are loaded in batches of kQBatch, every load of a batch before its first store, so
    // the tile costs two memory round trips rather than 18 (all 18 at once spill).
    constexpr int kQChunks = Cfg::kBlockM * 72 / 256;  // per consumer thread
    constexpr int kQBatch = kQChunks / 2;
    static_assert(Cfg::kBlockM * 72 % 256 == 0 && kQChunks % kQBatch == 0, "the Q tile splits evenly");
    CUTE_NO_UNROLL
    for (int k0 = 0; k0 < kQChunks; k0 += kQBatch) {
      uint4 v[kQBatch];
      CUTE_UNROLL
      for (int k = 0; k < kQBatch; ++k) {
        const int idx = ct + (k0 + k) * 256, r = idx / 72, c = idx % 72;
        const int grow = row0 + r;
        v[k] = make_uint4(0u, 0u, 0u, 0u);
        if (grow < rows_total) {
          const int tq = grow / p.hq, h = grow - tq * p.hq;
          v[k] = __ldg(reinterpret_cast<const uint4*>(mds::q_chunk<T>(p, b, tq, h, c)));
        }
      }
      CUTE_UNROLL
      for (int k = 0; k < kQBatch; ++k) {
        const int idx = ct + (k0 + k) * 256;
        *reinterpret_cast<uint4*>(sq + tile_offset(idx / 72, idx % 72)) = v[k];
      }
    }
    cutlass::arch::fence_view_async_shared();  // generic stores, read next by wgmma
    bar_sync(kBarConsumers, 256);
  }

  if (wg == 1) {
    // ============================ S warpgroup ============================
    typename KT::TiledMmaQK mma_qk;
    typename KT::TiledMmaPVrs mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(t);
    auto thr_pv = mma_pv.get_thread_slice(t);
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename KT::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ss.kv.data()), typename KT::SmemLayoutK{});
    Tensor sV0 = make_tensor(make_smem_ptr(ss.kv.data()), typename KT::SmemLayoutVt{});
    Tensor sV1 = make_tensor(make_smem_ptr(ss.kv.data() + KT::kTileElems), typename KT::SmemLayoutVt{});
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);  // (MMA, N, K, stages)
    Tensor tOrV0 = thr_pv.partition_fragment_B(sV0);
    Tensor tOrV1 = thr_pv.partition_fragment_B(sV1);
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<BM, BN>{});
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<BM, DVH>{});
    Tensor tOrP = make_tensor<T>(mla_sm90::acc_to_A_regs(tSrS.layout()));
    Tensor S_rc = make_tensor(tSrS.data(), mla_sm90::acc_rowcol(tSrS.layout()));
    Tensor O_rc = make_tensor(tOrO.data(), mla_sm90::acc_rowcol(tOrO.layout()));
    Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<BM, BN>{}));
    Tensor cS_rc = make_tensor(cS.data(), mla_sm90::acc_rowcol(cS.layout()));
    constexpr int R = decltype(size<0>(S_rc))::value;
    clear(tOrO);

    // The last visible cache position of each of this thread's rows (-1: a padding row).
    int lim[R];
    float m_run[R], l_part[R];
    CUTE_UNROLL
    for (int r = 0; r < R; ++r) {
      const int grow = row0 + get<0>(cS_rc(r, 0));
      int l = kv_end - 1;
      if (p.causal) l = min(l, L - p.seqlen_q + grow / p.hq);
      lim[r] = grow < rows_total ? l : -1;
      m_run[r] = -INFINITY;
      l_part[r] = 0.f;
    }
    const float c = p.scale_log2;
    // Conditional rescale: a row's exponent reference moves only when its max grows by more than
    // Cfg::kRescaleLog2 (in log2 units), so P <= 2^kRescaleLog2 and on most blocks no row moves and O is left alone
    // (the LSE is taken from the reference: the same math).
    const float move_threshold = Cfg::kRescaleLog2 / c;
    auto wait_part = [&](int i, int part) {
      TxBarrier::wait(&ss.full[i % kStages][part], uint32_t((i / kStages) & 1));
    };
    // The block's rows past the request's length (the end of its last page) are zeroed before any read: that
    // block waits for its whole tile first.
    auto zero_tail = [&](int i) {
      const int t0 = kv_begin + i * kBN;
      if (L - t0 < kBN) {
        for (int part = 0; part < Cfg::kTileParts; ++part) wait_part(i, part);
        zero_tile_rows(reinterpret_cast<uint8_t*>(ss.kv.data() + (i % kStages) * KT::kTileElems), L - t0, t);
        cutlass::arch::fence_view_async_shared();
        bar_sync(kBarWg1, 128);
      }
    };
    // QK(i), part by part: each part's k-steps are one commit group, issued once the part has landed.
    auto issue_qk_part = [&](int i, auto part) {
      constexpr int p = decltype(part)::value;
      wait_part(i, p);
      mla_sm90::wg_gemm<false, part_begin(p) * 4, part_begin(p + 1) * 4>(
          mma_qk, fresh_descriptors(tSrQ), fresh_descriptors(tSrK(_, _, _, i % kStages)), tSrS, p == 0);
    };

    // Block i's scores in tSrS -> P(i) = exp2(S c - m c) rounded in tOrP, the running row sums, alpha(i) (the rows'
    // rescale factors), O[:, 0:256] rescaled (PV(i - 1) has completed). Row maxima and sums are trees: their
    // dependent chains are on the path from the QK to the PV.
    float alpha[R];
    auto softmax = [&](int i) {
      const int t0 = kv_begin + i * kBN;
      // ---- mask: the item's end and, with causal, each row's own position ----
      if (t0 + kBN > kv_end || (p.causal && t0 + kBN - 1 > L - p.seqlen_q)) {
        CUTE_UNROLL
        for (int r = 0; r < R; ++r)
          CUTE_UNROLL
          for (int j = 0; j < size<1>(S_rc); ++j)
            if (t0 + get<1>(cS_rc(r, j)) > lim[r]) S_rc(r, j) = -INFINITY;
      }
      // ---- online softmax in base 2 ----
      CUTE_UNROLL
      for (int r = 0; r < R; ++r) {
        const float row_max = row_reduce(S_rc, r, [](float a, float b) { return fmaxf(a, b); });
        const float mx_new = mla_sm90::quad_max(fmaxf(m_run[r], row_max));
        const bool moves = mx_new > m_run[r] + move_threshold;  // -inf + t = -inf: a first finite max moves it
        const float mx = moves ? mx_new : m_run[r];
        const float mc = mx == -INFINITY ? 0.f : mx * c;
        alpha[r] = moves ? mla_sm90::fast_exp2(m_run[r] * c - mc) : 1.f;
        m_run[r] = mx;
        CUTE_UNROLL
        for (int j = 0; j < size<1>(S_rc); ++j) S_rc(r, j) = mla_sm90::fast_exp2(fmaf(S_rc(r, j), c, -mc));
        l_part[r] = l_part[r] * alpha[r] + row_reduce(S_rc, r, [](float a, float b) { return a + b; });
        if (lane % 4 == 0) ss.alpha[i % 2][get<0>(cS_rc(r, 0))] = alpha[r];
      }
      mla_sm90::convert_frag(tSrS, tOrP);
      // ---- O[:, 0:256] *= alpha, skipped by a warp none of whose rows moved ----
      bool moved = false;
      CUTE_UNROLL
      for (int r = 0; r < R; ++r) moved |= alpha[r] != 1.f;
      if (__any_sync(0xffffffffu, moved)) {
        CUTE_UNROLL
        for (int r = 0; r < R; ++r)
          CUTE_UNROLL
          for (int j = 0; j < size<1>(O_rc); ++j) O_rc(r, j) *= alpha[r];
      }
    };
    // P(i) to the V warpgroup (alpha(i) is in smem already), once it has read P(i - 1). Word h + 2j of tOrP
    // (elements 2h + 4j and + 1 of the accumulator layout, rounded) is row 16 warp + lane / 4 + 8h, columns
    // 8j + 2 (lane % 4) and + 1; in the swizzled tile that is address (row0 ^ (j << 4)) + h x 1024 (row0: the
    // thread's h = j = 0 address, whose chunk bits carry the swizzle), formed just before each store so that no
    // address stays live across the PV.
    const uint32_t sp = cute::cast_smem_ptr_to_uint(ss.p.data());
    auto publish = [&](int i) {
      if (i > 0) bar_sync(kBarPEmpty, 256);
      static_assert(decltype(size(tSrS))::value == 2 * 2 * (Cfg::kBlockN / 8), "the 64 x kBlockN accumulator layout");
      uint32_t row0 = sp + tile_offset(16 * (t / 32) + lane / 4, 0) + (lane % 4) * 4;
      asm volatile("" : "+r"(row0));
      const uint32_t* p_words = reinterpret_cast<const uint32_t*>(raw_pointer_cast(tOrP.data()));
      CUTE_UNROLL
      for (int j = 0; j < Cfg::kBlockN / 8; ++j)
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) st_shared_u32((row0 ^ (j << 4)) + h * 1024, p_words[h + 2 * j]);
      cutlass::arch::fence_view_async_shared();
      bar_arrive(kBarPFull, 256);
    };
    auto issue_pv = [&](int i) {
      if (i % kStages == 0) mla_sm90::wg_gemm<true>(mma_pv, tOrP, tOrV0, tOrO, false);
      else mla_sm90::wg_gemm<true>(mma_pv, tOrP, tOrV1, tOrO, false);
    };
    auto release = [&](int i) {
      __syncwarp();
      if (lane == 0) Barrier::arrive(&ss.empty[i % kStages]);
    };

    if (n_blocks > 0) {
      zero_tail(0);
      static_for<0, Cfg::kTileParts>([&](auto part) { issue_qk_part(0, part); });
      warpgroup_wait<0>();
      // steady state: PV(i) and QK(i + 1) in flight together, WG2's PV(i) beside them; the stage of block i is
      // released once PV(i) is done (after QK(i + 1)'s first part is issued), before the later parts' waits.
      // Per block, WG1's own PV goes to the tensor cores first, then P is published for WG2: the smem stores and
      // barriers run while PV(i) does.
      for (int i = 0; i + 1 < n_blocks; ++i) {
        softmax(i);
        issue_pv(i);
        publish(i);
        zero_tail(i + 1);
        issue_qk_part(i + 1, Int<0>{});
        warpgroup_wait<1>();
        release(i);
        static_for<1, Cfg::kTileParts>([&](auto part) { issue_qk_part(i + 1, part); });
        warpgroup_wait<0>();
      }
      softmax(n_blocks - 1);
      issue_pv(n_blocks - 1);
      publish(n_blocks - 1);
      warpgroup_wait<0>();
      release(n_blocks - 1);
    }

    // ---- final row sums; 1/l for both warpgroups, the LSE ----
    CUTE_UNROLL
    for (int r = 0; r < R; ++r) {
      const float l = mla_sm90::quad_sum(l_part[r]);
      const bool dead = !(l > 0.f);
      const int row = get<0>(cS_rc(r, 0));
      if (lane % 4 == 0) {
        ss.inv_l[row] = dead ? 0.f : 1.f / l;
        if (row0 + row < rows_total) mds::store_lse(p, w, item, row0 + row, dead ? -INFINITY : m_run[r] * c + __log2f(l));
      }
    }
    bar_sync(kBarConsumers, 256);
    store_half<Elem>(p, w, item, tOrO, thr_pv, ss.inv_l, row0, rows_total, 0);
  } else {
    // ============================ V warpgroup ============================
    typename KT::TiledMmaPVss mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(t);
    constexpr int kHalfOffset = (Cfg::kHalfV / 64) * kBN * 64;  // column groups 4..7 of a tile
    Tensor sP = make_tensor(make_smem_ptr(ss.p.data()), typename KT::SmemLayoutP{});
    Tensor sV0 = make_tensor(make_smem_ptr(ss.kv.data() + kHalfOffset), typename KT::SmemLayoutVt{});
    Tensor sV1 = make_tensor(make_smem_ptr(ss.kv.data() + KT::kTileElems + kHalfOffset), typename KT::SmemLayoutVt{});
    Tensor tOrPs = thr_pv.partition_fragment_A(sP);
    Tensor tOrV0 = thr_pv.partition_fragment_B(sV0);
    Tensor tOrV1 = thr_pv.partition_fragment_B(sV1);
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<BM, DVH>{});
    Tensor O_rc = make_tensor(tOrO.data(), mla_sm90::acc_rowcol(tOrO.layout()));
    Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<BM, DVH>{}));
    Tensor cO_rc = make_tensor(cO.data(), mla_sm90::acc_rowcol(cO.layout()));
    constexpr int R = decltype(size<0>(O_rc))::value;
    clear(tOrO);

    for (int i = 0; i < n_blocks; ++i) {
      const int stage = i % kStages;
      for (int part = 0; part < Cfg::kTileParts; ++part)
        TxBarrier::wait(&ss.full[stage][part], uint32_t((i / kStages) & 1));
      bar_sync(kBarPFull, 256);  // P(i), alpha(i), and the block's zeroed tail rows
      if (i > 0) {
        float a[R];
        bool moved = false;
        CUTE_UNROLL
        for (int r = 0; r < R; ++r) {
          a[r] = ss.alpha[i % 2][get<0>(cO_rc(r, 0))];
          moved |= a[r] != 1.f;
        }
        if (__any_sync(0xffffffffu, moved)) {
          CUTE_UNROLL
          for (int r = 0; r < R; ++r)
            CUTE_UNROLL
            for (int j = 0; j < size<1>(O_rc); ++j) O_rc(r, j) *= a[r];
        }
      }
      if (stage == 0) mla_sm90::wg_gemm<false>(mma_pv, tOrPs, tOrV0, tOrO, false);
      else mla_sm90::wg_gemm<false>(mma_pv, tOrPs, tOrV1, tOrO, false);
      warpgroup_wait<0>();
      if (i + 1 < n_blocks) bar_arrive(kBarPEmpty, 256);
      __syncwarp();
      if (lane == 0) Barrier::arrive(&ss.empty[stage]);
    }
    bar_sync(kBarConsumers, 256);
    store_half<Elem>(p, w, item, tOrO, thr_pv, ss.inv_l, row0, rows_total, Cfg::kHalfV);
  }
#endif
}

// ------------------------------------------------------------------------------------------------
// A cache tensor (pages, page_size, cols) with 16-bit values, as a 3-D TMA view (cols, row in page, page) read in
// boxes of 64 columns x box_rows rows with the 128-byte swizzle of the smem tiles.
inline cudaError_t encode_cache_map(CUtensorMap* map, const void* base, int cols, int page_size, int num_pages,
                                    int64_t row_stride, int64_t page_stride, int box_rows, bool bf16) {
  cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(page_size), cuuint64_t(num_pages)};
  cuuint64_t strides[2] = {cuuint64_t(row_stride) * 2, cuuint64_t(page_stride) * 2};
  cuuint32_t box[3] = {64u, cuuint32_t(box_rows), 1u};
  cuuint32_t elem_strides[3] = {1u, 1u, 1u};
  const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, const_cast<void*>(base), dims,
      strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The launch: the (m-block, item) grid of the decode's schedule, 384 threads, a programmatic dependent of the
// previous kernel when p.pdl (launch.h's rules). Elem: __nv_bfloat16 or __half.
template <class Elem>
cudaError_t launch_decode_sm90(const mds::DecodeParams& p, cudaStream_t stream) {
  constexpr bool kBf16 = std::is_same_v<Elem, __nv_bfloat16>;
  using TmaElem = std::conditional_t<kBf16, cutlass::bfloat16_t, cutlass::half_t>;
  using KT = DecodeSm90Traits<TmaElem>;
  Sm90DecodeArgs args{};
  args.p = p;
  args.box_rows = p.page_size < Cfg::kMaxBoxRows ? p.page_size : Cfg::kMaxBoxRows;
  args.log2_box_rows = 0;
  while ((1 << args.log2_box_rows) < args.box_rows) ++args.log2_box_rows;
  // The m-blocks of one request (H x Sq > 64) read the same cache rows at about the same time: keep them in L2.
  args.cache_hint = uint64_t(p.num_mblocks > 1 ? TMA::CacheHintSm90::EVICT_NORMAL : TMA::CacheHintSm90::EVICT_FIRST);
  MLA_CUDA_TRY(encode_cache_map(&args.tma_ckv, p.ckv, mds::kDimCkv, p.page_size, p.num_pages, p.ckv_row_stride,
                                p.ckv_page_stride, args.box_rows, kBf16));
  MLA_CUDA_TRY(encode_cache_map(&args.tma_kpe, p.kpe, mds::kDimKpe, p.page_size, p.num_pages, p.kpe_row_stride,
                                p.kpe_page_stride, args.box_rows, kBf16));
  constexpr auto kernel = mla_decode_sm90_kernel<TmaElem, Elem>;
  MLA_CUDA_TRY(mla::opt_in_dynamic_smem<kernel>(KT::kSmemBytes));
  return mds::launch_dependent(kernel, dim3(p.num_mblocks, p.num_items), Cfg::kThreads, KT::kSmemBytes, stream,
                               p.pdl != 0, args);
}

}  // namespace mla_decode_sm90
