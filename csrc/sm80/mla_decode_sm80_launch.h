// Programmatic dependent launch (PDL) for the three kernels of one decode call: metadata -> main -> merge.
//
// Each kernel after the first is launched with cudaLaunchAttributeProgrammaticStreamSerialization on
// sm_90+ (p.pdl), so its CTAs become resident while its predecessor still runs and the launch gap between
// the kernels (~4-5 us each on the H200, measured under CUDA-graph replay) disappears. The rules that
// keep this correct:
//   - a dependent kernel calls grid_dependency_wait() before it reads anything its predecessor wrote
//     (the schedule, the split workspace) and before it writes any global memory, in every CTA (also the
//     ones that exit early), so its completion implies the predecessor's completion for whatever comes
//     next in the stream;
//   - a kernel calls allow_dependent_launch() once per CTA; the dependents only launch when every CTA of
//     this grid has called it or exited, so they can never take the resources an unstarted CTA needs.
// On sm_80 (compiled for it too) both are no-ops and the host launches normally.
#pragma once
#include <cuda_runtime.h>

#include "sm80/mla_decode_sm80_config.h"
#include "sm80/mla_decode_sm80_params.h"

namespace mla_decode_sm80 {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launch kernel(p) on `stream`, as a programmatic dependent of the previous kernel when p.pdl.
// Errors are left for the caller's cudaGetLastError().
template <typename Kernel>
inline void launch_dependent(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream,
                             const DecodeParams& p) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  (void)cudaLaunchKernelEx(&cfg, kernel, p);
}

// Launch a main kernel over the (m-block, item) grid with `smem` bytes of dynamic shared memory (every variant
// asks for more than the 48 KB default, so the attribute is set before each launch).
template <typename Kernel>
inline void launch_main_kernel(Kernel kernel, int smem, cudaStream_t stream, const DecodeParams& p) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return;
  launch_dependent(kernel, dim3(p.num_mblocks, p.num_items), kThreads, smem, stream, p);
}

}  // namespace mla_decode_sm80
