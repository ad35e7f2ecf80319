// Warp-specialized MLA decode for 16/32-row tiles (H * Sq <= 32), SM80 style (mma.sync m16n8k16,
// cp.async with zero fill, ldmatrix, XOR-swizzled smem); built for sm_80 and sm_90. One CTA per SM.
//
// Why a second kernel: the 16-row case is memory-bound, and the all-warps kernel (mla_decode_kernel) spent
// ~6800 issued warp-instructions per 32-token tile (ncu on the H200: IPC 2.25, 54% of issue slots), with the
// QK, softmax and PV phases of a tile strictly in sequence. Here
//   - warps 0-3 ("QK warps") issue all KV loads and compute S = Q K^T, each over a 144-dim slice of the
//     576-dim contraction with its Q fragments in registers (36 or 72 registers), so K is read from smem
//     once per tile and Q never; the four partial S tiles meet in smem, then the same warps run the online
//     softmax (one row per 8 or 4 threads) and publish P and the row rescale factors;
//   - warps 4-7 ("PV warps") compute O = O * alpha + P V on 128 of the 512 output dims each;
//   - P and alpha are double-buffered, so the QK warps compute tile j+1 while the PV warps finish tile j.
// One hand-off per tile: both groups bar.sync on kBarPFull after the QK warps wrote P(j) and the PV warps
// finished PV(j-1), which orders P(j)/alpha(j) before PV(j) and PV(j-1) before the reuse of its P buffer
// and KV stage. No __syncthreads in the loop. (An earlier bar.arrive producer let the QK warps run two
// tiles ahead, with S-2 tiles in flight: 187 us against this version's 177 us at H=16, B=128, S=4096.)
// compute-sanitizer racecheck reports 2-3 hazards between the QK warps' stores before kBarPFull / kBarFinal and
// the PV warps' loads after them whenever the QK warps also sync among themselves on a second named barrier
// (kBarQK); tools/racecheck_probe.cu reproduces that on a minimal, ordered hand-off (mode 5). With that
// sync on an mbarrier instead (a module built with -DMLA_DECODE_QK_MBAR: tools/sanitize_small.py --qk-mbar; mode 6
// of the probe) racecheck follows the hand-offs and reports 0 hazards, with the same results bit for bit. The
// normal build keeps the named barrier: the mbarrier wait cost 3% at H=16, B=128 on the H200.
// Pipeline: S stages; after the hand-off of tile j the QK warps issue tile j+S-1 into the stage PV(j-1)
// released, so S-1 tiles are in flight beside the one being computed. Page ids are staged in a smem ring
// D = 2S-2 tiles ahead, fetched in the same commit groups (see the proof of distances in load order below).
#pragma once

#include "sm80/mla_decode/mla_decode_sm80_groups_kernel.cuh"
#include "sm80/mla_decode/mla_decode_sm80_kernel.cuh"

