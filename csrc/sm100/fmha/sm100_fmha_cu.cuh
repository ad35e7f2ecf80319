// The device side of sm100_fmha_cu.h: one block of kCuThreads threads sanitises cu_seqlens_q/k and lays
// out the launched arrays, on the caller's stream before the FMHA kernels (no host synchronisation).
// Included by the aux .cu of each SM100 family (each family is its own module), once.
#pragma once

#include <cuda_runtime.h>

#include "sm100/fmha/sm100_fmha_cu.h"
#include "sm100/fmha/sm100_fmha_launch.h"

namespace mla_sm100 {

__global__ void __launch_bounds__(kCuThreads) sanitize_cu_kernel(CuSanitize p) {
  __shared__ int scan[kCuThreads];
  const int t = threadIdx.x, n = p.batch + 1;
  int i0, i1;
  cu_chunk(t, kCuThreads, n, i0, i1);
  const int* cus[2] = {p.cu_q, p.cu_k};
  int* cs[2] = {p.c_q, p.c_k};
  const int rows[2] = {p.rows_q, p.rows_k};
  for (int w = 0; w < 2; ++w) {
    scan[t] = cu_chunk_max(cus[w], i0, i1, rows[w]);
    __syncthreads();
    for (int off = 1; off < kCuThreads; off <<= 1) {  // inclusive prefix maximum (Hillis-Steele)
      const int v = t >= off ? scan[t - off] : 0;
      __syncthreads();
      scan[t] = max_i(scan[t], v);
      __syncthreads();
    }
    cu_chunk_apply(cus[w], i0, i1, rows[w], t > 0 ? scan[t - 1] : 0, cs[w]);
    __syncthreads();  // scan[] is reused; c_q/c_k written by this block are visible to it after the barrier
  }
  if (p.layout != CuLayout::kPlain) cu_chunk_layout(p, i0, i1);
}

cudaError_t sanitize_cu(CuSanitize const& p, cudaStream_t stream) {
  if (p.batch < 0) return cudaErrorInvalidValue;
  sanitize_cu_kernel<<<1, kCuThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mla_sm100
