// Shared SM90 attention helpers: per-sequence lengths/offsets, causal block ranges, masks,
// accumulator layout views, wgmma issue and small math. Used by fmha_fwd_sm90 and fmha_bwd_sm90.
// Everything here is header-only device code built on CuTe; no state.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "common/fmha_params.h"
#include "sm90/sm90_varlen_rows.cuh"


namespace mla_sm90 {

using namespace cute;

// ------------------------------------------------------------------------------------------------
// Lengths and first rows of sequence b, dense or varlen (cu_seqlens read through varlen_rows), as every
// SM90 kernel of a call sees them.
struct SeqInfo {
  int seqlen_q, seqlen_k;      // lengths of this sequence
  int64_t offset_q, offset_k;  // first row of this sequence in the (packed or per-batch) tensor

  SeqInfo() = default;
  CUTE_DEVICE SeqInfo(FmhaProblemParams const& p, int b) {
    if (p.cu_seqlens_q != nullptr) {
      varlen_rows(p.cu_seqlens_q, b, p.rows_q, p.seqlen_q, offset_q, seqlen_q);
    } else {
      seqlen_q = p.seqlen_q;
      offset_q = 0;
    }
    if (p.cu_seqlens_k != nullptr) {
      varlen_rows(p.cu_seqlens_k, b, p.rows_k, p.seqlen_k, offset_k, seqlen_k);
    } else {
      seqlen_k = p.seqlen_k;
      offset_k = 0;
    }
  }
};

// ------------------------------------------------------------------------------------------------
// Causal geometry. Query i (of this sequence) sees key j iff j < Sk and (!causal || j <= i + diag),
// diag = Sk - Sq for bottom-right alignment, 0 for top-left.
struct MaskInfo {
  int seqlen_q, seqlen_k, diag;
  bool causal;

  CUTE_HOST_DEVICE MaskInfo(int sq, int sk, bool causal_, bool bottom_right)
      : seqlen_q(sq), seqlen_k(sk), diag(bottom_right ? sk - sq : 0), causal(causal_) {}

  // Key blocks [n_min, n_max) that an M-block of kBM query rows must visit.
  template <int kBM, int kBN>
  CUTE_DEVICE void n_block_range(int m_block, int& n_min, int& n_max) const {
    int hi = seqlen_k;
    if (causal) {
      int64_t last_visible = int64_t(m_block + 1) * kBM + diag;  // exclusive bound on key index
      hi = int(last_visible < int64_t(hi) ? last_visible : int64_t(hi));
    }
    n_min = 0;
    n_max = hi <= 0 ? 0 : (hi + kBN - 1) / kBN;
  }

  // Query blocks [m_min, m_max) of kBM rows that a key block of kBN keys must visit (the backward's loop):
  // under a causal mask the first is the one holding query n * kBN - diag, the first that sees key n * kBN.
  template <int kBM, int kBN>
  CUTE_DEVICE void m_block_range(int n_block, int& m_min, int& m_max) const {
    m_max = (seqlen_q + kBM - 1) / kBM;
    m_min = 0;
    if (causal) {
      int const x = n_block * kBN - diag;
      m_min = x <= 0 ? 0 : x / kBM;
    }
  }

  // The first key block that needs masking for M-block m: block n needs it iff n >= this (both bounds are
  // monotone in n), the same answer as block_needs_mask, in one comparison per block.
  template <int kBM, int kBN>
  CUTE_HOST_DEVICE int first_masked_block(int m_block) const {
    int lo = seqlen_k / kBN;  // (n + 1) * kBN > seqlen_k
    if (causal) {
      // (n + 1) * kBN - 1 > m * kBM + diag, i.e. n >= floor((m * kBM + diag + 1) / kBN) (every n when negative)
      int64_t const x = int64_t(m_block) * kBM + diag + 1;
      int const lo_diag = x <= 0 ? 0 : int(x / kBN);
      lo = lo_diag < lo ? lo_diag : lo;
    }
    return lo;
  }

