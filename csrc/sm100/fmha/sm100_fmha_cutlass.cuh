// CUTLASS 4.2 example-77 Blackwell FMHA headers (included from the installed nvidia-cutlass wheel,
// never copied) plus the arch guard and the launch helpers both SM100 families share.
#pragma once

#include "cutlass/cutlass.h"
#include "cutlass/arch/config.h"

// Without sm_100a/sm_100f the example-77 kernel bodies compile to a printf stub that "succeeds"
// silently. Fail the build instead.
#if defined(__CUDA_ARCH__) && !defined(CUTLASS_ARCH_MMA_SM100A_ENABLED) && !defined(CUTLASS_ARCH_MMA_SM100F_ENABLED)
#error "mla_autograd: csrc/sm100 kernels must be compiled for sm_100f or sm_100a (-gencode=arch=compute_100f,code=sm_100f); any other target would build the CUTLASS printf stub"
#endif

#include "cute/tensor.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/cluster_launch.hpp"
#include "cutlass/device_kernel.h"

#include "common/cuda_check.h"
#include "sm100/fmha/sm100_fmha_launch.h"

namespace mla_sm100 {

// Launch a CUTLASS 3.x style kernel (device_kernel<Kernel>(Params)) on `stream`; returns the launch's
// error (common/cuda_check.h). The dynamic shared memory attribute is set once per (kernel, device).
template <class Kernel>
inline cudaError_t launch_kernel(typename Kernel::Params const& params, cudaStream_t stream) {
  int smem = Kernel::SharedStorageSize;
  MLA_CUDA_TRY(mla::opt_in_dynamic_smem<cutlass::device_kernel<Kernel>>(smem));
  dim3 grid = Kernel::get_grid_shape(params);
  dim3 block = Kernel::get_block_shape();
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;
  if (grid.y > 65535u || grid.z > 65535u) return cudaErrorInvalidConfiguration;
  dim3 cluster(cute::size<0>(typename Kernel::ClusterShape{}), cute::size<1>(typename Kernel::ClusterShape{}),
               cute::size<2>(typename Kernel::ClusterShape{}));
  void const* kernel = (void const*)cutlass::device_kernel<Kernel>;
  void* kernel_params[] = {const_cast<typename Kernel::Params*>(&params)};
  cutlass::Status st = cutlass::ClusterLauncher::launch(grid, cluster, block, smem, stream, kernel, kernel_params);
  // A CUDA call that failed inside ClusterLauncher (its cudaFuncSetAttribute, the launch) left its error in the
  // last-error slot; a kInvalid without one is its own check that the grid is a multiple of the cluster shape.
  MLA_CUDA_TRY(cudaGetLastError());
  return st == cutlass::Status::kSuccess ? cudaSuccess : cudaErrorInvalidConfiguration;
}

}  // namespace mla_sm100
