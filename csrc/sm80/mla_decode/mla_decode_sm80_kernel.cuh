// Weight-absorbed MLA decode, SM80 style: mma.sync m16n8k16, multi-stage cp.async (zero-fill), ldmatrix
// (transposed for V), XOR-swizzled shared memory. Built for sm_80 and sm_90.
//
// One CTA = (m-block of M_TILE rows (token, head), work item = (request, KV range)). 8 warps:
//   - the warps that sit out the QK phase (16- and 64-row tiles), else all 256 threads, issue the 16-byte
//     cp.async loads of the KV stages (page ids staged in smem ahead);
//   - kQKWarps warps compute S = Q K^T (16 x kQKCols each, 576 deep), exchange row maxima through smem,
//     do the online softmax of their rows and write P (16-bit) to smem;
//   - all 8 warps do O += P V, each on 64 of the 512 output dims (fp32 accumulators M_TILE x 64 per warp).
// Where its smem fits (sm_90) 64-row tiles run the row-group kernel (mla_decode_sm80_groups_kernel.cuh) instead,
// built from the helpers here (per-row loader, split-contraction QK, P store, epilogue).
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "sm80/mla_decode/mla_decode_sm80_config.h"
#include "sm80/mla_decode/mla_decode_sm80_launch.h"
#include "sm80/mla_decode/mla_decode_sm80_stamps.h"
#include "sm80/mla_decode/mla_decode_sm80_params.h"
#include "sm80/mla_decode/mla_decode_sm80_schedule.h"

namespace mla_decode_sm80 {

template <typename Elem> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> { using Op = cute::SM80_16x8x16_F32BF16BF16F32_TN; };
template <> struct MmaOp<__half> { using Op = cute::SM80_16x8x16_F32F16F16F32_TN; };

template <typename Elem>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  MmaOp<Elem>::Op::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2], d[3]);
}

template <typename Elem> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void ldsm_x4(uint32_t smem_addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t smem_addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr));
}

// 16-byte cp.async.cg (L2 only) with zero fill when !pred (src-size 0: nothing is read).
__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gptr, bool pred) {
  const int src_size = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(smem_addr), "l"(gptr), "r"(src_size));
}
// 4-byte cp.async.ca with zero fill.
__device__ __forceinline__ void cp_async4(uint32_t smem_addr, const void* gptr, bool pred) {
  const int src_size = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(smem_addr), "l"(gptr), "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
  // wait_group needs an immediate; stages is a run-time value.
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
  }
}

// mbarrier primitives (sm_80+; the wait suspends in try_wait on sm_90, spins on test_wait on sm_80).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared.b64 st, [%0];\n}\n" :: "r"(bar) : "memory");
}
// Wait until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{\n .reg .pred done;\n WAIT_%=:\n mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n"
               " @!done bra WAIT_%=;\n}\n" :: "r"(bar), "r"(parity) : "memory");
#else
  asm volatile("{\n .reg .pred done;\n WAIT_%=:\n mbarrier.test_wait.parity.shared.b64 done, [%0], %1;\n"
               " @!done bra WAIT_%=;\n}\n" :: "r"(bar), "r"(parity) : "memory");
#endif
}
// One arrival on `bar` once every cp.async this thread issued so far has landed (.noinc: the arrival counts
// toward the barrier's expected count, which must include it).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" :: "r"(bar) : "memory");
}

// Byte offset of (row, col) in a [rows][576] 16-bit buffer whose 16-byte chunks are XOR-swizzled within
// each 128-byte group by row % 8 (col a multiple of 8): 8 consecutive rows at one logical chunk hit 8
// different bank groups, so ldmatrix (normal and transposed) and the cp.async stores are conflict-free.
__device__ __forceinline__ uint32_t swz(int row, int col) {
  const int c = col >> 3;
  const int pc = (c & ~7) | ((c ^ row) & 7);
  return uint32_t(row * kRowBytes + pc * 16);
}

// Zero a register array of mma fragments (accumulators start at 0).
template <int A, int B, int C>
__device__ __forceinline__ void zero_frags(float (&x)[A][B][C]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j)
#pragma unroll
      for (int k = 0; k < C; ++k) x[i][j][k] = 0.f;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- pieces both decode kernels share ----

