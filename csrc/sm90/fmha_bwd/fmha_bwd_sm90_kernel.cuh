// SM90 fused attention backward (family fmha_bwd_sm90): the main kernel and the host launcher template;
// the other pieces are in the role headers below. Included by fmha_bwd_sm90_hdim*.cu only.
//
// Main kernel (one CTA = one K/V block of one kv head of one sequence, 384 threads):
//   WG0: producer; one thread loads K/V once (TMA) and streams Q/dO tiles (and, swapped, the M-block's
//        lse/dpsum) through a kStages mbarrier pipeline for every (query head of the GQA group,
//        M-block) the block must visit.
//   WG1/WG2: consumers (setmaxnreg 240), two schedules (fmha_bwd_sm90_config.h):
//        unswapped (d = 192): every wgmma reads both operands from smem and the two WGs split the N
//          dimension of each GEMM; P^T and dS^T go through smem.
//        swapped (kSwapSdP, d <= 128): S^T/dP^T with the WGs splitting the keys; dV and dK are RS
//          wgmma on the P^T/dS^T registers; only dS^T goes through smem (for dQ).
// dQ: the consumers write each M-block's fp32 dQ to smem; warp 1 of the producer WG adds the block to
// dq_accum in global memory with one bulk reduce (cp.reduce.async.bulk .add.f32), off the consumers'
// critical path (per-thread float4 atomics there cost about a quarter of the kernel's time). The
// block keeps one layout in smem and gmem (see dq_store_pos); the postprocess undoes it.
// Deterministic mode orders the reduces of one M-block by a semaphore (K/V block order), so the
// float sums happen in a fixed order.
// dK/dV: summed over the GQA group in registers (the CTA loops over the group's query heads), so
// no fp32 dK/dV workspace and no cross-CTA reduction; written once at the end, staged in the K/V tiles'
// smem and stored by TMA (store_dkv_tma) where the block lies inside its sequence.
//
// Files, by role (FlashAttention's hopper/ split):
//   fmha_bwd_sm90_common.cuh       sequence geometry, the dQ accumulator layout, element types
//   fmha_bwd_sm90_preprocess.cuh   preprocess kernel (dpsum, lse_log2, clearing the dQ accumulator)
//   fmha_bwd_sm90_traits.cuh       main-kernel traits and arguments, named barriers, PTX helpers
//   fmha_bwd_sm90_scheduler.cuh    what one CTA does (CtaWork) and the launch groups (pair_group)
//   fmha_bwd_sm90_epilogue.cuh     the dK/dV epilogue of both schedules (TMA store, predicated rows)
//   fmha_bwd_sm90_mainloop.cuh     the consumer warpgroups: one body (consume), the two schedules' main
//                                  loops, the dQ hand-off
//   fmha_bwd_sm90_postprocess.cuh  postprocess kernel (dQ convert)
//   fmha_bwd_sm90_kernel.cuh       (this file) the main kernel (producer, reducer, dispatch) and the launcher
//   fmha_bwd_sm90_zero_rows.cu     packed batches: the gradient rows no sequence covers set to 0 (launched by
//                                  the host layer before the launcher's kernels)
#pragma once

#include "common/cuda_check.h"
#include "fmha_bwd_sm90_common.cuh"
#include "fmha_bwd_sm90_preprocess.cuh"
#include "fmha_bwd_sm90_postprocess.cuh"
#include "fmha_bwd_sm90_traits.cuh"
#include "fmha_bwd_sm90_scheduler.cuh"
#include "fmha_bwd_sm90_epilogue.cuh"
#include "fmha_bwd_sm90_mainloop.cuh"
#include "sm90/sm90_seq_order.cuh"

