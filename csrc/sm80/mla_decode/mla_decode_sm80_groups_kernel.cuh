// 64-row MLA decode, 64 KV tokens per step, with two decoupled row groups (GroupsConfig), SM80 style (mma.sync
// m16n8k16, cp.async, ldmatrix, XOR-swizzled smem); built for sm_80 and sm_90, launched where its smem fits (sm_90).
//
// The split-contraction QK keeps rows 0-31 in warps 0-3 and rows 32-63 in warps 4-7; PV follows the same split,
// so the two 4-warp groups share nothing but the KV stages:
//   - group r (warps 4r..4r+3) owns rows [32 r, 32 r + 32): S by split contraction (qk_split_32x32), its row
//     maxima, P, and O = P V for those rows, each warp 128 of the 512 output dims (fp32 O: 32 x 128 per warp,
//     the same 128 registers as 64 x 64);
//   - the groups meet only at the KV stages, through mbarriers: full[s] (tile landed: group 1's 128 threads
//     arrive by cp.async.mbarrier.arrive once their copies have landed) and empty[s] (group 0's four warps
//     arrive after their PV of the tile). Group 1 issues every load, after its own PV of the stage's previous
//     tile, so group 0 runs ahead;
//   - within a group, named barriers (128 threads) replace __syncthreads.
// Measured on the H200 (docs/kernels/mla_decode_sm80.md): the decoupling alone was no faster than running all
// eight warps in lockstep with CTA-wide barriers; the gain (266 -> 295 TF/s at 128 heads) came with ldmatrix
// addresses from per-lane offsets (qk_split_32x32 and the PV loop below), a 5-8% win in this layout.
// Pipeline: two stages of 64 tokens (the H200's 227 KB: Q 72 KB + 2 x 72 KB + P + page ids + 4 mbarriers).
// Tile i lives in stage i % 2; group 1 issues tile i + 1 at the top of its step i, once group 0 has finished
// tile i - 1 (empty) and tile i has landed (full: it also carries tile i + 1's page ids, staged two tiles ahead).
// Phases: full[s] and empty[s] complete once per tile of stage s, so tile i waits on parity (i / 2) & 1; neither
// group can be two phases ahead on one barrier (each wait precedes the other group's next arrival there).
#pragma once

#include "sm80/mla_decode/mla_decode_sm80_kernel.cuh"

namespace mla_decode_sm80 {

// Named barrier `id` over the 128 threads of one row group (bar.sync: every thread of the group runs this same
// instruction).
__device__ __forceinline__ void group_bar_sync(uint32_t id) {
  asm volatile("bar.sync %0, 128;\n" :: "r"(id) : "memory");
}
// The same barrier, returning whether `v` was true on any of the group's threads.
__device__ __forceinline__ bool group_bar_sync_or(uint32_t id, bool v) {
  uint32_t r;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 q, %2, 0;\n bar.red.or.pred p, %1, 128, q;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(r) : "r"(id), "r"(uint32_t(v)) : "memory");
  return r != 0;
}