// One work item of the device schedule: request b, KV range [kv_begin, kv_end) in kBlockN-token tiles;
// b < 0: an unused item (the grid is sized from shapes), which the CTA skips before any barrier.
struct WorkItem {
  int b, kv_begin, kv_end, n_tiles;
  bool final_out;  // the request has one split: write out/lse, not the split workspace
};
// The inline schedule (p.sched_inline): warp 0 of the CTA applies the split rule (schedule.h) to all B lengths and
// finds the request and split of `item`, as the metadata kernel would have written them, into s_item = (b or -1,
// kv_begin, kv_end, splits). The merge kernel derives the split counts it needs the same way. Why: a call without a
// precomputed schedule paid for the metadata kernel and the wait for its completion (at B=4, S=32768 on the H200,
// 57.7 us from the L2 flush to the merge's end against 55.3 with a schedule); bench_decode in one process each: such
// a call costs 1.1 us more than one with a schedule (60.4 vs 59.3 us), 1.7 us with the metadata kernel; at B=128,
// H=16 1.7 us, 2.5 before.
__device__ __forceinline__ void inline_schedule_item(const DecodeParams& p, int item, int (&s_item)[4]) {
  bool mine = false;
  int my_b = 0, my_first = 0, my_s = 0, my_L = 0;
  warp_request_splits(
      p,
      [&](int b, int first, int s, int L) {
        if (item >= first && item < first + s) {
          mine = true;
          my_b = b; my_first = first; my_s = s; my_L = L;
        }
      },
      [&](int base) { return base <= item; });
  const bool found = __ballot_sync(0xffffffffu, mine) != 0;  // by every lane, before the lanes diverge
  if (mine) {  // at most one lane: the requests' item ranges do not overlap
    const int j = item - my_first, x = tiles_of(my_L);
    s_item[0] = my_b;
    s_item[1] = split_first_tile(j, x, my_s) * kBlockN;
    s_item[2] = min(split_first_tile(j + 1, x, my_s) * kBlockN, my_L);
    s_item[3] = my_s;
  } else if (!found && (threadIdx.x & 31) == 0) {
    s_item[0] = -1;  // past the last used item
  }
}

// It is the first thing each main-kernel CTA does (every thread, before any other shared-memory use), so it
// also carries the PDL hand-off (launch.h): wait for the previous kernel (the metadata kernel's schedule, or the
// lengths) before reading anything, then let the merge kernel launch. In that order, the merge kernel starts only
// once every kernel before this one has completed, so it may read the lengths and a precomputed schedule before
// its own wait.
__device__ __forceinline__ WorkItem work_item(const DecodeParams& p, int item) {
  grid_dependency_wait();
  if (threadIdx.x == 0) stamp_now(p, item, kStampWaited);
  allow_dependent_launch();
  WorkItem w;
  if (p.sched_inline) {
    __shared__ int s_item[4];
    if (threadIdx.x < 32) inline_schedule_item(p, item, s_item);
    __syncthreads();
    w.b = s_item[0];
    w.kv_begin = s_item[1];
    w.kv_end = s_item[2];
    w.final_out = w.b >= 0 && s_item[3] == 1;
  } else {
    w.b = p.sched_items[item * 4 + 0];
    w.kv_begin = p.sched_items[item * 4 + 2];
    w.kv_end = p.sched_items[item * 4 + 3];
    w.final_out = w.b >= 0 && p.sched_reqs[w.b * 2 + 1] == 1;
  }
  // A precomputed schedule (decode_schedule) was made without the block_table: its ranges are clamped here.
  w.kv_end = min(w.kv_end, p.kv_capacity);
  w.n_tiles = w.kv_end > w.kv_begin ? (w.kv_end - w.kv_begin + kBlockN - 1) / kBlockN : 0;
  return w;
}

// Page ids of the item's tiles [0, n_pre) of BN tokens into the smem ring of RING tiles with plain loads
// (0 past the range), by `nthreads` threads from `tid`; later tiles arrive through load_page_ids_async.
template <int BN = kBlockN, int RING = kPageRing>
__device__ __forceinline__ void stage_page_ids(const DecodeParams& p, const WorkItem& w, int* sPage, int n_pre,
                                               int tid, int nthreads) {
  const int* bt = p.block_table + int64_t(w.b) * p.bt_batch_stride;
  for (int idx = tid; idx < n_pre * BN; idx += nthreads) {
    const int t = idx / BN, r = idx % BN;
    const int tok = w.kv_begin + t * BN + r;
    sPage[(t % RING) * BN + r] = tok < w.kv_end ? __ldg(bt + (tok >> p.log2_page)) : 0;
  }
}

// Page ids of `tile` (BN tokens) into its ring slot by 4-byte cp.async (threads 0..BN-1; zero past the range).
template <int BN = kBlockN, int RING = kPageRing>
__device__ __forceinline__ void load_page_ids_async(const DecodeParams& p, const WorkItem& w, uint32_t sPage_a, int tile,
                                                    int tid) {
  if (tid < BN) {
    const int* bt = p.block_table + int64_t(w.b) * p.bt_batch_stride;
    const int tok = w.kv_begin + tile * BN + tid;
    const bool ok = tok < w.kv_end;
    cp_async4(sPage_a + ((tile % RING) * BN + tid) * 4,
              ok ? static_cast<const void*>(bt + (tok >> p.log2_page)) : static_cast<const void*>(bt), ok);
  }
}

