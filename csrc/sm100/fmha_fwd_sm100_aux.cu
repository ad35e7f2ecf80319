// Small helper kernel of the SM100 forward: rewrites cu_seqlens (see sm100_fmha_launch.h).
#include <cuda_runtime.h>

#include "sm100/sm100_fmha_launch.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 1000)
#error "mla_autograd: csrc/sm100 sources must be compiled for sm_100a"
#endif

namespace mla_sm100 {

__global__ void fwd_rewrite_cu_kernel(const int* __restrict__ cu_q, const int* __restrict__ cu_k, int batch,
                                      bool split, int* __restrict__ dq, int* __restrict__ dk) {
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b <= batch; b += gridDim.x * blockDim.x) {
    int q0 = cu_q[b], k0 = cu_k[b];
    if (!split) {
      // dst[b + 1] = cu[b]; dst[0] = cu[0]
      dq[b + 1] = q0;
      dk[b + 1] = k0;
      if (b == 0) { dq[0] = q0; dk[0] = k0; }
    } else {
      if (b == 0) { dq[0] = q0; dk[0] = k0; }
      dq[2 * b + 1] = q0;
      dk[2 * b + 1] = k0;
      if (b < batch) {
        int len_q = cu_q[b + 1] - q0;
        int len_k = cu_k[b + 1] - k0;
        int skip = len_q > len_k ? len_q - len_k : 0;
        dq[2 * b + 2] = q0 + skip;  // rows [q0, q0 + skip) see no key: their own batch with 0 keys
        dk[2 * b + 2] = k0;
      }
    }
  }
}

LaunchStatus fwd_rewrite_cu(const int* cu_q, const int* cu_k, int batch, bool split_bottom_right, int* dst_q,
                            int* dst_k, cudaStream_t stream) {
  int threads = 256;
  int blocks = (batch + 1 + threads - 1) / threads;
  if (blocks > 1024) blocks = 1024;
  fwd_rewrite_cu_kernel<<<blocks, threads, 0, stream>>>(cu_q, cu_k, batch, split_bottom_right, dst_q, dst_k);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return LaunchStatus::fail("cu_seqlens rewrite kernel launch failed", e);
  return LaunchStatus::ok();
}

}  // namespace mla_sm100
