// Our own pre/post kernels of the SM100 backward (replacing CUTLASS example 77's FmhaKernelBwdSumOdO,
// which multiplies O*dO in bf16/fp16, and FmhaKernelBwdConvert, which uses int offsets):
//   prep:    neg_sum_odo[b][h][q] = -sum_d float(O) * float(dO)   (fp32 products and sum)
//            scaled_lse[b][h][q]  = lse == -inf ? -inf : -log2(e) * lse
//            (rows without any visible key have lse = -inf; -inf here makes P = exp2(S*c - inf) = 0
//             for them instead of exp2(-inf + inf) = NaN, so their dQ/dK/dV contributions are 0)
//   convert: dQ[cu[b] + q][h][:] = scale * dq_acc[b][h][q][:]
// plus the cu_seqlens sanitiser (sm100_fmha_cu.cuh).
// All offsets are int64.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "sm100/fmha/sm100_fmha_cu.cuh"
#include "sm100/fmha/sm100_fmha_launch.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 1000)
#error "mla_autograd: csrc/sm100 sources must be compiled for sm_100a"
#endif

namespace mla_sm100 {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;

template <class T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

template <class T>
__global__ void __launch_bounds__(kWarps * 32) bwd_prep_kernel(BwdPrep p) {
  const int b = blockIdx.z, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = p.cu_q[b];
  const int len = p.cu_q[b + 1] - p.cu_q[b];
  const int64_t ws = (int64_t(b) * p.hq + h) * p.qp;
  const T* o = static_cast<const T*>(p.o);
  const T* dout = static_cast<const T*>(p.dout);
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int q = blockIdx.x * kRowsPerBlock + warp * kRowsPerWarp + i;
    if (q >= p.qp) break;
    if (q >= len) {
      if (lane == 0) {
        p.neg_sum_odo[ws + q] = 0.f;
        p.scaled_lse[ws + q] = 0.f;
      }
      continue;
    }
    const int64_t r = row0 + q;
    const T* orow = o + r * p.o_row_stride + int64_t(h) * p.o_head_stride;
    const T* drow = dout + r * p.do_row_stride + int64_t(h) * p.do_head_stride;
    float acc = 0.f;
    for (int d = lane * 4; d < p.d_vo; d += 128) {
      // 4 elements = 8 bytes; rows and heads are 16-byte aligned (strides multiples of 8 elements)
      uint2 ov = *reinterpret_cast<const uint2*>(orow + d);
      uint2 dv = *reinterpret_cast<const uint2*>(drow + d);
      const T* oe = reinterpret_cast<const T*>(&ov);
      const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
      for (int j = 0; j < 4; ++j) acc = fmaf(to_f(oe[j]), to_f(de[j]), acc);
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (lane == 0) {
      const int64_t lrow =
          (p.lse_rows_from_cu ? r : int64_t(q)) + int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride;
      const float l = p.lse[lrow];
      p.neg_sum_odo[ws + q] = -acc;
      p.scaled_lse[ws + q] = (l == -INFINITY) ? -INFINITY : -1.4426950408889634f * l;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kWarps * 32) bwd_convert_kernel(BwdConvert p) {
  const int b = blockIdx.z, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = p.cu_q[b];
  const int len = p.cu_q[b + 1] - p.cu_q[b];
  T* dq = static_cast<T*>(p.dq);
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int q = blockIdx.x * kRowsPerBlock + warp * kRowsPerWarp + i;
    if (q >= len) break;
    const float* src = p.dq_acc + ((int64_t(b) * p.hq + h) * p.qp + q) * p.dp;
    T* dst = dq + (row0 + q) * p.dq_row_stride + int64_t(h) * p.dq_head_stride;
    for (int d = lane * 4; d < p.d_qk; d += 128) {
      float4 x = *reinterpret_cast<const float4*>(src + d);
      T y[4] = {from_f<T>(p.scale * x.x), from_f<T>(p.scale * x.y), from_f<T>(p.scale * x.z),
                from_f<T>(p.scale * x.w)};
      *reinterpret_cast<uint2*>(dst + d) = *reinterpret_cast<const uint2*>(y);
    }
  }
}

}  // namespace

cudaError_t bwd_prep_launch(BwdPrep const& p, cudaStream_t stream) {
  if (p.batch == 0 || p.hq == 0 || p.qp == 0) return cudaSuccess;
  if (p.d_vo % 4 != 0) return cudaErrorInvalidValue;  // rows are read 4 elements at a time
  if (p.batch > 65535 || p.hq > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid((p.qp + kRowsPerBlock - 1) / kRowsPerBlock, p.hq, p.batch);
  if (p.dtype == DType::kBF16) {
    bwd_prep_kernel<__nv_bfloat16><<<grid, kWarps * 32, 0, stream>>>(p);
  } else {
    bwd_prep_kernel<__half><<<grid, kWarps * 32, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t bwd_convert_launch(BwdConvert const& p, cudaStream_t stream) {
  if (p.batch == 0 || p.hq == 0 || p.max_seqlen_q == 0) return cudaSuccess;
  if (p.d_qk % 4 != 0) return cudaErrorInvalidValue;  // rows are written 4 elements at a time
  if (p.batch > 65535 || p.hq > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid((p.max_seqlen_q + kRowsPerBlock - 1) / kRowsPerBlock, p.hq, p.batch);
  if (p.dtype == DType::kBF16) {
    bwd_convert_kernel<__nv_bfloat16><<<grid, kWarps * 32, 0, stream>>>(p);
  } else {
    bwd_convert_kernel<__half><<<grid, kWarps * 32, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace mla_sm100