// This thread's part of one output row (row grow = t * H + h; half hh of the mma fragments o[][] over
// columns col0 + 8 nt + 2 q4), times inv = 1/l: to out (16-bit) or, for a split request, to the fp32
// split workspace.
template <typename Elem, int PVN>
__device__ __forceinline__ void store_out_row(const DecodeParams& p, const WorkItem& w, int item, int grow, int col0,
                                              int q4, const float (&o)[PVN][4], int hh, float inv) {
  if (w.final_out) {
    const int t = grow / p.hq, h = grow - t * p.hq;
    Elem* out = reinterpret_cast<Elem*>(p.out) + int64_t(w.b) * p.o_batch_stride + int64_t(t) * p.o_row_stride + int64_t(h) * p.o_head_stride;
#pragma unroll
    for (int nt = 0; nt < PVN; ++nt)
      *reinterpret_cast<uint32_t*>(out + col0 + nt * 8 + 2 * q4) = pack2<Elem>(o[nt][2 * hh] * inv, o[nt][2 * hh + 1] * inv);
  } else {
    float* wo = p.ws_o + (int64_t(item) * p.seqlen_q * p.hq + grow) * kDimCkv;
#pragma unroll
    for (int nt = 0; nt < PVN; ++nt)
      *reinterpret_cast<float2*>(wo + col0 + nt * 8 + 2 * q4) = make_float2(o[nt][2 * hh] * inv, o[nt][2 * hh + 1] * inv);
  }
}

// The LSE of row grow (lse2 in base 2): natural log into lse, or base 2 into the split workspace.
__device__ __forceinline__ void store_lse(const DecodeParams& p, const WorkItem& w, int item, int grow, float lse2) {
  if (w.final_out) {
    const int t = grow / p.hq, h = grow - t * p.hq;
    constexpr float kLn2 = 0.6931471805599453f;
    p.lse[int64_t(w.b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + t] = lse2 * kLn2;
  } else {
    p.ws_lse[int64_t(item) * p.seqlen_q * p.hq + grow] = lse2;
  }
}

// A page id from the ring, checked against the cache: an id outside [0, num_pages) (a bad block_table entry) becomes
// page 0 and false, and the caller predicates its copies off, so that token's rows read as zeros and no address
// outside the caches is formed. One compare and one select per row copy, beside its cp.async.
__device__ __forceinline__ bool page_in_cache(const DecodeParams& p, int& page) {
  const bool ok = unsigned(page) < unsigned(p.num_pages);
  page = ok ? page : 0;
  return ok;
}

// This lane's source in one cache row: page id and in-page row (both >= 0, 32-bit) times the 64-bit strides.
template <typename Elem>
__device__ __forceinline__ const Elem* cache_row(const Elem* lane_base, int page, int row_in_page, int64_t stride_page,
                                                 int64_t stride_row) {
  return lane_base + (uint64_t(uint32_t(page)) * uint64_t(stride_page) + uint64_t(uint32_t(row_in_page)) * uint64_t(stride_row));
}

// Last visible KV position of this thread's two QK rows (rows grow0 and grow0 + 8 of the request, i.e. (token,
// head) pairs; -1: a padding row sees nothing): the item's end, and with causal masking token t's own position
// L - Sq + t.
__device__ __forceinline__ void qk_row_limits(const DecodeParams& p, int grow0, int kv_end, int L, int (&lim)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int grow = grow0 + hh * 8;
    int l = kv_end - 1;
    if (p.causal) l = min(l, L - p.seqlen_q + grow / p.hq);
    lim[hh] = grow < p.seqlen_q * p.hq ? l : -1;
  }
}

// Per-row KV loader of the 64-token row-group kernel: NLW loader warps (warp lw of them, all 32 lanes) copy one step of BN
// token rows into a stage. Warp lw takes rows lw + NLW k, each as two 512-byte ckv halves (one warp instruction
// each); the kpe rows go 8 lanes per row, rows lt / 8 + 4 NLW k (lt = 32 lw + lane). A row's swizzled column depends
// only on row % 8: for the ckv rows one of 8 / NLW per-lane constants (k % (8 / NLW)), for the kpe rows one. A row
// costs one page-id read (all of a step's first: one shared-memory latency) and one offset (cache_row); rows past the
// range are zero-filled from page 0 (their ring entry), an in-bounds address.
template <typename Elem, int NLW, int BN>
struct RowLoader {
  static_assert(NLW == 4 || NLW == 8, "4 or 8 loader warps");
  static constexpr int kPar = 8 / NLW;
  static constexpr int kRows = BN / NLW;        // ckv rows per warp
  static constexpr int kKpeRows = BN * 8 / (NLW * 32);  // kpe rows per thread
  const Elem* ckv_lane;
  const Elem* kpe_lane;
  uint32_t col0[kPar], col1[kPar], kpe_dst;
  int lw, kpe_row;

  __device__ __forceinline__ RowLoader(const Elem* ckv, const Elem* kpe, int lw_, int lane) : lw(lw_) {
    ckv_lane = ckv + lane * 8;
    kpe_lane = kpe + (lane & 7) * 8;
#pragma unroll
    for (int par = 0; par < kPar; ++par) {
      const int r = lw + NLW * par;
      col0[par] = swz(r, lane * 8) - r * kRowBytes;
      col1[par] = swz(r, 256 + lane * 8) - r * kRowBytes;
    }
    kpe_row = (32 * lw + lane) >> 3;
    kpe_dst = swz(kpe_row, kDimCkv + (lane & 7) * 8);
  }

