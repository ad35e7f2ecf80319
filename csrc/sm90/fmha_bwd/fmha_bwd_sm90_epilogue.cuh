// dK/dV epilogue of the SM90 fused attention backward's main kernel (family fmha_bwd_sm90), for both
// schedules: the TMA store of K/V blocks inside their sequence, predicated register stores for the blocks
// that cross its end. fmha_bwd_sm90_kernel.cuh describes the whole.
#pragma once

#include "fmha_bwd_sm90_scheduler.cuh"
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

// The TMA store of one tile (or one part of an MLA-native dK tile) from smem: see tma_tile_part.
template <class Tma, class GShape, class SmemLayout, class Element>
__device__ __forceinline__ void store_tile_part(const Tma& tma, const GShape& gshape, const SmemLayout& smem_layout,
                                                Element* base, int offset, int block, int head, int bcoord) {
  auto [tg, ts] = tma_tile_part(tma, gshape, smem_layout, base, offset, block, head, bcoord);
  copy(tma, ts, tg);
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
    // the block's coordinates from shared memory (kept in registers across the loop they spilled)
    const int n_block = ss.coords[0], hkv = ss.coords[1], b = ss.coords[2];
    const Seq sq = get_seq<BM>(p, b);
    const int bcoord = p.cu_seqlens_q != nullptr ? 0 : b;
    if constexpr (Tr::kMla) {
      // dK as its two parts, dk_nope (the K tile's first kDn columns) and dk_pe (the rest), then dV
      store_tile_part(args.tma_dk, args.shape_k, typename Tr::SmemLayoutKNope{}, ss.k.data(), int(sq.offset_k),
                      n_block, hkv, bcoord);
      store_tile_part(args.tma_dk_pe, args.shape_dk_pe, typename Tr::SmemLayoutKPe{}, ss.k.data() + BN * Tr::kDn,
                      int(sq.offset_k), n_block, hkv, bcoord);
      store_tile_part(args.tma_dv, args.shape_v, typename Tr::SmemLayoutV{}, ss.v.data(), int(sq.offset_k), n_block,
                      hkv, bcoord);
      tma_store_arrive();
      tma_store_wait<0>();  // the smem tiles are read before the CTA (and its smem) goes
      return;
    }
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutV{});
    Tensor mdK = domain_offset(make_coord(int(sq.offset_k), _0{}),
                               args.tma_dk.get_tma_tensor(args.shape_k)(_, _, hkv, bcoord));
    Tensor mdV = domain_offset(make_coord(int(sq.offset_k), _0{}),
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

// The elements of a dK or dV accumulator whose key lies inside the sequence (key0 + key < len_k), times
// `scale`, to the rows of `base` (the sequence's first key row of this kv head). kKeysMajor: the rows of the
// accumulator are keys (the swapped dK / dV), a thread's adjacent elements are adjacent dims and each pair
// is one 4-byte store; else its rows are dims (dK^T / dV^T) and each element is one 2-byte store.
// kSplit > 0 (an MLA-native dK): the dims from kSplit on go to `base_hi` instead (row stride `row_stride_hi`,
// column dim - kSplit).
template <bool kKeysMajor, int kSplit, class Element, class Acc, class ThrMma, class AccShape>
__device__ __forceinline__ void store_dkv_rows(const Acc& acc, const ThrMma& thr, AccShape shape, Element* base,
                                               int64_t row_stride, Element* base_hi, int64_t row_stride_hi, int key0,
                                               int len_k, float scale) {
  // an element's address: below kSplit in base's rows, from kSplit on in base_hi's
  auto at = [&](int key, int dim) -> Element* {
    if (kSplit > 0 && dim >= kSplit) return base_hi + int64_t(key) * row_stride_hi + (dim - kSplit);
    return base + int64_t(key) * row_stride + dim;
  };
  Tensor cc = thr.partition_C(make_identity_tensor(shape));
  if constexpr (kKeysMajor) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int key = key0 + get<0>(cc(i)), dim = get<1>(cc(i));
      if (key < len_k) {
        cutlass::Array<Element, 2> pair;
        pair[0] = Element(acc(i) * scale);
        pair[1] = Element(acc(i + 1) * scale);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(at(key, dim)) = pair;
      }
    }
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      const int dim = get<0>(cc(i)), key = key0 + get<1>(cc(i));
      if (key < len_k) *at(key, dim) = Element(acc(i) * scale);
    }
  }
}

// store_dkv_rows with every dim to `base`.
template <bool kKeysMajor, class Element, class Acc, class ThrMma, class AccShape>
__device__ __forceinline__ void store_dkv_rows(const Acc& acc, const ThrMma& thr, AccShape shape, Element* base,
                                               int64_t row_stride, int key0, int len_k, float scale) {
  store_dkv_rows<kKeysMajor, 0>(acc, thr, shape, base, row_stride, base, row_stride, key0, len_k, scale);
}