  // Whether key block n needs any masking for M-block m (seqlen_k bound or causal diagonal).
  template <int kBM, int kBN>
  CUTE_HOST_DEVICE bool block_needs_mask(int m_block, int n_block) const {
    if ((n_block + 1) * kBN > seqlen_k) return true;
    if (causal) {
      // The smallest row of the tile sees keys j <= m*BM + diag; the block's largest key is (n+1)*BN-1.
      int64_t first_row_bound = int64_t(m_block) * kBM + diag;
      if (int64_t(n_block + 1) * kBN - 1 > first_row_bound) return true;
    }
    return false;
  }
};

// ------------------------------------------------------------------------------------------------
// L2-grouped launch order. CTAs start in id order, so the CTAs resident at one time have consecutive
// ids. Tiles are (pair, block) with pair = (head, batch) and `num_blocks` blocks per pair; the pairs are
// taken in groups of `group` whose operands fit in L2 together, and inside a group the id runs over the
// pairs fastest, then over the blocks by rank (rank 0 first). Each kernel maps rank to its longest block
// first (forward causal: the last M-block; backward causal: K/V block 0), so a group's last CTAs are
// short ones and the grid's tail is small. group = num_pairs: every pair interleaved.
struct GroupedTile {
  int pair, rank;
};
__device__ __forceinline__ GroupedTile grouped_tile(int id, int num_pairs, int num_blocks, int group) {
  int const per_group = group * num_blocks;
  int const g = id / per_group;
  int const r = id - g * per_group;
  int const gsz = min(group, num_pairs - g * group);  // the last group may be smaller
  int const rank = r / gsz;
  return {g * group + (r - rank * gsz), rank};
}

// ------------------------------------------------------------------------------------------------
// The varlen block numbering over the query (kKeys false) or key (kKeys true) sequences of p: sequence after
// sequence in the schedule's order (p.seq_order, longest first, or cu_seqlens order), sequence b holding
// blocks x units numbers, blocks = ceil(len / kBlock) with len from varlen_rows (so it covers exactly the blocks
// that hold rows, as every kernel of the call sees them) and units what each block is repeated for (heads, or 1).
// find(p, t, units, none, found) returns found(b, r, blocks) for number t: its sequence b, its index r in that
// sequence ([0, blocks x units)) and that sequence's blocks; `none` past the last number. Warp-collective (all 32
// lanes, converged): a scan of 32 sequences per step, lane j taking the sequence at position chunk_k0 + j of the
// order. The scan keeps its place (chunk_k0, the first position of a 32-aligned chunk, and chunk_base, the numbers
// before it), so a caller whose numbers only grow resumes it (a forward CTA reads cu_seqlens once over all its
// tiles) and a fresh one starts at position 0. find(p, t, units) returns {b, r, blocks}, b = -1 past the last number.
struct VarlenNumber {
  int b, r, blocks;
};
template <int kBlock, bool kKeys>
struct VarlenNumbering {
  int chunk_k0 = 0;
  int chunk_base = 0;

  template <class Result, class Found>
  CUTE_DEVICE Result find(FmhaProblemParams const& p, int t, int units, Result none, Found found) {
    int const lane = threadIdx.x % 32;
    for (; chunk_k0 < p.batch; chunk_k0 += 32) {
      int const k = chunk_k0 + lane;  // position in the order
      int b = -1;                     // the sequence there
      int blocks = 0;                 // of sequence b
      if (k < p.batch) {
        b = p.seq_order != nullptr ? p.seq_order[k] : k;
        if (unsigned(b) < unsigned(p.batch)) {  // always, for an order from seq_order_kernel (sm90_seq_order.cuh)
          int64_t start;
          int len;
          if constexpr (kKeys) {
            varlen_rows(p.cu_seqlens_k, b, p.rows_k, p.seqlen_k, start, len);
          } else {
            varlen_rows(p.cu_seqlens_q, b, p.rows_q, p.seqlen_q, start, len);
          }
          blocks = (len + kBlock - 1) / kBlock;
        }
      }
      int const numbers = blocks * units;  // <= batch * units * ceil(max_len / kBlock) < 2^31 (checked by the launchers)
      int incl = numbers;                  // inclusive prefix over the chunk's lanes
      CUTE_UNROLL
      for (int o = 1; o < 32; o *= 2) {
        int const y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      int const chunk_numbers = __shfl_sync(0xffffffffu, incl, 31);
      if (t < chunk_base + chunk_numbers) {
        // the first lane whose inclusive prefix passes t holds the number's sequence
        unsigned const past = __ballot_sync(0xffffffffu, chunk_base + incl > t);
        int const src = __ffs(past) - 1;
        int const before = __shfl_sync(0xffffffffu, incl - numbers, src);
        int const seq_blocks = __shfl_sync(0xffffffffu, blocks, src);
        int const seq = __shfl_sync(0xffffffffu, b, src);
        return found(seq, t - chunk_base - before, seq_blocks);
      }
      chunk_base += chunk_numbers;
    }
    return none;
  }

  CUTE_DEVICE VarlenNumber find(FmhaProblemParams const& p, int t, int units) {
    return find(p, t, units, VarlenNumber{-1, 0, 0},
                [](int b, int r, int blocks) { return VarlenNumber{b, r, blocks}; });
  }
};

// ------------------------------------------------------------------------------------------------
// SM90 wgmma accumulator layouts: ((2, 2, N/8), MMA_M, MMA_N).
// (row, col) view: ((2 [row half], MMA_M), (2 [col pair], N/8, MMA_N)).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout const& l) {
  static_assert(decltype(rank<0>(l))::value == 3, "expects an SM90 GMMA accumulator layout");
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// Accumulator of a 64xN wgmma reinterpreted as the A-operand register fragment of an RS wgmma
// with K = N: ((2, 2, N/8), M, 1) -> ((2, 2, 2), M, N/16).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_to_A_regs(Layout const& l) {
  static_assert(decltype(rank<0>(l))::value == 3, "expects an SM90 GMMA accumulator layout");
  auto v = logical_divide(get<0>(l), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(v), get<1>(v), get<2, 0>(v)), get<1>(l),
                     make_layout(get<2, 1>(v), get<2>(l)));
}