  // Tokens [tok0, tok0 + BN) (valid below kv_end) with page ids pid[0..BN) into the stage at shared address dst.
  __device__ __forceinline__ void load(const DecodeParams& p, uint32_t dst, const int* pid, int tok0, int kv_end) const {
    const int page_mask = p.page_size - 1;
    int pg[kRows], pgk[kKpeRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) pg[k] = pid[lw + NLW * k];
#pragma unroll
    for (int k = 0; k < kKpeRows; ++k) pgk[k] = pid[kpe_row + 4 * NLW * k];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const int r = lw + NLW * k;
      const int tok = tok0 + r;
      const bool ok = page_in_cache(p, pg[k]) && tok < kv_end;
      const Elem* src = cache_row(ckv_lane, pg[k], tok & page_mask, p.ckv_page_stride, p.ckv_row_stride);
      const uint32_t d = dst + r * kRowBytes;
      cp_async16(d + col0[k % kPar], src, ok);
      cp_async16(d + col1[k % kPar], src + 256, ok);
    }
#pragma unroll
    for (int k = 0; k < kKpeRows; ++k) {
      const int r = kpe_row + 4 * NLW * k;
      const int tok = tok0 + r;
      const bool ok = page_in_cache(p, pgk[k]) && tok < kv_end;
      const Elem* src = cache_row(kpe_lane, pgk[k], tok & page_mask, p.kpe_page_stride, p.kpe_row_stride);
      cp_async16(dst + kpe_dst + 4 * NLW * k * kRowBytes, src, ok);
    }
  }
};

// The 16-byte chunk c (0..71: q_nope's 64 chunks, then q_pe's 8) of the query row of new token t, head h, request b.
template <typename Elem>
__device__ __forceinline__ const Elem* q_chunk(const DecodeParams& p, int b, int t, int h, int c) {
  return c < 64 ? static_cast<const Elem*>(p.q_nope) + int64_t(b) * p.qn_batch_stride + int64_t(t) * p.qn_row_stride +
                      int64_t(h) * p.qn_head_stride + c * 8
                : static_cast<const Elem*>(p.q_pe) + int64_t(b) * p.qp_batch_stride + int64_t(t) * p.qp_row_stride +
                      int64_t(h) * p.qp_head_stride + (c - 64) * 8;
}

// The Q tile: rows (token, head) row0 .. row0 + M_TILE - 1 of request b into sQ (swizzled, 576 dims), zero past
// Sq * H; cp.async by NTHREADS threads (tid in [0, NTHREADS)), not committed.
template <typename Elem, int M_TILE, int NTHREADS = kThreads>
__device__ __forceinline__ void load_q_tile(const DecodeParams& p, int b, int row0, uint32_t sQ_a, int tid) {
  const int rows_total = p.seqlen_q * p.hq;
  for (int idx = tid; idx < M_TILE * 72; idx += NTHREADS) {
    const int r = idx / 72, c = idx % 72;
    const int grow = row0 + r;
    const bool ok = grow < rows_total;
    const int t = ok ? grow / p.hq : 0, h = ok ? grow % p.hq : 0;
    cp_async16(sQ_a + swz(r, c * 8), ok ? q_chunk<Elem>(p, b, t, h, c) : p.q_nope, ok);
  }
}

// P = exp2(S - m) of a QK warp's rows r0 + (0, 8) x tokens col0 + 8 nt + 2 q4 into the 16-bit P buffer (row stride
// PSTRIDE elements), and the running row sums l = l * alpha + rowsum(P) (this thread's part).
template <typename Elem, int QKN, int PSTRIDE>
__device__ __forceinline__ void store_p_rowsum(const float (&s)[QKN][4], const float (&muse)[2], const float (&alpha)[2],
                                               uint8_t* sP, int r0, int col0, int q4, float (&l_part)[2]) {
  float rs[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < QKN; ++nt) {
    float pv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pv[e] = fast_exp2(s[nt][e] - muse[e >> 1]);
      rs[e >> 1] += pv[e];
    }
    const int col = col0 + nt * 8 + 2 * q4;
    *reinterpret_cast<uint32_t*>(sP + (r0 * PSTRIDE + col) * 2) = pack2<Elem>(pv[0], pv[1]);
    *reinterpret_cast<uint32_t*>(sP + ((r0 + 8) * PSTRIDE + col) * 2) = pack2<Elem>(pv[2], pv[3]);
  }
  l_part[0] = l_part[0] * alpha[0] + rs[0];
  l_part[1] = l_part[1] * alpha[1] + rs[1];
}

