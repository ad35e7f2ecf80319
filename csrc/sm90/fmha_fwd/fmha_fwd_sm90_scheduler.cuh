// Tile scheduler of the SM90 forward: which (head, batch, M-block) tiles a CTA runs, in which order.
//
// A tile is kBM query rows of one (head, sequence) against every key block they see. Two tile spaces:
//  - dense: (head, batch) pairs x num_m M-blocks, numbered in grouped_tile's L2-grouped launch order
//    (sm90_attn_common.cuh) with rank r -> M-block num_m - 1 - r, the longest under a causal mask first;
//  - varlen: only the tiles that hold rows, sequence after sequence; inside a sequence head after head, and
//    inside a head its M-blocks from the last (the longest under a causal mask) to the first. A grid over
//    max_seqlen x batch instead would be mostly empty tiles where lengths differ (31 documents of up to 4209
//    tokens in 32k: about 70% of max_seqlen x batch x heads tiles are past their sequence's end).
// The varlen numbering is decoded by one warp: a scan over ceil(len / kBM) * heads per sequence, 32 sequences
// per step, resumed where the previous decode stopped (a CTA's tile numbers only grow), so a CTA scans the
// cu_seqlens once over all of its tiles.
// Assignment: static (CTA c runs c, c + gridDim.x, ...) or dynamic (the next number from a counter in global
// memory, taken when the CTA's producer has issued the loads of its current tile).
#pragma once

#include <cstdint>
#include <cute/tensor.hpp>

#include "sm90/fmha_fwd/fmha_fwd_sm90_params.h"
#include "sm90/sm90_attn_common.cuh"

namespace mla_sm90 {

// A tile's coordinates as the producer hands them to the consumers (h < 0: no more tiles).
struct FwdTileCoord {
  int h, b, m_block;
};

// One tile of the forward: its (head, batch, M-block), the sequence's rows and the key blocks it visits.
struct FwdTile {
  int h, b, m_block;
  SeqInfo si;
  MaskInfo mi;
  int n_min, n_max;

  template <int kBM, int kBN>
  CUTE_DEVICE static FwdTile at(FmhaFwdSm90Params const& p, FwdTileCoord c) {
    SeqInfo si(p, c.b);
    MaskInfo mi(si.seqlen_q, si.seqlen_k, p.causal, p.bottom_right);
    FwdTile tile{c.h, c.b, c.m_block, si, mi, 0, 0};
    mi.template n_block_range<kBM, kBN>(tile.m_block, tile.n_min, tile.n_max);
    return tile;
  }
  // Rows of this sequence in the tile: true of every tile the scheduler hands out (its varlen list counts
  // M-blocks from the same clamped lengths, varlen_rows, as SeqInfo).
  template <int kBM>
  CUTE_DEVICE bool has_rows() const { return m_block * kBM < si.seqlen_q; }
  // Q, K and V are loaded (rows that see at least one key block); else the tile only writes O = 0, LSE = -inf.
  template <int kBM>
  CUTE_DEVICE bool loads() const { return has_rows<kBM>() && n_max > n_min; }
};

// The producer warp's scheduler state. decode() and next() are warp-collective (all 32 lanes, converged).
template <int kBM>
struct FwdTileScheduler {
  FmhaFwdSm90Params const& p;
  int num_hb, num_m;
  // varlen: the first sequence of the scan's current 32-sequence chunk, and the tiles before it
  int chunk_b0 = 0;
  int chunk_base = 0;

  CUTE_DEVICE FwdTileScheduler(FmhaFwdSm90Params const& p_, int num_hb_, int num_m_)
      : p(p_), num_hb(num_hb_), num_m(num_m_) {}

  CUTE_DEVICE int first() const { return int(blockIdx.x); }

  CUTE_DEVICE int next(int t) const {
    int n = t + int(gridDim.x);
    if (p.tile_counter != nullptr) {
      int const lane = threadIdx.x % 32;
      if (lane == 0) n = atomicAdd(p.tile_counter, 1) + int(gridDim.x);
      n = __shfl_sync(0xffffffffu, n, 0);
    }
    return n;
  }

  // Tile number t -> its coordinates; h = -1 past the last tile.
  CUTE_DEVICE FwdTileCoord decode(int t) {
    if (p.cu_seqlens_q == nullptr) {
      if (t >= num_hb * num_m) return {-1, 0, 0};
      GroupedTile const tc = grouped_tile(t, num_hb, num_m, p.l2_head_group);
      return {tc.pair % p.hq, tc.pair / p.hq, num_m - 1 - tc.rank};
    }
    int const lane = threadIdx.x % 32;
    for (; chunk_b0 < p.batch; chunk_b0 += 32) {
      int const b = chunk_b0 + lane;
      int m_blocks = 0;  // of sequence b
      if (b < p.batch) {
        int64_t start;
        int len;
        varlen_rows(p.cu_seqlens_q, b, p.rows_q, p.seqlen_q, start, len);
        m_blocks = (len + kBM - 1) / kBM;
      }
      int const tiles = m_blocks * p.hq;  // <= batch * hq * num_m < 2^31 (checked by the launcher)
      int incl = tiles;                   // inclusive prefix over the chunk's lanes
      CUTE_UNROLL
      for (int o = 1; o < 32; o *= 2) {
        int const y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      int const chunk_tiles = __shfl_sync(0xffffffffu, incl, 31);
      if (t < chunk_base + chunk_tiles) {
        // the first lane whose inclusive prefix passes t holds the tile's sequence
        unsigned const past = __ballot_sync(0xffffffffu, chunk_base + incl > t);
        int const src = __ffs(past) - 1;
        int const before = __shfl_sync(0xffffffffu, incl - tiles, src);
        int const seq_m = __shfl_sync(0xffffffffu, m_blocks, src);
        int const r = t - chunk_base - before;
        int const h = r / seq_m;
        return {h, chunk_b0 + src, seq_m - 1 - (r - h * seq_m)};
      }
      chunk_base += chunk_tiles;
    }
    return {-1, 0, 0};
  }
};

}  // namespace mla_sm90