namespace mla_decode_sm80 {

// Named barrier with an immediate id and count. Not `bar.sync`: that is barrier.sync.aligned, which
// requires every participating thread to execute the same instruction; the QK and PV warps meet at
// kBarPFull / kBarFinal from different places in the code, which only the non-aligned form allows.
template <int kId, int kCount>
__device__ __forceinline__ void named_bar_sync() {
  asm volatile("barrier.sync %0, %1;\n" :: "n"(kId), "n"(kCount) : "memory");
}

// The 128 QK threads' own sync on an mbarrier (count kQKThreads): every thread arrives, then waits for the
// phase to complete. Same ordering as named barrier 1, but compute-sanitizer racecheck then also follows
// the QK -> PV hand-offs on kBarPFull / kBarFinal (tools/racecheck_probe.cu, modes 5 and 6).
__device__ __forceinline__ void mbar_sync(uint32_t bar, uint32_t& phase) {
  mbar_arrive(bar);
  mbar_wait(bar, phase);
  phase ^= 1u;
}

// Named barrier ids (0 is __syncthreads).
enum WsBarrier : int {
  kBarQK = 1,        // the 128 QK threads among themselves
  kBarPFull = 2,     // all 256: P(j), alpha(j) written and PV(j-1) done (P buffer (j+1) % 2, KV stage j-1 free)
  kBarFinal = 3,     // all 256: 1/l of every row written
};

// The QK warps' own sync: on an mbarrier in a module built with -DMLA_DECODE_QK_MBAR (for compute-sanitizer
// racecheck, see above), else on named barrier 1.
#if defined(MLA_DECODE_QK_MBAR)
constexpr bool kQkMbar = true;
#else
constexpr bool kQkMbar = false;
#endif

template <typename Elem, int M_TILE>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_ws_kernel(const DecodeParams p) {
  using Cfg = WsTileConfig<M_TILE>;
  constexpr int MT = Cfg::kMTiles, KS = Cfg::kKSteps, TPR = Cfg::kTPR, EPT = Cfg::kEPT, PVN = Cfg::kPVNTiles;

  const int item = blockIdx.y;
  const int mblock = blockIdx.x;
  const unsigned long long t_entry = stamp_clock();  // stamps: 0 unless built with MLA_DECODE_STAMPS
  const WorkItem w = work_item(p, item);
  if (threadIdx.x == 0) {
    stamp_value(p, item, kStampEntry, t_entry);
    stamp_now(p, item, kStampScheduled);
    stamp_id(p, item, w.b < 0 ? -1 : w.n_tiles);
  }
  if (w.b < 0) return;  // grid is sized from shapes; unused items exit (whole CTA, before any barrier)
  const int b = w.b, kv_begin = w.kv_begin, kv_end = w.kv_end, n_tiles = w.n_tiles;
  const int L = request_len(p, b);
  const int stages = p.stages;
  const int rows_total = p.seqlen_q * p.hq;
  const int row0 = mblock * M_TILE;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sKV = smem;
  float* sS = reinterpret_cast<float*>(sKV + stages * kBlockN * kRowBytes);      // [4][M_TILE][kSStride]
  uint8_t* sP = reinterpret_cast<uint8_t*>(sS + Cfg::kQKWarps * M_TILE * Cfg::kSStride);  // [2][M_TILE][kPStride]
  // alpha and 1/l: one slot per softmax thread ([2][M_TILE][TPR] and [M_TILE][TPR]) so every QK thread
  // stores (no lane-predicated stores before the hand-off barrier); readers take slot 0 of their row.
  float* sAlpha = reinterpret_cast<float*>(sP + 2 * M_TILE * kPStride * 2);
  float* sInvL = sAlpha + 2 * Cfg::kQKThreads;
  int* sPage = reinterpret_cast<int*>(sInvL + Cfg::kQKThreads);                 // [kPageRing][kBlockN]
  uint64_t* sQkBar = reinterpret_cast<uint64_t*>(sPage + kPageRing * kBlockN);
  const uint32_t sKV_a = static_cast<uint32_t>(__cvta_generic_to_shared(sKV));
  const uint32_t sP_a = static_cast<uint32_t>(__cvta_generic_to_shared(sP));
  const uint32_t sPage_a = static_cast<uint32_t>(__cvta_generic_to_shared(sPage));
  constexpr uint32_t kTileBytes = kBlockN * kRowBytes;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int q4 = lane & 3;
  const uint32_t qk_bar = static_cast<uint32_t>(__cvta_generic_to_shared(sQkBar));
  if constexpr (kQkMbar) {
    if (tid == 0) mbar_init(qk_bar, Cfg::kQKThreads);
    __syncthreads();  // the init visible before any arrive
  }

  if (warp < Cfg::kQKWarps) {
    uint32_t qk_phase = 0;
    auto qk_sync = [&]() {
      if constexpr (kQkMbar) mbar_sync(qk_bar, qk_phase);
      else named_bar_sync<kBarQK, Cfg::kQKThreads>();
    };
    // =============================================================== QK warps: loads, S, softmax
    const int page_mask = p.page_size - 1;
    const Elem* ckv = reinterpret_cast<const Elem*>(p.ckv);
    const Elem* kpe = reinterpret_cast<const Elem*>(p.kpe);
    // Load order: the prologue commits one group per tile 0..S-2; iteration j commits one group with KV
    // tile j+S-1 and the page ids of tile j+D. Group number n therefore holds KV tile n, and at iteration j
    // (S-1+j groups committed) wait_group(S-2) completes tile j. The page ids of tile j+D land with group
    // S-1+j, i.e. by iteration j+S-1, which is exactly when KV tile j+D-(S-1) = j+S-1 is issued. The ring
    // (kPageRing = 2 kMaxStages tiles) holds tiles j+S-1 .. j+D, S of them.
    const int D = 2 * stages - 2;

    // The Q tile goes by cp.async (in the first commit group, with KV tile 0) into KV stage S-1, which the
    // prologue leaves free until iteration 0 issues tile S-1 after its hand-off; the QK warps take their
    // fragments from it by ldmatrix before that. Why not plain loads into registers: with 36 scattered 4-byte
    // loads per thread the Q fragments landed 6.9 us after the CTA started (median, %globaltimer stamps on the
    // H200 at B=4, S=32768; page ids at 1.4 us), and KV tile 0 waited for them; as one cp.async tile, Q and
    // tile 0 land at 5.0 us, and that call's main kernel went from 55.6 to 52.1 us.
    const uint32_t sQ_a = sKV_a + (stages - 1) * kTileBytes;
    static_assert(M_TILE <= kBlockN, "the Q tile fits one KV stage");
    load_q_tile<Elem, M_TILE, Cfg::kQKThreads>(p, b, row0, sQ_a, tid);
    // page ids of tiles [0, D) with plain loads; later tiles arrive by cp.async
    stage_page_ids(p, w, sPage, D, tid, Cfg::kQKThreads);

    qk_sync();  // prologue page ids visible

    // KV tile loader (128 threads): warp w takes rows w, w+4, ..., each as two 512-byte ckv halves (a
    // warp instruction covers 512 contiguous bytes) and, 8 rows per instruction, the 128-byte kpe rows.
    // The per-row cost is what matters here (it sits on the QK warps' critical path): strides are 32-bit
    // (the host checks), the lane's column offset is folded into its base pointers, and the swizzled smem
    // column of each copy is one of two per-lane constants (row % 8 alternates between w and w + 4).
    // Rows past the range are zero-filled; their page-ring entry is 0, so the unused address is in bounds.
    const uint32_t ckv_sp = uint32_t(p.ckv_page_stride), ckv_sr = uint32_t(p.ckv_row_stride);
    const uint32_t kpe_sp = uint32_t(p.kpe_page_stride), kpe_sr = uint32_t(p.kpe_row_stride);
    // element offset of a cache row: one 32 x 32 -> 64-bit multiply-add (page ids are >= 0)
    auto row_off = [&](int page, int tok, uint32_t sp, uint32_t sr) -> uint64_t {
      return uint64_t(uint32_t(page)) * sp + uint32_t(tok & page_mask) * sr;
    };
    const Elem* ckv_lane = ckv + lane * 8;
    const Elem* kpe_lane = kpe + (lane & 7) * 8;
    const uint32_t col_a0 = swz(warp, lane * 8) - warp * kRowBytes;
    const uint32_t col_a1 = swz(warp, 256 + lane * 8) - warp * kRowBytes;
    const uint32_t col_b0 = swz(warp + 4, lane * 8) - (warp + 4) * kRowBytes;
    const uint32_t col_b1 = swz(warp + 4, 256 + lane * 8) - (warp + 4) * kRowBytes;
    const int kpe_row = warp + Cfg::kQKWarps * (lane >> 3);             // + 16 k: same row % 8
    const uint32_t kpe_dst = swz(kpe_row, kDimCkv + (lane & 7) * 8);
    auto load_kv = [&](int tile) {
      const uint32_t dst = sKV_a + (tile % stages) * kTileBytes;
      const int* pid = sPage + (tile % kPageRing) * kBlockN;
      const int tok0 = kv_begin + tile * kBlockN;
#pragma unroll
      for (int k = 0; k < kBlockN / Cfg::kQKWarps; ++k) {
        const int r = warp + Cfg::kQKWarps * k;
        const int tok = tok0 + r;
        int page = pid[r];
        const bool ok = page_in_cache(p, page) && tok < kv_end;
        const Elem* src = ckv_lane + row_off(page, tok, ckv_sp, ckv_sr);
        const uint32_t d = dst + r * kRowBytes;
        cp_async16(d + ((k & 1) ? col_b0 : col_a0), src, ok);
        cp_async16(d + ((k & 1) ? col_b1 : col_a1), src + 256, ok);
      }
#pragma unroll
      for (int k = 0; k < kBlockN / 16; ++k) {
        const int r = kpe_row + 16 * k;
        const int tok = tok0 + r;
        int page = pid[r];
        const bool ok = page_in_cache(p, page) && tok < kv_end;
        const Elem* src = kpe_lane + row_off(page, tok, kpe_sp, kpe_sr);
        cp_async16(dst + kpe_dst + 16 * k * kRowBytes, src, ok);
      }
    };
    for (int s = 0; s < stages - 1; ++s) {
      if (s < n_tiles) load_kv(s);
      cp_async_commit();
    }

    // softmax ownership: row sr, columns [sc0, sc0 + EPT) of each tile
    const int sr = tid / TPR;
    const int sc0 = (tid % TPR) * EPT;
    int lim;  // last visible KV position of row sr (-1: padding row)
    {
      const int grow = row0 + sr;
      lim = kv_end - 1;
      if (p.causal) lim = min(lim, L - p.seqlen_q + grow / p.hq);  // token t sees positions <= L - Sq + t
      if (grow >= rows_total) lim = -1;
    }
    float m_run = -INFINITY, l_part = 0.f;

    // ldmatrix source of K for this warp's slice: rows (lane & 7) + 8 * bit4 (+16 for the second n pair),
    // chunk 18 * warp + 2 * ks + bit3; the swizzle depends on row % 8 = lane % 8 only.
    const int krow = (lane & 7) + ((lane >> 4) & 1) * 8;
    const int kcol = warp * Cfg::kKSlice + ((lane >> 3) & 1) * 8;

    // Q fragments (A operand of m16n8k16: rows g and g+8, columns 2*q4 + {0, 1, 8, 9} of each k-step) of
    // this warp's 144-dim slice, from the Q tile (rows past Sq*H are zero)
    uint32_t qf[MT][KS][4];
    cp_async_wait_dyn(stages - 2);
    qk_sync();  // the Q tile (first commit group) landed for all QK threads
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        ldsm_x4(sQ_a + swz(mt * 16 + (lane & 15), warp * Cfg::kKSlice + ks * 16 + (lane >> 4) * 8), qf[mt][ks]);

    if (tid == 0) stamp_now(p, item, kStampFirstTile);
    for (int j = 0; j < n_tiles; ++j) {
      cp_async_wait_dyn(stages - 2);
      qk_sync();  // tile j landed for all QK threads; sS free again
      const uint32_t kv_a = sKV_a + (j % stages) * kTileBytes;
      const int tok0 = kv_begin + j * kBlockN;

      // two accumulator sets (even / odd k-steps): 8 * MT independent mma chains of <= 5, not 4 * MT of 9
      float acc[MT][4][4], acc2[MT][4][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = acc2[mt][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint32_t a0 = kv_a + swz(krow, kcol + ks * 16);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bb[4];
          ldsm_x4(a0 + np * 16 * kRowBytes, bb);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            float (&c0)[4] = (ks & 1) ? acc2[mt][2 * np] : acc[mt][2 * np];
            float (&c1)[4] = (ks & 1) ? acc2[mt][2 * np + 1] : acc[mt][2 * np + 1];
            mma16816<Elem>(c0, qf[mt][ks], bb[0], bb[1]);
            mma16816<Elem>(c1, qf[mt][ks], bb[2], bb[3]);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] += acc2[mt][nt][e];
      {
        float* mine = sS + warp * M_TILE * Cfg::kSStride;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const int r = mt * 16 + g, c = nt * 8 + 2 * q4;
            *reinterpret_cast<float2*>(mine + r * Cfg::kSStride + c) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
            *reinterpret_cast<float2*>(mine + (r + 8) * Cfg::kSStride + c) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
          }
      }
      qk_sync();  // the four partial S tiles visible

      // ---- online softmax of row sr, columns [sc0, sc0 + EPT) ----
      float s[EPT];
#pragma unroll
      for (int e4 = 0; e4 < EPT; e4 += 4) {
        float4 v = *reinterpret_cast<const float4*>(sS + sr * Cfg::kSStride + sc0 + e4);
#pragma unroll
        for (int w = 1; w < Cfg::kQKWarps; ++w) {
          const float4 u = *reinterpret_cast<const float4*>(sS + (w * M_TILE + sr) * Cfg::kSStride + sc0 + e4);
          v.x += u.x; v.y += u.y; v.z += u.z; v.w += u.w;
        }
        s[e4 + 0] = v.x; s[e4 + 1] = v.y; s[e4 + 2] = v.z; s[e4 + 3] = v.w;
      }
      float mx = -INFINITY;
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        s[e] = (tok0 + sc0 + e <= lim) ? s[e] * p.scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[e]);
      }
#pragma unroll
      for (int off = 1; off < TPR; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_run, mx);
      const float mu = (m_new == -INFINITY) ? 0.f : m_new;
      const float alpha = fast_exp2(m_run - mu);  // exp2(-inf) = 0
      m_run = m_new;
      uint32_t pk[EPT / 2];
      float rs = 0.f;
#pragma unroll
      for (int e = 0; e < EPT; e += 2) {
        const float p0 = fast_exp2(s[e] - mu), p1 = fast_exp2(s[e + 1] - mu);
        rs += p0 + p1;
        pk[e / 2] = pack2<Elem>(p0, p1);
      }
      l_part = l_part * alpha + rs;

      // ---- hand P(j) to the PV warps (buffer j % 2: PV(j-2) finished before the previous hand-off) ----
      const int pb = j & 1;
      uint8_t* prow = sP + (pb * M_TILE * kPStride + sr * kPStride + sc0) * 2;
      if constexpr (EPT == 4) *reinterpret_cast<uint2*>(prow) = make_uint2(pk[0], pk[1]);
      else *reinterpret_cast<uint4*>(prow) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
      sAlpha[pb * Cfg::kQKThreads + tid] = alpha;  // = [pb][sr][tid % TPR]
      named_bar_sync<kBarPFull, kThreads>();

      // ---- next loads: KV tile j+S-1 into the stage PV(j-1) released, page ids of tile j+D ----
      if (j + stages - 1 < n_tiles) load_kv(j + stages - 1);
      if (j + D < n_tiles) load_page_ids_async(p, w, sPage_a, j + D, tid);
      cp_async_commit();
    }
    cp_async_wait_dyn(0);
    if (tid == 0) stamp_now(p, item, kStampLoopEnd);