// O *= alpha per row (rows mt * 16 + g and + 8 of the fragments).
template <int MT, int PVN>
__device__ __forceinline__ void rescale_o(float (&o)[MT][PVN][4], const float (&alpha)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < PVN; ++nt) {
      o[mt][nt][0] *= alpha[mt][0]; o[mt][nt][1] *= alpha[mt][0];
      o[mt][nt][2] *= alpha[mt][1]; o[mt][nt][3] *= alpha[mt][1];
    }
}

// Row sums of a QK warp's two rows over its quad (every lane of the quad then holds them).
__device__ __forceinline__ void quad_sum_rows(float (&l_part)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    l_part[hh] += __shfl_xor_sync(0xffffffffu, l_part[hh], 1);
    l_part[hh] += __shfl_xor_sync(0xffffffffu, l_part[hh], 2);
  }
}

// S in the log2 domain (times scale_log2) for a warp's 16 rows x 8 QKN tokens from token tok_c0, -inf past each
// row's last visible position lim[hh], and the row maxima over these tokens (quad-reduced, so every lane of a
// row's quad holds it). kSkipInside: when all of the warp's tokens lie inside both rows' ranges (every step but the
// last and, causal, those before the diagonal), the mask arithmetic is skipped.
template <int QKN, bool kSkipInside>
__device__ __forceinline__ void scale_mask_rowmax(const float (&sacc)[QKN][4], float (&s)[QKN][4], float (&mx)[2],
                                                  int tok_c0, const int (&lim)[2], int q4, float scale_log2) {
  mx[0] = mx[1] = -INFINITY;
  bool inside = false;
  if constexpr (kSkipInside) inside = __all_sync(0xffffffffu, tok_c0 + QKN * 8 - 1 <= min(lim[0], lim[1]));
  if (inside) {
#pragma unroll
    for (int nt = 0; nt < QKN; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = sacc[nt][e] * scale_log2;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
      }
  } else {
#pragma unroll
    for (int nt = 0; nt < QKN; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hh = e >> 1;
        const int tok = tok_c0 + nt * 8 + 2 * q4 + (e & 1);
        const float v = tok <= lim[hh] ? sacc[nt][e] * scale_log2 : -INFINITY;
        s[nt][e] = v;
        mx[hh] = fmaxf(mx[hh], v);
      }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
    mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
  }
}

// S of a 64-token step by split contraction: warp (rh, kh, wc) computes rows [32 rh, 32 rh + 32) x tokens
// [32 wc, 32 wc + 32) over half of the 576 dims (every other 16-dim k-step): a 32 x 32 warp tile reads Q and K
// fragments half as often per mma as 16 x 32 (4 ldmatrix per 8 mma instead of 6), which is what bounds the QK
// phase (ncu: mma waiting on ldmatrix). The partner warp (other kh) then trades halves through `slot` (2 KB, 16-byte aligned, free from
// before the first write until after the last read here) under named barrier `bar_id` (64 threads): kh = 0 sends
// rows 16-31, then kh = 1 adds them and sends rows 0-15 from the same slot (its own read precedes its write).
// Each keeps 16 rows: sacc = S[32 rh + 16 kh + (16-row fragment)][32 wc + (32 tokens)], unscaled.
template <typename Elem>
__device__ __forceinline__ void qk_split_32x32(uint32_t sQ_a, uint32_t kv_a, float4* slot, uint32_t bar_id, int rh,
                                               int kh, int wc, int lane, float (&sacc)[4][4]) {
  constexpr int QKN = 4;
  float acc[2][QKN][4];
  zero_frags(acc);
  // The two halves interleave by k-step: warp kh takes k-steps 2j + kh (j < 18), i.e. 16-byte chunks
  // c = 4j + 2kh + x of its rows, x = lane's chunk within the ldmatrix (0/1). With row % 8 = r fixed per lane, the
  // swizzled chunk is (c & ~7) | ((c ^ r) & 7) = 8 (j >> 1) + ((4 (j & 1)) ^ ((2kh + x) ^ r)): per lane two byte
  // offsets (j even / odd) plus an immediate, so the fully unrolled loop needs no address arithmetic per ldmatrix.
  const int r8 = lane & 7;
  const uint32_t xa = uint32_t(((2 * kh + (lane >> 4)) ^ r8) * 16);        // Q rows: chunk x = lane / 16
  const uint32_t xb = uint32_t(((2 * kh + ((lane >> 3) & 1)) ^ r8) * 16);  // K rows: chunk x = (lane / 8) % 2
  const uint32_t qrow = sQ_a + uint32_t(rh * 32 + (lane & 15)) * kRowBytes;
  const uint32_t krow = kv_a + uint32_t(wc * 32 + (lane & 7) + ((lane >> 4) << 3)) * kRowBytes;
  const uint32_t qa[2] = {qrow + xa, qrow + (xa ^ 64)};
  const uint32_t kb[2] = {krow + xb, krow + (xb ^ 64)};
  constexpr int kSteps = kDimQK / 2 / 16;  // 18 per warp
  uint32_t a[2][2][4], bq[2][2][4];        // [buffer][16-row / 16-token half][fragment]: loads run one k-step ahead
  auto load = [&](int j, int buf) {
    const uint32_t imm = uint32_t(j >> 1) * 128;
    ldsm_x4(qa[j & 1] + imm, a[buf][0]);
    ldsm_x4(qa[j & 1] + imm + 16 * kRowBytes, a[buf][1]);
    ldsm_x4(kb[j & 1] + imm, bq[buf][0]);
    ldsm_x4(kb[j & 1] + imm + 16 * kRowBytes, bq[buf][1]);
  };
  load(0, 0);
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    if (j + 1 < kSteps) load(j + 1, (j + 1) & 1);
    const int buf = j & 1;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        mma16816<Elem>(acc[mt][2 * np], a[buf][mt], bq[buf][np][0], bq[buf][np][1]);
        mma16816<Elem>(acc[mt][2 * np + 1], a[buf][mt], bq[buf][np][2], bq[buf][np][3]);
      }
  }
  slot += lane;
  auto pair_sync = [&]() { asm volatile("bar.sync %0, 64;\n" :: "r"(bar_id) : "memory"); };
  if (kh == 0) {
#pragma unroll
    for (int nt = 0; nt < QKN; ++nt) slot[nt * 32] = make_float4(acc[1][nt][0], acc[1][nt][1], acc[1][nt][2], acc[1][nt][3]);
    pair_sync();
    pair_sync();
#pragma unroll
    for (int nt = 0; nt < QKN; ++nt) {
      const float4 o4 = slot[nt * 32];
      sacc[nt][0] = acc[0][nt][0] + o4.x; sacc[nt][1] = acc[0][nt][1] + o4.y;
      sacc[nt][2] = acc[0][nt][2] + o4.z; sacc[nt][3] = acc[0][nt][3] + o4.w;
    }
  } else {
    pair_sync();
#pragma unroll
    for (int nt = 0; nt < QKN; ++nt) {
      const float4 o4 = slot[nt * 32];
      sacc[nt][0] = o4.x + acc[1][nt][0]; sacc[nt][1] = o4.y + acc[1][nt][1];
      sacc[nt][2] = o4.z + acc[1][nt][2]; sacc[nt][3] = o4.w + acc[1][nt][3];
      slot[nt * 32] = make_float4(acc[0][nt][0], acc[0][nt][1], acc[0][nt][2], acc[0][nt][3]);
    }
    pair_sync();
  }
}

