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

#include "common/cuda_check.h"
#include "sm80/mla_decode/mla_decode_sm80_config.h"
#include "sm80/mla_decode/mla_decode_sm80_params.h"

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

// Launch kernel(args) on `stream`, as a programmatic dependent of the previous kernel when pdl; returns the
// launch's error (common/cuda_check.h).
template <typename Kernel, typename Args>
inline cudaError_t launch_dependent(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream, bool pdl,
                                    const Args& args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args);
}

// kernel(p), a programmatic dependent when p.pdl.
template <typename Kernel>
inline cudaError_t launch_dependent(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream,
                                    const DecodeParams& p) {
  return launch_dependent(kernel, grid, threads, smem, stream, p.pdl != 0, p);
}

// Launch main kernel kKernel over the (m-block, item) grid with `smem` bytes of dynamic shared memory (every
// variant asks for more than the 48 KB default: the kernel is opted in to it once per device and size).
template <auto kKernel>
inline cudaError_t launch_main_kernel(int smem, cudaStream_t stream, const DecodeParams& p) {
  MLA_CUDA_TRY(mla::opt_in_dynamic_smem<kKernel>(smem));
  return launch_dependent(kKernel, dim3(p.num_mblocks, p.num_items), kThreads, smem, stream, p);
}

}  // namespace mla_decode_sm80