    // ---- row sums, 1/l for the PV warps, LSE ----
#pragma unroll
    for (int off = 1; off < TPR; off <<= 1) l_part += __shfl_xor_sync(0xffffffffu, l_part, off);
    const bool empty = !(l_part > 0.f);
    sInvL[tid] = empty ? 0.f : 1.f / l_part;  // = [sr][tid % TPR]
    if (tid % TPR == 0 && row0 + sr < rows_total)
      store_lse(p, w, item, row0 + sr, empty ? -INFINITY : m_run + __log2f(l_part));
    named_bar_sync<kBarFinal, kThreads>();
  } else {
    // =============================================================== PV warps: O = O * alpha + P V
    const int pw = warp - Cfg::kQKWarps;
    float o[MT][PVN][4];
    zero_frags(o);
    // ldmatrix.trans source of V: rows ks*16 + (lane & 7) + 8 * bit3, columns pw*128 + np*16 + 8 * bit4
    const int vrow = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int vcol = pw * Cfg::kPVCols + (lane >> 4) * 8;

    for (int j = 0; j < n_tiles; ++j) {
      const int pb = j & 1;
      named_bar_sync<kBarPFull, kThreads>();  // P(j), alpha(j) and (through the QK warps' waits) KV tile j
      const uint32_t kv_a = sKV_a + (j % stages) * kTileBytes;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float a_lo = sAlpha[pb * Cfg::kQKThreads + (mt * 16 + g) * TPR];
        const float a_hi = sAlpha[pb * Cfg::kQKThreads + (mt * 16 + g + 8) * TPR];
#pragma unroll
        for (int nt = 0; nt < PVN; ++nt) {
          o[mt][nt][0] *= a_lo; o[mt][nt][1] *= a_lo;
          o[mt][nt][2] *= a_hi; o[mt][nt][3] *= a_hi;
        }
      }
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldsm_x4(sP_a + ((pb * M_TILE + mt * 16 + (lane & 15)) * kPStride + ks * 16 + (lane >> 4) * 8) * 2, a[mt]);
#pragma unroll
        for (int np = 0; np < PVN / 2; ++np) {
          uint32_t bb[4];
          ldsm_x4_t(kv_a + swz(ks * 16 + vrow, vcol + np * 16), bb);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma16816<Elem>(o[mt][2 * np], a[mt], bb[0], bb[1]);
            mma16816<Elem>(o[mt][2 * np + 1], a[mt], bb[2], bb[3]);
          }
        }
      }
    }
    named_bar_sync<kBarFinal, kThreads>();

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = mt * 16 + g + hh * 8;
        const int grow = row0 + row;
        if (grow >= rows_total) continue;
        store_out_row<Elem, PVN>(p, w, item, grow, pw * Cfg::kPVCols, q4, o[mt], hh, sInvL[row * TPR]);
      }
    }
    if (tid == kThreads - 1) stamp_now(p, item, kStampEnd);
  }
}

