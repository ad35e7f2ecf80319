// dK/dV epilogue of the SM90 fused attention backward's main kernel (family fmha_bwd_sm90): the TMA store
// of K/V blocks inside their sequence (the register stores of the others are in the consumers,
// fmha_bwd_sm90_mainloop.cuh). fmha_bwd_sm90_kernel.cuh describes the whole.
#pragma once

#include "fmha_bwd_sm90_traits.cuh"

namespace fmha_bwd_sm90 {

using namespace cute;

// ------------------------------------------------------------------------------------------------
// dK/dV epilogue by TMA store, for a K/V block that lies entirely inside its sequence (a box crossing
// the sequence end would write into the next sequence of a varlen batch). Both consumer warpgroups
// stage their bf16/fp16 dK, dV fragments with stmatrix into the K and V tiles' own smem (no GEMM reads
// them any more once both warpgroups are past their last GEMM); one thread then issues two TMA stores.
// This replaces ~100 predicated 2- or 4-byte global stores per thread, which cost the H200 about 2% of
// the 192/128 causal backward (A/B).
// r2s_k / r2s_v: tiled stmatrix copies for this thread, dst_k / dst_v: the K / V smem in the
// accumulators' (row, col) orientation (transposed views for the unswapped dK^T / dV^T).
template <class Tr>
__device__ __forceinline__ bool dkv_tma_ok(const FmhaBwdSm90Params& p, int n_block, int len_k) {
  return p.dkv_tma && (n_block + 1) * Tr::BN <= len_k;
}

template <class Tr, class R2SK, class R2SV, class Frag16K, class Frag16V, class DstK, class DstV>
__device__ __forceinline__ void store_dkv_tma(const MainArgs<Tr>& args, typename Tr::SharedStorage& ss, int tidx,
                                              const R2SK& r2s_k, const Frag16K& dk16, const DstK& dst_k,
                                              const R2SV& r2s_v, const Frag16V& dv16, const DstV& dst_v) {
  constexpr int BN = Tr::BN, D = Tr::D, DV = Tr::DV, BM = Tr::BM;
  const FmhaBwdSm90Params& p = args.p;
  auto thr_k = r2s_k.get_thread_slice(tidx);
  auto thr_v = r2s_v.get_thread_slice(tidx);
  // both warpgroups are past their last GEMM (the dQ GEMM reads all of K, so the other warpgroup's rows)
  cutlass::arch::NamedBarrier::sync(256, kBarDsReady);
  copy(r2s_k, thr_k.retile_S(dk16), thr_k.partition_D(dst_k));
  copy(r2s_v, thr_v.retile_S(dv16), thr_v.partition_D(dst_v));
  cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> the TMA store's async proxy
  cutlass::arch::NamedBarrier::sync(256, kBarDsReady);
  if (tidx == 0) {
    // the block's coordinates again (a few integer ops): kept from before the loop they spilled
    int n_block, hkv, b;
    cta_coords(p, n_block, hkv, b);
    const Seq sq = get_seq<BM>(p, b);
    const int bcoord = p.cu_seqlens_q != nullptr ? 0 : b;
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
    Tensor mdK = domain_offset(make_coord(int(sq.start_k), _0{}),
                               args.tma_dk.get_tma_tensor(args.shape_k)(_, _, hkv, bcoord));
    Tensor mdV = domain_offset(make_coord(int(sq.start_k), _0{}),
                               args.tma_dv.get_tma_tensor(args.shape_v)(_, _, hkv, bcoord));
    Tensor gdK = local_tile(mdK, Shape<Int<BN>, Int<D>>{}, make_coord(n_block, _0{}));
    Tensor gdV = local_tile(mdV, Shape<Int<BN>, Int<DV>>{}, make_coord(n_block, _0{}));
    auto [tdKgdK, tdKsdK] = tma_partition(args.tma_dk, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gdK));
    auto [tdVgdV, tdVsdV] = tma_partition(args.tma_dv, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gdV));
    copy(args.tma_dk, tdKsdK, tdKgdK);
    copy(args.tma_dv, tdVsdV, tdVgdV);
    tma_store_arrive();
    tma_store_wait<0>();  // the smem tiles are read before the CTA (and its smem) goes
  }
}

}  // namespace fmha_bwd_sm90