namespace fmha_bwd_sm90 {

using namespace cute;

// ------------------------------------------------------------------------------------------------
// The load of one tile (or one part of an MLA-native tile) by TMA, counted on `bar`: see tma_tile_part.
template <class Tma, class GShape, class SmemLayout, class Element>
__device__ __forceinline__ void load_tile_part(const Tma& tma, const GShape& gshape, const SmemLayout& smem_layout,
                                               Element* base, uint64_t& bar, int offset, int block, int head,
                                               int bcoord) {
  auto [tg, ts] = tma_tile_part(tma, gshape, smem_layout, base, offset, block, head, bcoord);
  copy(tma.with(bar), tg, ts);
}

// ------------------------------------------------------------------------------------------------
// Main kernel: producer warpgroup, then one of the two consumer schedules.
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1) fmha_bwd_sm90_main(const __grid_constant__ MainArgs<Tr> args) {
  using Element = typename Tr::Element;
  constexpr int BM = Tr::BM, BN = Tr::BN, D = Tr::D, DV = Tr::DV, Stages = Tr::Stages;
  using SS = typename Tr::SharedStorage;
  extern __shared__ __align__(1024) char smem_raw[];
  SS& ss = *reinterpret_cast<SS*>(smem_raw);
  const FmhaBwdSm90Params& p = args.p;

  int n_block, hkv, b;
  // whole CTA, before any barrier; the rest of the CTA's geometry is computed after the warpgroup
  // split (make_cta_work), so that only the block coordinates live across it
  if (!cta_coords<BN>(p, n_block, hkv, b) || n_block * BN >= get_seq<BM>(p, b).seqlen_k) return;

  const int warp_group = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&ss.full_bar[s], 1);
      cutlass::arch::ClusterBarrier::init(&ss.empty_bar[s], 256);
    }
    cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_bar, 1);
    cutlass::arch::fence_barrier_init();
    ss.coords[0] = n_block;
    ss.coords[1] = hkv;
    ss.coords[2] = b;
  }
  __syncthreads();

  auto [sQ, sdO, sK, sV, sQt, sdOt, sKt] = smem_operands<Tr>(ss);
  (void)sQt; (void)sdOt; (void)sKt;

  if (warp_group == 0) {
    // ---------------------------------------------------------------- producer
    // 24 + 2 x 240 = 504 = 3 x 168, the launch allocation: setmaxnreg only moves registers inside the
    // CTA's own pool, so the producer cannot keep more while the consumers take 240 (32 here hung the
    // consumers' setmaxnreg.inc on the H200). Fits 24 without spill when only the block coordinates
    // live across the split and the loops below keep running (hq, m) values (docs/kernels/fmha_bwd_sm90.md).
    cutlass::arch::warpgroup_reg_dealloc<24>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 1) {
      const CtaWork w = make_cta_work<BM, BN>(p, n_block, hkv, b);
      // dQ reducer: one bulk reduce per (query head, M-block), in the consumers' order: query heads
      // hq = hkv * group + g (g = 0 .. group-1), each with M-blocks m = m_min .. m_end-1 (running
      // values instead of it / n_m, it % n_m; n_m > 0 when total_iters > 0)
      if (w.total_iters > 0) {
        // the smem block starts free; hand it back to both warpgroups (one barrier each with dq_wg_barriers)
        auto hand_back = [&]() {
          if (p.dq_wg_barriers) {
            cutlass::arch::NamedBarrier::arrive(kDqWgBarThreads, kBarDqEmpty);
            cutlass::arch::NamedBarrier::arrive(kDqWgBarThreads, kBarDqEmpty1);
          } else {
            cutlass::arch::NamedBarrier::arrive(kDqBarThreads, kBarDqEmpty);
          }
        };
        hand_back();
        // scratch_start is a multiple of BM: scratch row of M-block m = (sblk + m) * BM
        const int sblk = int(w.sq.scratch_start / BM);
        const int m_min = w.m_min, m_end = w.m_min + w.n_m, hq_end = (hkv + 1) * w.group;
        int hq = hkv * w.group, m = m_min;
#pragma unroll 1
        while (hq < hq_end) {
          const int64_t srow0 = int64_t(hq) * p.scratch_rows + int64_t(sblk + m) * BM;
          if (p.dq_wg_barriers) {  // both warpgroups' halves are in the block
            cutlass::arch::NamedBarrier::sync(kDqWgBarThreads, kBarDqFull);
            cutlass::arch::NamedBarrier::sync(kDqWgBarThreads, kBarDqFull1);
          } else {
            cutlass::arch::NamedBarrier::sync(kDqBarThreads, kBarDqFull);
          }
          if (lane == 0) {
            int* sem = p.deterministic ? p.dq_sem + int64_t(hq) * (p.scratch_rows / BM) + (sblk + m) : nullptr;
            if (sem != nullptr) {
              while (ld_acquire_gpu(sem) != n_block) { __nanosleep(64); }
            }
            bulk_reduce_add_f32(p.dq_accum + srow0 * D, ss.dq.data(), uint32_t(BM * D * sizeof(float)));
            if (sem != nullptr) {
              // the adds must have landed before the next K/V block's CTA may add to this M-block
              asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
              __threadfence();
              atomicAdd(sem, 1);
            } else {
              asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // smem block read
            }
          }
          __syncwarp();
          if (++m == m_end) { m = m_min; ++hq; }
          if (hq < hq_end) hand_back();  // not the last
        }
        if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
      }
    }
    if (threadIdx.x == 0) {
      const CtaWork w = make_cta_work<BM, BN>(p, n_block, hkv, b);
      if (w.total_iters > 0) {
        const int bcoord = p.cu_seqlens_q != nullptr ? 0 : b;
        // K, V of this block (once)
        if constexpr (Tr::kMla) {
          // K in its two parts (the rope key of kv head 0 when every head shares it), then V
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_bar, Tr::kBytesK + Tr::kBytesV);
          load_tile_part(args.tma_k, args.shape_k, typename Tr::SmemLayoutKNope{}, ss.k.data(), ss.kv_bar,
                         int(w.sq.offset_k), n_block, hkv, bcoord);
          load_tile_part(args.tma_k_pe, args.shape_k_pe, typename Tr::SmemLayoutKPe{}, ss.k.data() + BN * Tr::kDn,
                         ss.kv_bar, int(w.sq.offset_k), n_block, args.k_pe_shared ? 0 : hkv, bcoord);
          load_tile_part(args.tma_v, args.shape_v, typename Tr::SmemLayoutV{}, ss.v.data(), ss.kv_bar,
                         int(w.sq.offset_k), n_block, hkv, bcoord);
        } else {
        Tensor mK = domain_offset(make_coord(int(w.sq.offset_k), _0{}),
                                  args.tma_k.get_tma_tensor(args.shape_k)(_, _, hkv, bcoord));
        Tensor mV = domain_offset(make_coord(int(w.sq.offset_k), _0{}),
                                  args.tma_v.get_tma_tensor(args.shape_v)(_, _, hkv, bcoord));
        Tensor gK = local_tile(mK, Shape<Int<BN>, Int<D>>{}, make_coord(n_block, _0{}));
        Tensor gV = local_tile(mV, Shape<Int<BN>, Int<DV>>{}, make_coord(n_block, _0{}));
        auto [tKgK, tKsK] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto [tVgV, tVsV] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_bar, Tr::kBytesK + Tr::kBytesV);
        copy(args.tma_k.with(ss.kv_bar), tKgK, tKsK);
        copy(args.tma_v.with(ss.kv_bar), tVgV, tVsV);
        }

        Tensor mQall = args.tma_q.get_tma_tensor(args.shape_q);
        Tensor mdOall = args.tma_do.get_tma_tensor(args.shape_do);
        const int start_q = int(w.sq.offset_q);
        const int sblk = int(w.sq.scratch_start / BM);  // see the reducer
        const int m_min = w.m_min, m_end = w.m_min + w.n_m, hq_end = (hkv + 1) * w.group;
        int stage = 0;
        uint32_t phase = 0;
        // query heads hq = hkv * group + g, each with M-blocks m_min .. m_end-1 (the reducer's order)
        int hq = hkv * w.group, m = m_min;