template <typename Elem, int M_TILE>
cudaError_t launch_decode_ws_tile(const DecodeParams& p, cudaStream_t stream) {
  return launch_main_kernel<mla_decode_ws_kernel<Elem, M_TILE>>(WsTileConfig<M_TILE>::smem_bytes(p.stages), stream, p);
}

}  // namespace mla_decode_sm80

namespace mla_decode_sm80 {

// Every main kernel of one dtype: the warp-specialized kernel when the host chose it (p.ws), else the all-warps
// kernel for 16/32-row tiles, and for 64-row tiles the row-group kernel (p.groups) or the all-warps one.
template <typename Elem>
cudaError_t launch_decode_any(const DecodeParams& p, int m_tile, cudaStream_t stream) {
  if (p.ws && m_tile == 16) return launch_decode_ws_tile<Elem, 16>(p, stream);
  if (p.ws) return launch_decode_ws_tile<Elem, 32>(p, stream);
  if (m_tile == 16) return launch_decode_tile<Elem, 16>(p, stream);
  if (m_tile == 32) return launch_decode_tile<Elem, 32>(p, stream);
  if (p.groups) return launch_decode_groups<Elem>(p, stream);
  return launch_decode_tile<Elem, 64>(p, stream);
}

}  // namespace mla_decode_sm80