// The consumers' epilogue: this CTA's dK (times softmax_scale) and dV, accumulated in fp32 as
// Tr::ShapedK / Tr::ShapedV by Tr::TiledMmadK / Tr::TiledMmadV (dims x keys unswapped, keys x dims
// swapped), to p.dk / p.dv as Element. A K/V block inside its sequence leaves by TMA store (store_dkv_tma,
// staged through the K/V tiles' smem); a block that crosses the sequence end stores from registers,
// predicated on the key.
template <class Tr, class AccK, class AccV>
__device__ __forceinline__ void store_dkv(const MainArgs<Tr>& args, typename Tr::SharedStorage& ss, const CtaWork& w,
                                          AccK& tdKrdK, AccV& tdVrdV) {
  using Element = typename Tr::Element;
  const FmhaBwdSm90Params& p = args.p;
  const int tidx = threadIdx.x - 128;  // 0..255
  if (dkv_tma_ok<Tr>(p, w.n_block, w.sq.seqlen_k)) {
    Tensor tdVr16 = make_tensor_like<Element>(tdVrdV);
    Tensor tdKr16 = make_tensor_like<Element>(tdKrdK);
    if constexpr (Tr::Swap) {
      mla_sm90::convert_frag(tdVrdV, tdVr16);
      CUTE_UNROLL
      for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.softmax_scale;
      mla_sm90::convert_frag(tdKrdK, tdKr16);
    } else {
      CUTE_UNROLL
      for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.softmax_scale;
      mla_sm90::convert_frag(tdKrdK, tdKr16);
      mla_sm90::convert_frag(tdVrdV, tdVr16);
    }
    Element* k_base = ss.k.data();
    Element* v_base = ss.v.data();
    int tidx_s = tidx;
    if constexpr (!Tr::Swap) {
      // The staging addresses are derived from bases hidden behind an empty asm, and from an opaque thread
      // index: hoisted above the main loop (they are loop-invariant) they stayed live through it and spilled.
      asm volatile("" : "+l"(k_base), "+l"(v_base));
      asm volatile("" : "+r"(tidx_s));
    }
    Tensor sdK = make_tensor(make_smem_ptr(k_base), typename Tr::SmemLayoutdKStage{});
    Tensor sdV = make_tensor(make_smem_ptr(v_base), typename Tr::SmemLayoutdVStage{});
    store_dkv_tma<Tr>(args, ss, tidx_s, make_tiled_copy_C(Copy_Atom<typename Tr::StsmdKV, Element>{}, typename Tr::TiledMmadK{}),
                      tdKr16, sdK, make_tiled_copy_C(Copy_Atom<typename Tr::StsmdKV, Element>{}, typename Tr::TiledMmadV{}),
                      tdVr16, sdV);
    return;
  }
  const int key0 = w.n_block * Tr::BN;
  Element* dv = static_cast<Element*>(p.dv) + w.b * p.dv_batch_stride + w.sq.offset_k * p.dv_row_stride +
                w.hkv * p.dv_head_stride;
  Element* dk = static_cast<Element*>(p.dk) + w.b * p.dk_batch_stride + w.sq.offset_k * p.dk_row_stride +
                w.hkv * p.dk_head_stride;
  int tidx_e = tidx;
  // unswapped: coordinates from an opaque thread index, so that nothing for them stays live through the loop
  if constexpr (!Tr::Swap) asm volatile("" : "+r"(tidx_e));
  store_dkv_rows<Tr::Swap>(tdVrdV, typename Tr::TiledMmadV{}.get_thread_slice(tidx_e), typename Tr::ShapedV{}, dv,
                           p.dv_row_stride, key0, w.sq.seqlen_k, 1.f);
  if constexpr (Tr::kMla) {
    // dims kDn.. of dK are dk_pe's
    const FmhaBwdSm90RopeParts& r = args.rope;
    Element* dk_pe = static_cast<Element*>(r.dk_pe) + w.b * r.dk_pe_batch_stride + w.sq.offset_k * r.dk_pe_row_stride +
                     w.hkv * r.dk_pe_head_stride;
    store_dkv_rows<Tr::Swap, Tr::kDn>(tdKrdK, typename Tr::TiledMmadK{}.get_thread_slice(tidx_e),
                                      typename Tr::ShapedK{}, dk, p.dk_row_stride, dk_pe, r.dk_pe_row_stride, key0,
                                      w.sq.seqlen_k, p.softmax_scale);
  } else {
    store_dkv_rows<Tr::Swap>(tdKrdK, typename Tr::TiledMmadK{}.get_thread_slice(tidx_e), typename Tr::ShapedK{}, dk,
                             p.dk_row_stride, key0, w.sq.seqlen_k, p.softmax_scale);
  }
}

}  // namespace fmha_bwd_sm90