#pragma unroll 1
        while (hq < hq_end) {
          if constexpr (Tr::kMla) {
            // Q in its two parts into stage `stage` of the ring (a stage is BM * D elements), then dO
            Element* sq = ss.q.data() + stage * (BM * D);
            cutlass::arch::ClusterBarrier::wait(&ss.empty_bar[stage], phase ^ 1);
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.full_bar[stage],
                                                                           Tr::kBytesQ + Tr::kBytesdO + Tr::kBytesRowStats);
            load_tile_part(args.tma_q, args.shape_q, take<0, 2>(typename Tr::SmemLayoutQNope{}), sq,
                           ss.full_bar[stage], start_q, m, hq, bcoord);
            load_tile_part(args.tma_q_pe, args.shape_q_pe, take<0, 2>(typename Tr::SmemLayoutQPe{}), sq + BM * Tr::kDn,
                           ss.full_bar[stage], start_q, m, hq, bcoord);
            load_tile_part(args.tma_do, args.shape_do, take<0, 2>(typename Tr::SmemLayoutdO{}),
                           ss.dout.data() + stage * (BM * DV), ss.full_bar[stage], start_q, m, hq, bcoord);
          } else {
          Tensor mQ = domain_offset(make_coord(start_q, _0{}), mQall(_, _, hq, bcoord));
          Tensor mdO = domain_offset(make_coord(start_q, _0{}), mdOall(_, _, hq, bcoord));
          Tensor gQ = local_tile(mQ, Shape<Int<BM>, Int<D>>{}, make_coord(m, _0{}));
          Tensor gdO = local_tile(mdO, Shape<Int<BM>, Int<DV>>{}, make_coord(m, _0{}));
          auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
          auto [tdOgdO, tdOsdO] = tma_partition(args.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
          cutlass::arch::ClusterBarrier::wait(&ss.empty_bar[stage], phase ^ 1);
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.full_bar[stage],
                                                                         Tr::kBytesQ + Tr::kBytesdO + Tr::kBytesRowStats);
          copy(args.tma_q.with(ss.full_bar[stage]), tQgQ, tQsQ(_, stage));
          copy(args.tma_do.with(ss.full_bar[stage]), tdOgdO, tdOsdO(_, stage));
          }
          if constexpr (Tr::Swap) {
            // scratch rows of an M-block are 64 contiguous floats at a multiple of 64: 16-byte aligned
            const int64_t srow0 = int64_t(hq) * p.scratch_rows + int64_t(sblk + m) * BM;
            SM90_BULK_COPY_G2S::copy(p.lse_log2 + srow0, &ss.full_bar[stage], ss.lse.data() + stage * BM, BM * 4);
            SM90_BULK_COPY_G2S::copy(p.dpsum + srow0, &ss.full_bar[stage], ss.dps.data() + stage * BM, BM * 4);
          }
          if (++stage == Stages) { stage = 0; phase ^= 1; }
          if (++m == m_end) { m = m_min; ++hq; }
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<240>();
  const CtaWork w = make_cta_work<BM, BN>(p, n_block, hkv, b);
  consume<Tr>(args, ss, w);
}

