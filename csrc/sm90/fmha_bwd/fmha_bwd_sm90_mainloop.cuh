// Consumer warpgroups of the SM90 fused attention backward's main kernel (family fmha_bwd_sm90): their
// body (consume), the unswapped (d = 192) and swapped (d <= 128) main loops over a CTA's M-blocks, and
// the per-M-block dQ hand-off to the reducer warp. fmha_bwd_sm90_kernel.cuh describes the whole.
#pragma once

#include "fmha_bwd_sm90_epilogue.cuh"
#include "fmha_bwd_sm90_scheduler.cuh"
#include "fmha_bwd_sm90_traits.cuh"

namespace fmha_bwd_sm90 {

using namespace cute;

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
// 16 bytes at a time in the dq_store_pos layout, fences for the bulk copy's async proxy, signals. cwg: this
// thread's consumer warpgroup; wg_barriers (p.dq_wg_barriers): wait and signal on that warpgroup's own barrier
// pair with the reducer, else on the pair both warpgroups share (docs/kernels/fmha_bwd_sm90.md, "The dQ path").
template <int D, class TAcc, class TCoord>
__device__ __forceinline__ void store_dq_block(const TAcc& tdQrdQ, const TCoord& tdQcdQ, float* sdq, int cwg,
                                               bool wg_barriers) {
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
  // the previous block has been read
  if (wg_barriers) cutlass::arch::NamedBarrier::sync(kDqWgBarThreads, dq_empty_bar(cwg));
  else cutlass::arch::NamedBarrier::sync(kDqBarThreads, kBarDqEmpty);
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
  if (wg_barriers) cutlass::arch::NamedBarrier::arrive(kDqWgBarThreads, dq_full_bar(cwg));
  else cutlass::arch::NamedBarrier::arrive(kDqBarThreads, kBarDqFull);
}

// ------------------------------------------------------------------------------------------------
// Main loop, unswapped schedule (d = 192): both operands of every wgmma in smem, the two WGs split N.
// Accumulates dK^T / dV^T (dims x keys) of this CTA's K/V block into tdKrdK / tdVrdV.
template <class Tr, class AccK, class AccV>
__device__ __forceinline__ void mainloop_unswapped(const MainArgs<Tr>& args, typename Tr::SharedStorage& ss,
                                                   const CtaWork& w, AccK& tdKrdK, AccV& tdVrdV) {
  using Element = typename Tr::Element;
  constexpr int BM = Tr::BM, BN = Tr::BN, D = Tr::D, Stages = Tr::Stages;
  const FmhaBwdSm90Params& p = args.p;
  const Seq& sq = w.sq;
  const int n_block = w.n_block, hkv = w.hkv, m_min = w.m_min, n_m = w.n_m, group = w.group;
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
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  // smem operand descriptors partitioned for the warpgroup (a warp-uniform index), so that they are computed in
  // uniform registers (see fmha_fwd_sm90_kernel.cuh)
  int const wg_thread0 = (cutlass::canonical_warp_group_idx() - 1) * 128;
  auto wg_sdp = mma_sdp.get_thread_slice(wg_thread0);
  auto wg_dkv = mma_dkv.get_thread_slice(wg_thread0);
  auto wg_dq = mma_dq.get_thread_slice(wg_thread0);

  Tensor tdVrdOt = wg_dkv.partition_fragment_A(sdOt);
  Tensor tdVrPt = wg_dkv.partition_fragment_B(sPt);
  Tensor tdKrQt = wg_dkv.partition_fragment_A(sQt);
  Tensor tdKrdSt = wg_dkv.partition_fragment_B(sdSt);
  Tensor tdQrdS = wg_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = wg_dq.partition_fragment_B(sKt);

  // P and dS leave the accumulators through transposing stmatrix (8x8 blocks of 16-bit values, one
  // 16-byte smem row per key): the P^T/dS^T buffers are keys-major with the queries contiguous.
  auto r2s_pds = make_tiled_copy_C(Copy_Atom<typename Tr::StsmT, Element>{}, mma_sdp);
  auto thr_r2s = r2s_pds.get_thread_slice(tidx);
  Tensor tPsP = thr_r2s.partition_D(sP);
  Tensor tdSsdS = thr_r2s.partition_D(sdS);

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
    Tensor tSrQ = wg_sdp.partition_fragment_A(make_tensor(make_smem_ptr(q_base), typename Tr::SmemLayoutQ{}));
    Tensor tSrK = wg_sdp.partition_fragment_B(make_tensor(make_smem_ptr(k_base), typename Tr::SmemLayoutK{}));
    Tensor tdPrdO = wg_sdp.partition_fragment_A(make_tensor(make_smem_ptr(do_base), typename Tr::SmemLayoutdO{}));
    Tensor tdPrV = wg_sdp.partition_fragment_B(make_tensor(make_smem_ptr(v_base), typename Tr::SmemLayoutV{}));
    mla_sm90::wg_gemm<false>(mma_sdp, tSrQ(_, _, _, mla_sm90::uniform(st)), tSrK, tSrS, true);
    mla_sm90::wg_gemm<false>(mma_sdp, tdPrdO(_, _, _, mla_sm90::uniform(st)), tdPrV, tdPrdP, true);
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
          const bool valid = kj < sq.seqlen_k && (!p.causal || kj <= qi + off);
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
      mla_sm90::wg_gemm<false>(mma_dkv, tdVrdOt(_, _, _, mla_sm90::uniform(stage)), tdVrPt, tdVrdV, it == 0);
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
      mla_sm90::wg_gemm<false>(mma_dkv, tdKrQt(_, _, _, mla_sm90::uniform(stage)), tdKrdSt, tdKrdK, it == 0);
      warpgroup_wait<1>();  // dV^T and dQ done; dK^T may still run
      warpgroup_fence_operand(tdQrdQ);

      store_dq_block<D>(tdQrdQ, tdQcdQ, ss.dq.data(), cwg, p.dq_wg_barriers);
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
}

// ------------------------------------------------------------------------------------------------
// Main loop, swapped schedule (kSwapSdP, d <= 128). Consumer WG c owns keys [64c, 64c + 64) of the
// K/V block. Per M-block:
//   S^T = K Q^T, dP^T = V dO^T (SS, issued back to back)
//   P^T = exp2(S^T * scale_log2 - lse_log2[query]) masked;  dV += P^T dO (RS, P^T from registers)
//   dS^T = P^T (dP^T - dpsum[query]);                       dK += dS^T Q (RS)
//   dS^T -> smem (buffer it % 2), both WGs' halves -> dQ = dS K (SS, the WGs split D)
// The dS^T buffers alternate, so a WG may store the next M-block's dS^T while the other WG's dQ GEMM
// still reads this one: one 256-thread barrier per step.
// Accumulates dK / dV (keys x dims) of this CTA's K/V block into tdKrdK / tdVrdV.
template <class Tr, class AccK, class AccV>
__device__ __forceinline__ void mainloop_swapped(const MainArgs<Tr>& args, typename Tr::SharedStorage& ss,
                                                 const CtaWork& w, AccK& tdKrdK, AccV& tdVrdV) {
  using Element = typename Tr::Element;
  using BMt = typename Tr::BMt; using BNt = typename Tr::BNt; using Dt = typename Tr::Dt;
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
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  // smem operand descriptors partitioned for the warpgroup (a warp-uniform index), so that they are computed in
  // uniform registers (see fmha_fwd_sm90_kernel.cuh)
  int const wg_thread0 = (cutlass::canonical_warp_group_idx() - 1) * 128;
  auto wg_sdp = mma_sdp.get_thread_slice(wg_thread0);
  auto wg_dv = mma_dv.get_thread_slice(wg_thread0);
  auto wg_dk = mma_dk.get_thread_slice(wg_thread0);
  auto wg_dq = mma_dq.get_thread_slice(wg_thread0);

  Tensor tSrK = wg_sdp.partition_fragment_A(sK);    // (MMA, 1, D/16): this WG's 64 keys
  Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);    // (MMA, 1, D/16, Stages)
  Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = wg_sdp.partition_fragment_B(sdO);
  Tensor tdVrdOt = wg_dv.partition_fragment_B(sdOt);  // (MMA, 1, BM/16, Stages)
  Tensor tdKrQt = wg_dk.partition_fragment_B(sQt);
  Tensor tdQrdS0 = wg_dq.partition_fragment_A(sdS0);
  Tensor tdQrdS1 = wg_dq.partition_fragment_A(sdS1);
  Tensor tdQrKt = wg_dq.partition_fragment_B(sKt);
  Tensor tdSsdS0 = thr_sdp.partition_C(sdSt0);
  Tensor tdSsdS1 = thr_sdp.partition_C(sdSt1);
  // smem addresses of this thread's first dS^T pair in each buffer (the rest: see the store)
  const uint32_t ds_addr0 = cute::cast_smem_ptr_to_uint(&tdSsdS0(0));
  const uint32_t ds_addr1 = cute::cast_smem_ptr_to_uint(&tdSsdS1(0));

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
    mla_sm90::wg_gemm<false>(mma_sdp, tSrK, tSrQ(_, _, _, mla_sm90::uniform(stage)), tSrS, true);
    mla_sm90::wg_gemm<false>(mma_sdp, tdPrV, tdPrdO(_, _, _, mla_sm90::uniform(stage)), tdPrdP, true);
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
          const bool in_k = key < sq.seqlen_k;
          if (!(in_k && qc >= qmin)) S_rc(r, c) = -INFINITY;
          if (!(in_k && qc + 1 >= qmin)) S_rc(r, c + 1) = -INFINITY;
        }
        S_rc(r, c) = mla_sm90::fast_exp2(fmaf(S_rc(r, c), p.scale_log2, -l2.x));
        S_rc(r, c + 1) = mla_sm90::fast_exp2(fmaf(S_rc(r, c + 1), p.scale_log2, -l2.y));
      }
    }
    Tensor tPrP = make_tensor<Element>(mla_sm90::acc_to_A_regs(tSrS.layout()));
    mla_sm90::convert_frag(tSrS, tPrP);
    mla_sm90::wg_gemm<true>(mma_dv, tPrP, tdVrdOt(_, _, _, mla_sm90::uniform(stage)), tdVrdV, false);
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
    mla_sm90::wg_gemm<true>(mma_dk, tdSr, tdKrQt(_, _, _, mla_sm90::uniform(stage)), tdKrdK, false);
    warpgroup_wait<1>();  // dV, dQ done; dK runs during the dQ store
    warpgroup_fence_operand(tdQrdQ);
    store_dq_block<D>(tdQrdQ, tdQcdQ, ss.dq.data(), tidx / 128, p.dq_wg_barriers);
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
}

// ------------------------------------------------------------------------------------------------
// The consumer warpgroups' body: this CTA's dK / dV accumulated by the schedule's main loop (Tr::Swap:
// unswapped for d = 192, swapped for d <= 128; fmha_bwd_sm90_config.h says why), then stored
// (store_dkv). The accumulators are dK^T / dV^T (dims x keys) unswapped and dK / dV (keys x dims) swapped.
template <class Tr>
__device__ __forceinline__ void consume(const MainArgs<Tr>& args, typename Tr::SharedStorage& ss, const CtaWork& w) {
  Tensor tdVrdV = partition_fragment_C(typename Tr::TiledMmadV{}, typename Tr::ShapedV{});
  Tensor tdKrdK = partition_fragment_C(typename Tr::TiledMmadK{}, typename Tr::ShapedK{});
  if constexpr (Tr::Swap) {
    mainloop_swapped<Tr>(args, ss, w, tdKrdK, tdVrdV);
  } else {
    mainloop_unswapped<Tr>(args, ss, w, tdKrdK, tdVrdV);
  }
  store_dkv<Tr>(args, ss, w, tdKrdK, tdVrdV);
}

}  // namespace fmha_bwd_sm90