template <typename Elem>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_groups_kernel(const DecodeParams p) {
  using Cfg = GroupsConfig;
  constexpr int BN = Cfg::kBN, MT = Cfg::kMT, PVN = Cfg::kPVN, kRing = Cfg::kRing;
  constexpr int QKN = 4;                         // 32 tokens per QK warp
  constexpr int kStageBytes = BN * kRowBytes;
  static_assert(Cfg::kStages == 2, "tile i lives in stage i & 1");

  const int item = blockIdx.y;
  const int mblock = blockIdx.x;
  const WorkItem w = work_item(p, item);
  if (w.b < 0) return;  // grid is sized from shapes; unused items exit
  const int b = w.b, kv_begin = w.kv_begin, kv_end = w.kv_end;
  const int n_tiles = kv_end > kv_begin ? (kv_end - kv_begin + BN - 1) / BN : 0;
  const int L = request_len(p, b);
  const int rows_total = p.seqlen_q * p.hq;
  const int row0 = mblock * 64;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sQ = smem;
  uint8_t* sKV = sQ + 64 * kRowBytes;
  uint8_t* sP = sKV + Cfg::kStages * kStageBytes;
  float* sRed = reinterpret_cast<float*>(sP + 64 * Cfg::kPStride * 2);  // [2 column halves][64 rows]: max, then sum
  int* sPage = reinterpret_cast<int*>(sRed + 2 * 64);
  uint64_t* sBar = reinterpret_cast<uint64_t*>(sPage + kRing * BN);  // full[0..1], empty[0..1]
  const uint32_t sQ_a = static_cast<uint32_t>(__cvta_generic_to_shared(sQ));
  const uint32_t sKV_a = static_cast<uint32_t>(__cvta_generic_to_shared(sKV));
  const uint32_t sP_a = static_cast<uint32_t>(__cvta_generic_to_shared(sP));
  const uint32_t sPage_a = static_cast<uint32_t>(__cvta_generic_to_shared(sPage));
  const uint32_t full_a = static_cast<uint32_t>(__cvta_generic_to_shared(sBar));
  const uint32_t empty_a = full_a + 16;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int q4 = lane & 3;
  const int grp = warp >> 2;    // row group: tile rows [32 grp, 32 grp + 32)
  const int gw = warp & 3;      // warp in the group: PV output dims [128 gw, 128 gw + 128); QK (kh, wc) below
  const int gtid = tid & (Cfg::kGroupThreads - 1);
  const uint32_t group_bar = 5 + grp;  // named barriers 1-4: the QK pairs; 5, 6: the groups

  const Elem* ckv = reinterpret_cast<const Elem*>(p.ckv);
  const Elem* kpe = reinterpret_cast<const Elem*>(p.kpe);

  if (tid == 0) {
    mbar_init(full_a, Cfg::kGroupThreads);
    mbar_init(full_a + 8, Cfg::kGroupThreads);
    mbar_init(empty_a, Cfg::kGroupWarps);
    mbar_init(empty_a + 8, Cfg::kGroupWarps);
  }
  stage_page_ids<BN, kRing>(p, w, sPage, 2, tid, kThreads);  // tiles 0 and 1; later ones by cp.async
  load_q_tile<Elem, 64>(p, b, row0, sQ_a, tid);
  cp_async_commit();
  __syncthreads();  // page ids of tiles 0-1 and the mbarrier inits visible

  // ---- KV loader: group 1's four warps (RowLoader) ----
  const RowLoader<Elem, Cfg::kGroupWarps, BN> row_loader(ckv, kpe, gw, lane);
  auto load_tile = [&](int tile) {
    row_loader.load(p, sKV_a + (tile & 1) * kStageBytes, sPage + (tile % kRing) * BN, kv_begin + tile * BN, kv_end);
  };

  if (grp == 1 && n_tiles > 0) {
    load_tile(0);
    cp_async_mbar_arrive(full_a);
  }
  cp_async_commit();
  cp_async_wait_dyn(1);  // the Q group (every thread committed two groups)
  __syncthreads();       // Q visible

  // ---- per-thread state ----
  float o[MT][PVN][4];
  zero_frags(o);
  float m_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = -INFINITY;
  float l_part[2] = {0.f, 0.f};

  const int kh = (warp >> 1) & 1;  // QK: contraction half, then rows [16 wr, 16 wr + 16) of the tile
  const int wc = warp & 1;         // QK: tokens [32 wc, 32 wc + 32) of the step
  const int wr = 2 * grp + kh;
  int qk_lim[2];
  qk_row_limits(p, row0 + wr * 16 + g, kv_end, L, qk_lim);
  // PV operand addresses. P: rows 32 grp + 16 mt + lane % 16, column chunk lane / 16 (linear: an immediate per
  // (mt, ks)). V (transposed ldmatrix): token rows 16 ks + lane % 8 + 8 ((lane / 8) % 2), dims 128 gw + 16 np +
  // 8 (lane / 16), i.e. chunk c = 16 gw + 2 np + x with x = lane / 16 and row % 8 = lane % 8 = r: the swizzled
  // chunk is 8 (2 gw + np / 4) + ((2 (np % 4)) ^ (x ^ r)), so four per-lane offsets (np % 4) plus immediates.
  const uint32_t p_lane = sP_a + uint32_t(((grp * 32 + (lane & 15)) * Cfg::kPStride + (lane >> 4) * 8) * 2);
  uint32_t voff[4];
#pragma unroll
  for (int q = 0; q < 4; ++q)
    voff[q] = uint32_t(((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + gw * 256 +
                       ((((lane >> 4) ^ (lane & 7)) * 16) ^ (32 * q)));
  // the QK pair's exchange slot: 2 KB inside this group's own P rows (free between the group's PV and its P store)
  float4* const xslot = reinterpret_cast<float4*>(sP + grp * (Cfg::kGroupRows * Cfg::kPStride * 2) + wc * (QKN * 32 * 16));

  for (int i = 0; i < n_tiles; ++i) {
    const int stage = i & 1;
    group_bar_sync(group_bar);                          // the group's PV(i - 1) done: its P rows and (group 1) stage free
    mbar_wait(full_a + 8 * stage, uint32_t(i >> 1) & 1);  // tile i landed (and tile i + 1's page ids)
    if (grp == 1 && i + 1 < n_tiles) {  // tile i + 1 into the other stage, tile i + 2's page ids into the ring
      if (i >= 1) mbar_wait(empty_a + 8 * (stage ^ 1), uint32_t((i - 1) >> 1) & 1);  // group 0 done with tile i - 1
      load_tile(i + 1);
      if (i + 2 < n_tiles) load_page_ids_async<BN, kRing>(p, w, sPage_a, i + 2, gtid);
      cp_async_mbar_arrive(full_a + 8 * (stage ^ 1));
    }
    const uint32_t kv_a = sKV_a + stage * kStageBytes;
    const int tok0 = kv_begin + i * BN;

    // ---- S = Q K^T for this warp's 16 rows x 32 tokens, row maxima ----
    float s[QKN][4];
    bool moves = false;
    {
      float sacc[QKN][4];
      qk_split_32x32<Elem>(sQ_a, kv_a, xslot, 1 + grp * 2 + wc, grp, kh, wc, lane, sacc);
      float mx[2];
      scale_mask_rowmax<QKN, true>(sacc, s, mx, tok0 + wc * 32, qk_lim, q4, p.scale_log2);
      if (q4 == 0) {
        sRed[wc * 64 + wr * 16 + g] = mx[0];
        sRed[wc * 64 + wr * 16 + g + 8] = mx[1];
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) moves |= mx[hh] > (kh ? m_run[1][hh] : m_run[0][hh]) + kRescaleLog2;
    }
    // the group's row maxima visible; and whether any of its rows' reference moves this step
    moves = group_bar_sync_or(group_bar, moves);

    // ---- reference max of the group's rows (identical on the group's threads); conditional rescale: the
    // reference moves only when a row max grows by more than kRescaleLog2 (P <= 2^8 otherwise; FlashAttention-4's
    // conditional rescale; -inf + 8 = -inf, so a first finite max always moves it), so on most steps no row moves,
    // O is left alone and the row maxima are not even read. The LSE is taken from the reference: the same math ----
    float alpha[MT][2];
    float qk_alpha[2] = {1.f, 1.f}, qk_muse[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float m = kh ? m_run[1][hh] : m_run[0][hh];
      qk_muse[hh] = m == -INFINITY ? 0.f : m;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) alpha[mt][0] = alpha[mt][1] = 1.f;
    if (moves) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = grp * 32 + mt * 16 + g + hh * 8;
          float mx = fmaxf(m_run[mt][hh], fmaxf(sRed[row], sRed[64 + row]));
          const bool keep = !(mx > m_run[mt][hh] + kRescaleLog2);
          if (keep) mx = m_run[mt][hh];
          const float mu = (mx == -INFINITY) ? 0.f : mx;
          alpha[mt][hh] = keep ? 1.f : fast_exp2(m_run[mt][hh] - mu);
          m_run[mt][hh] = mx;
          if (mt == kh) { qk_alpha[hh] = alpha[mt][hh]; qk_muse[hh] = mu; }
        }
      }
    }

    // ---- P = exp2(S - m) to smem, row sums ----
    store_p_rowsum<Elem, QKN, Cfg::kPStride>(s, qk_muse, qk_alpha, sP, wr * 16 + g, wc * 32, q4, l_part);
    group_bar_sync(group_bar);  // the group's P visible

    // ---- O = O * alpha + P V: the group's 32 rows x this warp's 128 dims ----
    {
      bool moved = false;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) moved |= (alpha[mt][0] != 1.f) | (alpha[mt][1] != 1.f);
      if (moves && __any_sync(0xffffffffu, moved)) rescale_o(o, alpha);
    }
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldsm_x4(p_lane + uint32_t((mt * 16 * Cfg::kPStride + ks * 16) * 2), a[mt]);
#pragma unroll
      for (int np = 0; np < PVN / 2; ++np) {
        uint32_t bb[4];
        ldsm_x4_t(kv_a + voff[np & 3] + uint32_t((np >> 2) * 128 + ks * 16 * kRowBytes), bb);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<Elem>(o[mt][2 * np], a[mt], bb[0], bb[1]);
          mma16816<Elem>(o[mt][2 * np + 1], a[mt], bb[2], bb[3]);
        }
      }
    }
    if (grp == 0) {  // this warp's reads of stage i % 2 are done (their registers were consumed above)
      __syncwarp();
      if (lane == 0) mbar_arrive(empty_a + 8 * stage);
    }
  }
  cp_async_wait_dyn(0);

  // ---- row sums of the group's rows (sRed: the group's last reads of its row maxima preceded its last barrier) ----
  quad_sum_rows(l_part);
  if (q4 == 0) {
    sRed[wc * 64 + wr * 16 + g] = l_part[0];
    sRed[wc * 64 + wr * 16 + g + 8] = l_part[1];
  }
  group_bar_sync(group_bar);

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = grp * 32 + mt * 16 + g + hh * 8;
      const int grow = row0 + row;
      if (grow >= rows_total) continue;
      const float l = sRed[row] + sRed[64 + row];
      const bool empty = !(l > 0.f);
      const float inv = empty ? 0.f : 1.f / l;
      store_out_row<Elem, PVN>(p, w, item, grow, gw * Cfg::kPVCols, q4, o[mt], hh, inv);
      if (gw == 0 && q4 == 0) store_lse(p, w, item, grow, empty ? -INFINITY : m_run[mt][hh] + __log2f(l));
    }
  }
}

template <typename Elem>
cudaError_t launch_decode_groups(const DecodeParams& p, cudaStream_t stream) {
  return launch_main_kernel<mla_decode_groups_kernel<Elem>>(GroupsConfig::smem_bytes(), stream, p);
}

}  // namespace mla_decode_sm80
