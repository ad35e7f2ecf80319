// CUTLASS 4.2 example-77 Blackwell FMHA headers (included from the installed nvidia-cutlass wheel,
// never copied) plus the arch guard and the launch helpers both SM100 families share.
#pragma once

#include <mutex>

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

#include "sm100/sm100_fmha_launch.h"

namespace mla_sm100 {

// cudaFuncAttributeMaxDynamicSharedMemorySize is a per-device attribute: CUTLASS's FMHA sets it
// once per process (static flag). We set it once per (kernel, device).
template <class Kernel>
inline cudaError_t ensure_smem_attribute(int smem_bytes) {
  static std::mutex mu;
  static bool done[64] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> g(mu);
  if (done[dev]) return cudaSuccess;
  if (smem_bytes >= (48 << 10)) {
    e = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem_bytes);
    if (e != cudaSuccess) return e;
  }
  done[dev] = true;
  return cudaSuccess;
}

// Launch a CUTLASS 3.x style kernel (device_kernel<Kernel>(Params)) on `stream`.
template <class Kernel>
inline LaunchStatus launch_kernel(typename Kernel::Params const& params, cudaStream_t stream) {
  int smem = Kernel::SharedStorageSize;
  cudaError_t e = ensure_smem_attribute<Kernel>(smem);
  if (e != cudaSuccess) return LaunchStatus::fail("cudaFuncSetAttribute(max dynamic smem) failed", e);
  dim3 grid = Kernel::get_grid_shape(params);
  dim3 block = Kernel::get_block_shape();
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return LaunchStatus::ok();
  if (grid.y > 65535u || grid.z > 65535u) return LaunchStatus::fail("grid.y/grid.z above 65535");
  dim3 cluster(cute::size<0>(typename Kernel::ClusterShape{}), cute::size<1>(typename Kernel::ClusterShape{}),
               cute::size<2>(typename Kernel::ClusterShape{}));
  void const* kernel = (void const*)cutlass::device_kernel<Kernel>;
  void* kernel_params[] = {const_cast<typename Kernel::Params*>(&params)};
  cutlass::Status st = cutlass::ClusterLauncher::launch(grid, cluster, block, smem, stream, kernel, kernel_params);
  e = cudaGetLastError();
  if (st != cutlass::Status::kSuccess || e != cudaSuccess) return LaunchStatus::fail("kernel launch failed", e);
  return LaunchStatus::ok();
}

}  // namespace mla_sm100