// ------------------------------------------------------------------------------------------------
// Host launchers: [sequence order ->] preprocess -> main -> postprocess on `stream`; return the first launch error
// (common/cuda_check.h). l2_bytes: the device's L2 size, which sizes the main kernel's launch groups.

// The (rows, dim, head, batch) gmem view TMA descriptors are made from. varlen: batch extent 1, given a nonzero
// stride that is a multiple of 16 bytes.
template <class Element>
auto gmem_view(const void* ptr, int rows, int dim, int heads, bool varlen, int batch, int64_t row_stride,
               int64_t head_stride, int64_t batch_stride) {
  int64_t bs = varlen ? row_stride * 8 : batch_stride;
  if (bs == 0) bs = 8;
  auto layout = make_layout(make_shape(int32_t(rows), int32_t(dim), int32_t(heads), int32_t(varlen ? 1 : batch)),
                            make_stride(row_stride, _1{}, head_stride, bs));
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), layout);
}

// dK/dV by TMA store (store_dkv_tma) where an output allows it: 16-byte aligned base and strides.
template <class Element>
bool tma_ok(const void* ptr, std::initializer_list<int64_t> strides) {
  bool ok = reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  for (int64_t st : strides) ok = ok && st % (16 / int64_t(sizeof(Element))) == 0;
  return ok;
}

// The three kernels, the main kernel with `args` (its TMA descriptors made by the caller).
// The launcher's fields of args.p (plan_launch) are set.
template <class T, class Tr>
cudaError_t launch_kernels(const MainArgs<Tr>& args, cudaStream_t stream) {
  constexpr int BM = Tr::BM, BN = Tr::BN, D = Tr::D, DV = Tr::DV;
  static_assert(BM == kFmhaBwdSm90BlockM, "scratch layout assumes one BM");
  const FmhaBwdSm90Params& p = args.p;
  const int grid_m = (p.seqlen_q + BM - 1) / BM;
  const dim3 grid_rows = p.q_slots > 0 ? dim3(p.q_slots, p.hq, 1) : dim3(grid_m, p.hq, p.batch);
  if (p.seq_order != nullptr) MLA_CUDA_TRY(mla_sm90::launch_seq_order(p, nullptr, stream));  // longest first
  if (grid_m > 0) {
    fmha_bwd_sm90_preprocess<T, D, DV, BM><<<grid_rows, 256, 0, stream>>>(p);
    MLA_CUDA_TRY(cudaGetLastError());
  }
  const int grid_n = (p.seqlen_k + BN - 1) / BN;
  if (grid_n > 0) {
    constexpr int smem = Tr::kSmemBytes;
    MLA_CUDA_TRY(mla::opt_in_dynamic_smem<fmha_bwd_sm90_main<Tr>>(smem));
    const dim3 grid = p.kv_slots > 0 ? dim3(p.kv_slots, p.hkv, 1) : dim3(grid_n, p.hkv, p.batch);
    fmha_bwd_sm90_main<Tr><<<grid, Tr::kThreads, smem, stream>>>(args);
    MLA_CUDA_TRY(cudaGetLastError());
  }
  if (grid_m > 0) {
    fmha_bwd_sm90_postprocess<T, D, BM><<<grid_rows, 256, 0, stream>>>(p);
    MLA_CUDA_TRY(cudaGetLastError());
  }
  return cudaSuccess;
}

