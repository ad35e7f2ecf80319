// Forward kernel types built from CUTLASS 4.2 example 77 (Blackwell FMHA), and the launcher for one
// (dtype, head dims) translation unit. The three masks of a TU are instantiated here. Only the
// variable-length problem shape is instantiated: dense calls go through it with cu = arange * S
// (the host api rewrites strides), which halves the number of SM100 instantiations to compile.
#pragma once

#include "sm100/fmha/sm100_fmha_cutlass.cuh"

#include "collective/fmha_fusion.hpp"
#include "collective/sm100_fmha_fwd_mainloop_tma_warpspecialized.hpp"
#include "collective/sm100_fmha_mla_fwd_mainloop_tma_warpspecialized.hpp"
#include "collective/sm100_fmha_fwd_epilogue_tma_warpspecialized.hpp"
#include "kernel/fmha_causal_tile_scheduler.hpp"
#include "kernel/fmha_tile_scheduler.hpp"
#include "kernel/sm100_fmha_fwd_kernel_tma_warpspecialized.hpp"

namespace mla_sm100 {

using namespace cute;
namespace fc = cutlass::fmha::collective;
namespace fk = cutlass::fmha::kernel;

// kCausalSched: example 77's CausalIndividualTileScheduler (grid (heads, q tiles, batches), the q tiles with
// the longest causal key loops launched first, query heads swizzled in groups of 8 for L2 reuse), which
// FlashMLA and example 77 use for causal masks when the query heads are a multiple of 8; otherwise the
// non-persistent IndividualTileScheduler (grid (q tiles, heads, batches)). Neither is persistent (FlashMLA's
// choice for causal and varlen calls; the persistent MLA load/epilogue ordering is not used).
template <class Element, bool kMla, class MaskT, bool kCausalSched = false>
struct FwdKernelOf {
  using ElementOut = Element;
  using SeqLen = fc::VariableLength;
  // D mode: MLA (latent 128, rope 64) = 192 for Q.K, first 128 for V/O; else 128.
  using DShape = std::conditional_t<kMla, cute::tuple<int, int>, int>;
  using ProblemShape = cute::tuple<SeqLen, SeqLen, DShape, cute::tuple<cute::tuple<int, int>, int>>;
  using StrideQ = cute::tuple<int, _1, cute::tuple<cute::tuple<int, int>, int>>;   // (row, 1, ((h_r, h_k), b))
  using StrideK = cute::tuple<int, _1, cute::tuple<cute::tuple<_0, int>, int>>;    // h_r stride 0: GQA
  using StrideV = StrideK;
  using StrideO = StrideQ;
  using StrideLSE = cute::tuple<_1, cute::tuple<cute::tuple<int, int>, int>>;       // (row 1, ((h_r, h_k), b))
  using TileShape = std::conditional_t<kMla, Shape<_256, _128, Shape<_128, _64>>, Shape<_256, _128, _128>>;
  using Scheduler = std::conditional_t<kCausalSched, fk::CausalIndividualTileScheduler, fk::IndividualTileScheduler>;
  using Mainloop = std::conditional_t<kMla,
      fc::Sm100MlaFwdMainloopTmaWarpspecialized<Element, float, float, TileShape, StrideQ, StrideK, StrideV,
                                                MaskT, Shape<_2, _1, _1>, cute::false_type>,
      fc::Sm100FmhaFwdMainloopTmaWarpspecialized<Element, float, float, TileShape, StrideQ, StrideK, StrideV,
                                                 MaskT>>;
  using Epilogue = fc::Sm100FmhaFwdEpilogueTmaWarpspecialized<ElementOut, float, typename Mainloop::TileShapePV,
                                                               StrideO, StrideLSE, cute::false_type>;
  using Schedule = std::conditional_t<kMla, fk::Sm100MlaFwdCtxKernelWarpspecializedSchedule,
                                      fk::Sm100FmhaCtxKernelWarpspecializedSchedule>;
  using Kernel = fk::Sm100FmhaFwdKernelTmaWarpspecialized<ProblemShape, Mainloop, Epilogue, Scheduler, Schedule>;
};

template <class Element, bool kMla, class MaskT, bool kCausalSched>
cudaError_t run_fwd(FwdLaunch const& p, cudaStream_t stream) {
  using KO = FwdKernelOf<Element, kMla, MaskT, kCausalSched>;
  using Kernel = typename KO::Kernel;
  typename KO::ProblemShape shape;
  if (p.cu_q == nullptr || p.cu_k == nullptr) return cudaErrorInvalidValue;  // launched without cu_seqlens
  if (kCausalSched && (p.h_r * p.h_k) % fk::CausalIndividualTileScheduler::TileH != 0) {
    return cudaErrorInvalidValue;  // the causal tile scheduler needs query heads in multiples of 8
  }
  get<0>(shape) = fc::VariableLength{p.max_seqlen_q, const_cast<int*>(p.cu_q), p.total_q};
  get<1>(shape) = fc::VariableLength{p.max_seqlen_k, const_cast<int*>(p.cu_k), p.total_k};
  if constexpr (kMla) {
    get<2>(shape) = cute::make_tuple(128, 64);
  } else {
    get<2>(shape) = 128;
  }
  get<3>(shape) = cute::make_tuple(cute::make_tuple(p.h_r, p.h_k), p.batch);

  typename KO::StrideQ sq = make_stride(p.q_row_stride, _1{},
                                        make_stride(make_stride(p.q_head_stride, p.q_head_stride * p.h_r), p.q_batch_stride));
  typename KO::StrideK sk =
      make_stride(p.k_row_stride, _1{}, make_stride(make_stride(_0{}, p.k_head_stride), p.k_batch_stride));
  typename KO::StrideV sv =
      make_stride(p.v_row_stride, _1{}, make_stride(make_stride(_0{}, p.v_head_stride), p.v_batch_stride));
  typename KO::StrideO so = make_stride(p.o_row_stride, _1{},
                                        make_stride(make_stride(p.o_head_stride, p.o_head_stride * p.h_r), p.o_batch_stride));
  typename KO::StrideLSE sl =
      make_stride(_1{}, make_stride(make_stride(p.lse_head_stride, p.lse_head_stride * p.h_r), p.lse_batch_stride));

  cutlass::KernelHardwareInfo hw;
  MLA_CUDA_TRY(cudaGetDevice(&hw.device_id));
  hw.sm_count = p.sm_count;

  using E = Element;
  typename Kernel::Arguments args{
      shape,
      {{static_cast<E const*>(p.q), sq, static_cast<E const*>(p.k), sk, static_cast<E const*>(p.v), sv},
       p.softmax_scale, 1.0f, 1.0f, 1.0f, 1.0f},
      {static_cast<E*>(p.o), so, p.lse, sl},
      hw};
  if (!Kernel::can_implement(args)) return cudaErrorNotSupported;
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
  return launch_kernel<Kernel>(params, stream);
}

template <class Element, bool kMla>
cudaError_t run_fwd_masks(FwdLaunch const& p, cudaStream_t stream) {
  switch (p.mask) {
    case Mask::kNone:
      if (p.causal_scheduler) return cudaErrorInvalidValue;  // the causal tile scheduler needs a causal mask
      return run_fwd<Element, kMla, fc::ResidualMask, false>(p, stream);
    case Mask::kCausalTopLeft:
      return p.causal_scheduler ? run_fwd<Element, kMla, fc::CausalMask<true>, true>(p, stream)
                                : run_fwd<Element, kMla, fc::CausalMask<true>, false>(p, stream);
    case Mask::kCausalBottomRight:
      return p.causal_scheduler ? run_fwd<Element, kMla, fc::CausalMask<false>, true>(p, stream)
                                : run_fwd<Element, kMla, fc::CausalMask<false>, false>(p, stream);
  }
  return cudaErrorInvalidValue;  // unknown mask
}

template <class Element, bool kMla>
int fwd_smem_masks(Mask m) {
  switch (m) {
    case Mask::kNone: return FwdKernelOf<Element, kMla, fc::ResidualMask>::Kernel::SharedStorageSize;
    case Mask::kCausalTopLeft: return FwdKernelOf<Element, kMla, fc::CausalMask<true>>::Kernel::SharedStorageSize;
    case Mask::kCausalBottomRight: return FwdKernelOf<Element, kMla, fc::CausalMask<false>>::Kernel::SharedStorageSize;
  }
  return 0;
}

}  // namespace mla_sm100

// One translation unit = one (dtype, head dims) with its three masks.
#define MLA_SM100_FWD_TU(NAME, ELEMENT, IS_MLA)                                                   \
  namespace mla_sm100 {                                                                          \
  cudaError_t NAME(FwdLaunch const& p, cudaStream_t stream) {                                    \
    return run_fwd_masks<ELEMENT, IS_MLA>(p, stream);                                            \
  }                                                                                              \
  int NAME##_smem(Mask m) { return fwd_smem_masks<ELEMENT, IS_MLA>(m); }                         \
  }