template <typename Elem, int M_TILE>
__global__ void __launch_bounds__(kThreads, TileConfig<M_TILE>::kMinBlocks) mla_decode_kernel(const DecodeParams p) {
  using Cfg = TileConfig<M_TILE>;
  constexpr int BN = kBlockN;
  constexpr int kRing = kPageRing;
  constexpr int MT = Cfg::kMTiles;
  constexpr int WC = Cfg::kWC;
  constexpr int QKN = Cfg::kQKNTiles;
  constexpr int PVN = Cfg::kPVNTiles;

  const int item = blockIdx.y;
  const int mblock = blockIdx.x;
  const WorkItem w = work_item(p, item);
  if (w.b < 0) return;  // grid is sized from shapes; unused items exit
  const int b = w.b, kv_begin = w.kv_begin, kv_end = w.kv_end;
  const int n_tiles = kv_end > kv_begin ? (kv_end - kv_begin + BN - 1) / BN : 0;  // steps of BN tokens
  const int L = request_len(p, b);
  const int stages = p.stages;
  const int rows_total = p.seqlen_q * p.hq;
  const int row0 = mblock * M_TILE;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sQ = smem;
  uint8_t* sKV = sQ + M_TILE * kRowBytes;
  uint8_t* sP = sKV + stages * BN * kRowBytes;
  float* sRedMax = reinterpret_cast<float*>(sP + M_TILE * kPStride * 2);
  float* sRedSum = sRedMax + WC * M_TILE;
  int* sPage = reinterpret_cast<int*>(sRedMax + 2 * WC * M_TILE);
  const uint32_t sQ_a = static_cast<uint32_t>(__cvta_generic_to_shared(sQ));
  const uint32_t sKV_a = static_cast<uint32_t>(__cvta_generic_to_shared(sKV));
  const uint32_t sP_a = static_cast<uint32_t>(__cvta_generic_to_shared(sP));
  const uint32_t sPage_a = static_cast<uint32_t>(__cvta_generic_to_shared(sPage));

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;   // mma row group
  const int q4 = lane & 3;   // mma quad lane

  const int page_mask = p.page_size - 1;
  const Elem* ckv = reinterpret_cast<const Elem*>(p.ckv);
  const Elem* kpe = reinterpret_cast<const Elem*>(p.kpe);

  // ---- page ids of the first 2*stages-2 tiles (plain loads; later tiles arrive by cp.async) ----
  stage_page_ids<BN, kRing>(p, w, sPage, 2 * stages - 2, tid, kThreads);

  // ---- Q tile (rows (token, head), zero-filled past Sq*H) ----
  load_q_tile<Elem, M_TILE>(p, b, row0, sQ_a, tid);
  __syncthreads();  // page ids of the first tiles visible

  // ---- KV tile loader: 64 ckv chunks + 8 kpe chunks per token row. NL loader threads (lt = 0..NL-1):
  // when some warps sit out the QK phase, only those, so that a stalled cp.async issue overlaps the QK phase
  // instead of delaying it; else all 256 threads. ----
  auto load_kv_n = [&](auto nl_const, int tile, int lt) {
    constexpr int NL = decltype(nl_const)::value;
    static_assert(NL % 64 == 0 && (BN * 64) % NL == 0, "loader thread count");
    const int buf = tile % stages;
    const uint32_t dst = sKV_a + buf * (BN * kRowBytes);
    const int* pid = sPage + (tile % kRing) * BN;
    const int tok0 = kv_begin + tile * BN;
    const int c = lt & 63;
#pragma unroll 4
    for (int k = 0; k < BN * 64 / NL; ++k) {
      const int r = (lt >> 6) + (NL / 64) * k;
      const int tok = tok0 + r;
      int page = pid[r];
      const bool ok = page_in_cache(p, page) && tok < kv_end;
      const int64_t off = int64_t(page) * p.ckv_page_stride + int64_t(tok & page_mask) * p.ckv_row_stride + c * 8;
      cp_async16(dst + swz(r, c * 8), ok ? static_cast<const void*>(ckv + off) : p.ckv, ok);
    }
#pragma unroll
    for (int k = 0; k < (BN * 8 + NL - 1) / NL; ++k) {
      const int idx = lt + k * NL;
      if (idx < BN * 8) {
        const int r = idx >> 3, cc = idx & 7;
        const int tok = tok0 + r;
        int page = pid[r];
        const bool ok = page_in_cache(p, page) && tok < kv_end;
        const int64_t off = int64_t(page) * p.kpe_page_stride + int64_t(tok & page_mask) * p.kpe_row_stride + cc * 8;
        cp_async16(dst + swz(r, kDimCkv + cc * 8), ok ? static_cast<const void*>(kpe + off) : p.kpe, ok);
      }
    }
  };
  constexpr int kIdleThreads = (kWarps - Cfg::kQKWarps) * 32;
  auto load_kv = [&](int tile) {
    if constexpr (kIdleThreads >= 64) {
      if (warp >= Cfg::kQKWarps) load_kv_n(std::integral_constant<int, kIdleThreads>{}, tile, tid - Cfg::kQKWarps * 32);
    } else {
      load_kv_n(std::integral_constant<int, kThreads>{}, tile, tid);
    }
  };

  auto load_pages = [&](int tile) { load_page_ids_async<BN, kRing>(p, w, sPage_a, tile, tid); };

  for (int s = 0; s < stages - 1; ++s) {
    if (s < n_tiles) load_kv(s);
    cp_async_commit();
  }

  // ---- per-thread state ----
  float o[MT][PVN][4];
  zero_frags(o);
  float m_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = -INFINITY;
  float l_part[2] = {0.f, 0.f};

  const bool qk_warp = warp < Cfg::kQKWarps;
  const int wr = warp / WC;           // QK row group (valid when qk_warp)
  const int wc = warp % WC;           // QK column group
  int qk_lim[2];
  qk_row_limits(p, row0 + wr * 16 + g, kv_end, L, qk_lim);

  for (int i = 0; i < n_tiles; ++i) {
    cp_async_wait_dyn(stages - 2);
    __syncthreads();  // B1: tile i landed (all threads' groups); buffers of tile i-1 and P are free
    {
      const int j = i + stages - 1;
      if (j < n_tiles) load_kv(j);
      const int t2 = i + 2 * stages - 2;
      if (t2 < n_tiles) load_pages(t2);
      cp_async_commit();
    }
    const uint32_t kv_a = sKV_a + (i % stages) * (BN * kRowBytes);
    const int tok0 = kv_begin + i * BN;

    // ---- S = Q K^T on the QK warps ----
    float s[QKN][4];
    if (qk_warp) {
      float sacc[QKN][4];  // this warp's 16 rows x kQKCols tokens of S (unscaled)
      {
        constexpr int NACC = Cfg::kQKAcc;
        float acc[QKN][NACC][4];
        zero_frags(acc);
        const int arow = wr * 16 + (lane & 15);
        const int acol = (lane >> 4) * 8;
        constexpr int kHalf = NACC / 2;  // k-chunks of 32 cycled over the accumulator pairs
        static_assert((kDimQK / 32) % kHalf == 0, "k chunks must divide evenly");
#pragma unroll (M_TILE == 32 ? 2 : 3)
        for (int kq = 0; kq < kDimQK / 32; kq += kHalf) {
#pragma unroll
          for (int hf = 0; hf < kHalf; ++hf) {
            const int kp = kq + hf;
            uint32_t a0[4], a1[4];
            ldsm_x4(sQ_a + swz(arow, kp * 32 + acol), a0);
            ldsm_x4(sQ_a + swz(arow, kp * 32 + 16 + acol), a1);
#pragma unroll
            for (int nt = 0; nt < QKN; ++nt) {
              uint32_t bb[4];
              const int brow = wc * Cfg::kQKCols + nt * 8 + (lane & 7);
              ldsm_x4(kv_a + swz(brow, kp * 32 + (lane >> 3) * 8), bb);
              mma16816<Elem>(acc[nt][hf * 2 + 0], a0, bb[0], bb[1]);
              mma16816<Elem>(acc[nt][hf * 2 + 1], a1, bb[2], bb[3]);
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < QKN; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float sum = 0.f;
#pragma unroll
            for (int a = 0; a < NACC; ++a) sum += acc[nt][a][e];
            sacc[nt][e] = sum;
          }
      }
      float mx[2];
      scale_mask_rowmax<QKN, false>(sacc, s, mx, tok0 + wc * Cfg::kQKCols, qk_lim, q4, p.scale_log2);
      if (q4 == 0) {
        sRedMax[wc * M_TILE + wr * 16 + g] = mx[0];
        sRedMax[wc * M_TILE + wr * 16 + g + 8] = mx[1];
      }
    }
    __syncthreads();  // B2: row maxima of this tile visible

    // ---- new running max for every row this thread touches (identical on all threads) ----
    float alpha[MT][2], m_use[MT][2];
    float qk_alpha[2] = {1.f, 1.f}, qk_muse[2] = {0.f, 0.f};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = mt * 16 + g + hh * 8;
        float mx = m_run[mt][hh];
#pragma unroll
        for (int c = 0; c < WC; ++c) mx = fmaxf(mx, sRedMax[c * M_TILE + row]);
        const float mu = (mx == -INFINITY) ? 0.f : mx;
        alpha[mt][hh] = fast_exp2(m_run[mt][hh] - mu);  // exp2(-inf) = 0
        m_use[mt][hh] = mu;
        m_run[mt][hh] = mx;
        if (mt == wr) { qk_alpha[hh] = alpha[mt][hh]; qk_muse[hh] = mu; }
      }
    }

    // ---- P = exp2(S - m), row sums, P to smem ----
    if (qk_warp)
      store_p_rowsum<Elem, QKN, kPStride>(s, qk_muse, qk_alpha, sP, wr * 16 + g, wc * Cfg::kQKCols, q4, l_part);
    __syncthreads();  // B3: P visible

    // ---- O = O * alpha + P V (each warp: all M_TILE rows x 64 dims) ----
    rescale_o(o, alpha);
#pragma unroll (M_TILE == 32 ? 1 : 2)
    for (int ks = 0; ks < BN / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldsm_x4(sP_a + ((mt * 16 + (lane & 15)) * kPStride + ks * 16 + (lane >> 4) * 8) * 2, a[mt]);
#pragma unroll
      for (int np = 0; np < PVN / 2; ++np) {
        uint32_t bb[4];
        const int vrow = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int vcol = warp * Cfg::kPVCols + np * 16 + (lane >> 4) * 8;
        ldsm_x4_t(kv_a + swz(vrow, vcol), bb);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<Elem>(o[mt][2 * np], a[mt], bb[0], bb[1]);
          mma16816<Elem>(o[mt][2 * np + 1], a[mt], bb[2], bb[3]);
        }
      }
    }
  }
  cp_async_wait_dyn(0);

  // ---- final row sums: quad reduce, exchange across the QK column groups ----
  if (qk_warp) {
    quad_sum_rows(l_part);
    if (q4 == 0) {
      sRedSum[wc * M_TILE + wr * 16 + g] = l_part[0];
      sRedSum[wc * M_TILE + wr * 16 + g + 8] = l_part[1];
    }
  }
  __syncthreads();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = mt * 16 + g + hh * 8;
      const int grow = row0 + row;
      if (grow >= rows_total) continue;
      float l = 0.f;
#pragma unroll
      for (int c = 0; c < WC; ++c) l += sRedSum[c * M_TILE + row];
      const bool empty = !(l > 0.f);
      const float inv = empty ? 0.f : 1.f / l;
      store_out_row<Elem, PVN>(p, w, item, grow, warp * Cfg::kPVCols, q4, o[mt], hh, inv);
      if (warp == 0 && q4 == 0) store_lse(p, w, item, grow, empty ? -INFINITY : m_run[mt][hh] + __log2f(l));
    }
  }
}

}  // namespace mla_decode_sm80

namespace mla_decode_sm80 {

template <typename Elem, int M_TILE>
cudaError_t launch_decode_tile(const DecodeParams& p, cudaStream_t stream) {
  return launch_main_kernel<mla_decode_kernel<Elem, M_TILE>>(TileConfig<M_TILE>::smem_bytes(p.stages), stream, p);
}

}  // namespace mla_decode_sm80