template <class T, int D, int DV>
cudaError_t run(const FmhaBwdSm90Params& p, const FmhaBwdSm90Options& opt, int l2_bytes, cudaStream_t stream) {
  using Element = typename CuteType<T>::type;
  using Tr = Traits<Element, D, DV>;
  constexpr int BM = Tr::BM, BN = Tr::BN;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int rows_q = p.rows_q, rows_k = p.rows_k;
  auto gQ = gmem_view<Element>(p.q, rows_q, D, p.hq, varlen, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto gdO = gmem_view<Element>(p.dout, rows_q, DV, p.hq, varlen, p.batch, p.do_row_stride, p.do_head_stride,
                                p.do_batch_stride);
  auto gK = gmem_view<Element>(p.k, rows_k, D, p.hkv, varlen, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto gV = gmem_view<Element>(p.v, rows_k, DV, p.hkv, varlen, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride);

  MainArgs<Tr> args{};
  args.p = p;
  plan_launch<BM, BN>(args.p, opt, l2_bytes);
  args.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gQ, take<0, 2>(typename Tr::SmemLayoutQ{}), Shape<Int<BM>, Int<D>>{}, _1{});
  args.tma_do = make_tma_copy(SM90_TMA_LOAD{}, gdO, take<0, 2>(typename Tr::SmemLayoutdO{}), Shape<Int<BM>, Int<DV>>{}, _1{});
  args.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gK, typename Tr::SmemLayoutK{}, Shape<Int<BN>, Int<D>>{}, _1{});
  args.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gV, typename Tr::SmemLayoutV{}, Shape<Int<BN>, Int<DV>>{}, _1{});
  args.shape_q = gQ.shape();
  args.shape_do = gdO.shape();
  args.shape_k = gK.shape();
  args.shape_v = gV.shape();
  args.p.dkv_tma = tma_ok<Element>(p.dk, {p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride}) &&
                   tma_ok<Element>(p.dv, {p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride});
  if (args.p.dkv_tma) {
    // the same (rows, dim, head, batch) extents as K and V, so the kernel indexes them with shape_k/shape_v
    auto gdK = gmem_view<Element>(p.dk, rows_k, D, p.hkv, varlen, p.batch, p.dk_row_stride, p.dk_head_stride,
                                  p.dk_batch_stride);
    auto gdV = gmem_view<Element>(p.dv, rows_k, DV, p.hkv, varlen, p.batch, p.dv_row_stride, p.dv_head_stride,
                                  p.dv_batch_stride);
    args.tma_dk = make_tma_copy(SM90_TMA_STORE{}, gdK, typename Tr::SmemLayoutK{}, Shape<Int<BN>, Int<D>>{}, _1{});
    args.tma_dv = make_tma_copy(SM90_TMA_STORE{}, gdV, typename Tr::SmemLayoutV{}, Shape<Int<BN>, Int<DV>>{}, _1{});
  }
  return launch_kernels<T>(args, stream);
}

