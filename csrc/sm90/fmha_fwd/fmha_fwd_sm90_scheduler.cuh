// Tile scheduler of the SM90 forward: which (head, batch, M-block) tiles a CTA runs, in which order.
//
// A tile is kBM query rows of one (head, sequence) against every key block they see. Two tile spaces:
//  - dense: (head, batch) pairs x num_m M-blocks, numbered in grouped_tile's L2-grouped launch order
//    (sm90_attn_common.cuh) with rank r -> M-block num_m - 1 - r, the longest under a causal mask first;
//  - varlen: only the tiles that hold rows, sequence after sequence; inside a sequence head after head, and
//    inside a head its M-blocks from the last (the longest under a causal mask) to the first. A grid over
//    max_seqlen x batch instead would be mostly empty tiles where lengths differ (31 documents of up to 4209
//    tokens in 32k: about 70% of max_seqlen x batch x heads tiles are past their sequence's end).
// The varlen numbering is decoded by one warp (VarlenNumbering, sm90_attn_common.cuh): a scan over
// ceil(len / kBM) * heads per sequence, 32 sequences per step, resumed where the previous decode stopped (a CTA's
// tile numbers only grow), so a CTA scans the cu_seqlens once over all of its tiles.
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
  // varlen: tiles numbered sequence after sequence (units: the heads), the scan resumed from tile to tile
  VarlenNumbering<kBM, false> varlen;

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
    return varlen.find(p, t, p.hq, FwdTileCoord{-1, 0, 0}, [](int b, int r, int seq_m) {
      int const h = r / seq_m;
      return FwdTileCoord{h, b, seq_m - 1 - (r - h * seq_m)};
    });
  }
};

}  // namespace mla_sm90