// ------------------------------------------------------------------------------------------------
// Issue one warpgroup GEMM (all K slices, or slices [K0, K1) when K1 >= 0) as one wgmma batch; does not wait.
// kARegs: A comes from registers (RS wgmma); its registers must stay unchanged until a warpgroup_wait covers the
// batch. zero_init: the first slice overwrites C.
template <bool kARegs, int K0 = 0, int K1 = -1, class TiledMma, class TA, class TB, class TC>
CUTE_DEVICE void wg_gemm(TiledMma& tm, TA const& A, TB const& B, TC& C, bool zero_init) {
  if constexpr (kARegs) warpgroup_fence_operand(const_cast<TA&>(A));
  warpgroup_fence_operand(C);
  warpgroup_arrive();
  tm.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  const int k_end = K1 < 0 ? int(size<2>(A)) : K1;
  CUTE_UNROLL
  for (int kb = K0; kb < k_end; ++kb) {
    cute::gemm(tm, A(_, _, kb), B(_, _, kb), C);
    tm.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(C);
  if constexpr (kARegs) warpgroup_fence_operand(const_cast<TA&>(A));
}

// Convert an fp32 register tensor into a same-sized 16-bit one (vectorized).
template <class TOut, class TIn>
CUTE_DEVICE void convert_frag(TIn const& in, TOut& out) {
  using To = typename TOut::value_type;
  constexpr int N = decltype(size(in))::value;
  static_assert(N % 2 == 0);
  using Conv = cutlass::NumericArrayConverter<To, float, 2, cutlass::FloatRoundStyle::round_to_nearest>;
  Conv conv;
  auto const* src = reinterpret_cast<cutlass::Array<float, 2> const*>(raw_pointer_cast(in.data()));
  auto* dst = reinterpret_cast<cutlass::Array<To, 2>*>(raw_pointer_cast(out.data()));
  CUTE_UNROLL
  for (int i = 0; i < N / 2; ++i) dst[i] = conv(src[i]);
}

// ------------------------------------------------------------------------------------------------
CUTE_DEVICE float fast_exp2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// x as lane 0 of the warp holds it. For a value every lane holds alike (a ring stage, say) that the compiler cannot
// prove warp-uniform: what it derives from the result (a wgmma smem descriptor) it computes in uniform registers.
CUTE_DEVICE int uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

CUTE_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return x;
}

CUTE_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x;
}

// Apply the mask to a score tile held in the (row, col) view. tScS: identity coordinates of the
// same view (tile-local (row, col)). row0/col0: the tile's first query/key index in the sequence.
template <class TS, class TC>
CUTE_DEVICE void apply_mask(TS& S, TC const& C, MaskInfo const& mi, int row0, int col0) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(S); ++r) {
    int row = row0 + get<0>(C(r, 0));
    int limit = mi.seqlen_k;
    if (mi.causal) {
      int c = row + mi.diag + 1;
      limit = c < limit ? c : limit;
    }
    limit -= col0;  // exclusive column bound within the tile
    CUTE_UNROLL
    for (int c = 0; c < size<1>(S); ++c) {
      if (get<1>(C(r, c)) >= limit) S(r, c) = -INFINITY;
    }
  }
}

}  // namespace mla_sm90