// The MLA-native 192/128 backward (TraitsMla): p describes q_nope, k_nope, dk_nope as q, k, dk (head_dim_qk 192),
// `rope` the rope parts (fmha_bwd_sm90_params.h).
template <class T>
cudaError_t run_mla(const FmhaBwdSm90Params& p, const FmhaBwdSm90RopeParts& rope, const FmhaBwdSm90Options& opt,
                    int l2_bytes, cudaStream_t stream) {
  using Element = typename CuteType<T>::type;
  using Tr = TraitsMla<Element>;
  constexpr int BM = Tr::BM, BN = Tr::BN, DV = Tr::DV, Dn = Tr::kDn, Dr = Tr::kDr;
  using DN = typename Tr::DN;
  using DR = typename Tr::DR;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int rows_q = p.rows_q, rows_k = p.rows_k, nb = p.batch;
  auto gQ = gmem_view<Element>(p.q, rows_q, Dn, p.hq, varlen, nb, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto gQpe = gmem_view<Element>(rope.q_pe, rows_q, Dr, p.hq, varlen, nb, rope.q_pe_row_stride, rope.q_pe_head_stride,
                                 rope.q_pe_batch_stride);
  auto gdO = gmem_view<Element>(p.dout, rows_q, DV, p.hq, varlen, nb, p.do_row_stride, p.do_head_stride,
                                p.do_batch_stride);
  auto gK = gmem_view<Element>(p.k, rows_k, Dn, p.hkv, varlen, nb, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto gKpe = gmem_view<Element>(rope.k_pe, rows_k, Dr, rope.k_pe_heads, varlen, nb, rope.k_pe_row_stride,
                                 rope.k_pe_head_stride, rope.k_pe_batch_stride);
  auto gV = gmem_view<Element>(p.v, rows_k, DV, p.hkv, varlen, nb, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  auto gdKpe = gmem_view<Element>(rope.dk_pe, rows_k, Dr, p.hkv, varlen, nb, rope.dk_pe_row_stride,
                                  rope.dk_pe_head_stride, rope.dk_pe_batch_stride);

  MainArgs<Tr> args{};
  args.p = p;
  plan_launch<BM, BN>(args.p, opt, l2_bytes);
  args.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gQ, take<0, 2>(typename Tr::SmemLayoutQNope{}), Shape<Int<BM>, DN>{}, _1{});
  args.tma_q_pe = make_tma_copy(SM90_TMA_LOAD{}, gQpe, take<0, 2>(typename Tr::SmemLayoutQPe{}), Shape<Int<BM>, DR>{}, _1{});
  args.tma_do = make_tma_copy(SM90_TMA_LOAD{}, gdO, take<0, 2>(typename Tr::SmemLayoutdO{}), Shape<Int<BM>, Int<DV>>{}, _1{});
  args.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gK, typename Tr::SmemLayoutKNope{}, Shape<Int<BN>, DN>{}, _1{});
  args.tma_k_pe = make_tma_copy(SM90_TMA_LOAD{}, gKpe, typename Tr::SmemLayoutKPe{}, Shape<Int<BN>, DR>{}, _1{});
  args.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gV, typename Tr::SmemLayoutV{}, Shape<Int<BN>, Int<DV>>{}, _1{});
  args.shape_q = gQ.shape();
  args.shape_q_pe = gQpe.shape();
  args.shape_do = gdO.shape();
  args.shape_k = gK.shape();
  args.shape_k_pe = gKpe.shape();
  args.shape_v = gV.shape();
  args.shape_dk_pe = gdKpe.shape();
  args.rope = rope;
  args.k_pe_shared = rope.k_pe_heads == 1 ? 1 : 0;
  args.p.dkv_tma = tma_ok<Element>(p.dk, {p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride}) &&
                   tma_ok<Element>(rope.dk_pe, {rope.dk_pe_row_stride, rope.dk_pe_head_stride, rope.dk_pe_batch_stride}) &&
                   tma_ok<Element>(p.dv, {p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride});
  if (args.p.dkv_tma) {
    auto gdK = gmem_view<Element>(p.dk, rows_k, Dn, p.hkv, varlen, nb, p.dk_row_stride, p.dk_head_stride,
                                  p.dk_batch_stride);
    auto gdV = gmem_view<Element>(p.dv, rows_k, DV, p.hkv, varlen, nb, p.dv_row_stride, p.dv_head_stride,
                                  p.dv_batch_stride);
    args.tma_dk = make_tma_copy(SM90_TMA_STORE{}, gdK, typename Tr::SmemLayoutKNope{}, Shape<Int<BN>, DN>{}, _1{});
    args.tma_dk_pe = make_tma_copy(SM90_TMA_STORE{}, gdKpe, typename Tr::SmemLayoutKPe{}, Shape<Int<BN>, DR>{}, _1{});
    args.tma_dv = make_tma_copy(SM90_TMA_STORE{}, gdV, typename Tr::SmemLayoutV{}, Shape<Int<BN>, Int<DV>>{}, _1{});
  }
  return launch_kernels<T>(args, stream);
}

}  // namespace fmha_bwd_sm90
