// Split-KV merge of the rows (token, head) of every request the schedule split; requests with one split were
// written by the main kernel directly and are skipped. Partial LSEs are base 2; an all-empty row gives out 0, lse -inf.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <cstdint>

#include "sm80/mla_decode_sm80_config.h"
#include "sm80/mla_decode_sm80_launch.h"
#include "sm80/mla_decode_sm80_params.h"

namespace mla_decode_sm80 {

constexpr int kCombineThreads = kDimCkv / 4;  // 128: 4 output dims per thread
constexpr int kCombineCtasPerSm = 2;          // grid cap per SM: 194-232 registers leave room for two CTAs

template <typename Elem> __device__ __forceinline__ void store4(Elem* dst, float a, float b, float c, float d);
template <> __device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* dst, float a, float b, float c, float d) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
  uint2 v;
  v.x = *reinterpret_cast<uint32_t*>(&lo);
  v.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(dst) = v;
}
template <> __device__ __forceinline__ void store4<__half>(__half* dst, float a, float b, float c, float d) {
  __half2 lo = __floats2half2_rn(a, b), hi = __floats2half2_rn(c, d);
  uint2 v;
  v.x = *reinterpret_cast<uint32_t*>(&lo);
  v.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(dst) = v;
}

// The merge of one row (request b, row grow = token * H + head) by the CTA's 128 threads; thread i owns output
// dims 4i..4i+3, so each split's partial row (2 KB) is read fully coalesced. A row's merge is latency-bound (a
// few KB, from L2), so it is written for few dependent round trips: the split LSEs are read in parallel (one
// per thread) and reduced through shuffles, their weights go through shared memory, and the partial rows are
// read 32 splits at a time, so up to 32 splits (B=4 on 132 SMs: 32) take one round trip (an earlier version
// read the LSEs in a serial loop and 8 rows at a time: ~5 us for 32 splits).
constexpr int kCombineChunk = kCombineThreads;  // splits whose weights are staged in smem at a time
constexpr int kCombineInFlight = 32;            // partial rows loaded before the first is used

struct CombineSmem {
  float w[kCombineChunk];                // the current chunk's split weights
  float max[kCombineThreads / 32];       // per-warp LSE maxima
  unsigned todo[kCombineThreads / 32];   // which of the CTA's next 128 rows belong to split requests
};

template <typename Elem>
__device__ __forceinline__ void merge_row(const DecodeParams& p, CombineSmem& sm, int b, int grow, int first, int ns) {
  const int tid = threadIdx.x;
  const int rows = p.Sq * p.H;
  const int t = grow / p.H, h = grow % p.H;
  const float* lse_p = p.ws_lse + (long long)first * rows + grow;
  __syncthreads();  // the previous row's readers of sm.w / sm.max are done

  // max of the split LSEs: thread i reads splits i, i + 128, ...; the first chunk's value is kept
  const float lse0 = tid < ns ? __ldg(lse_p + (long long)tid * rows) : -INFINITY;
  float m = lse0;
  for (int j = tid + kCombineThreads; j < ns; j += kCombineThreads) m = fmaxf(m, __ldg(lse_p + (long long)j * rows));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((tid & 31) == 0) sm.max[tid >> 5] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kCombineThreads / 32; ++w) m = fmaxf(m, sm.max[w]);

  Elem* out = reinterpret_cast<Elem*>(p.out) + (long long)b * p.o_stride_b + (long long)t * p.o_stride_s + (long long)h * p.o_stride_h;
  float* lse_out = p.lse + (long long)b * p.lse_stride_b + (long long)h * p.lse_stride_h + t;
  if (m == -INFINITY) {  // no split saw a key (m is the same in every thread: the branch is uniform)
    store4<Elem>(out + tid * 4, 0.f, 0.f, 0.f, 0.f);
    if (tid == 0) *lse_out = -INFINITY;
    return;
  }
  float sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4* src = reinterpret_cast<const float4*>(p.ws_o + ((long long)first * rows + grow) * kDimCkv) + tid;
  const long long split_stride = (long long)rows * kDimCkv / 4;  // in float4
  for (int c0 = 0; c0 < ns; c0 += kCombineChunk) {
    const int n = min(kCombineChunk, ns - c0);
    if (c0 > 0) __syncthreads();  // every thread is done with the previous chunk's weights
    if (tid < n) sm.w[tid] = exp2f((c0 == 0 ? lse0 : __ldg(lse_p + (long long)(c0 + tid) * rows)) - m);
    __syncthreads();
    // kCombineInFlight partial rows per round trip. The last round re-reads row n-1 in place of the missing
    // ones, with weight 0: unconditional loads and FMAs (before, a remainder ran one dependent load per split)
    for (int j = 0; j < n; j += kCombineInFlight) {
      float4 v[kCombineInFlight];
#pragma unroll
      for (int u = 0; u < kCombineInFlight; ++u) v[u] = __ldg(src + (long long)(c0 + min(j + u, n - 1)) * split_stride);
#pragma unroll
      for (int u = 0; u < kCombineInFlight; ++u) {
        const float w = j + u < n ? sm.w[j + u] : 0.f;
        sum += w;
        acc.x += w * v[u].x; acc.y += w * v[u].y; acc.z += w * v[u].z; acc.w += w * v[u].w;
      }
    }
  }
  // empty splits have w = 0 and a zero partial O; sum >= 1 since the max split contributes exp2(0)
  const float inv = 1.f / sum;
  store4<Elem>(out + tid * 4, acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  if (tid == 0) *lse_out = (m + __log2f(sum)) * 0.6931471805599453f;
}

// A grid of at most kCombineCtasPerSm CTAs per SM; CTA c owns rows c, c + G, c + 2G, ... of the B * Sq * H
// (request, row) pairs. Requests with one split were written by the main kernel directly and are skipped: one
// load per thread tells which of the CTA's next 128 rows need a merge. Why not one CTA per row: when nothing is
// split (B=128, H=128: 16,384 rows) the launch of that many CTAs alone took 29 us after the main kernel ended
// on the H200 (the CTAs cannot become resident before it ends: its shared memory fills the SM).
template <typename Elem>
__global__ void __launch_bounds__(kCombineThreads, 1) mla_decode_combine_kernel(const DecodeParams p) {
  grid_dependency_wait();  // the main kernel's partial outputs and the schedule (PDL); before any read or write
  __shared__ CombineSmem sm;
  const int tid = threadIdx.x;
  const int rows = p.Sq * p.H;
  const long long total = (long long)p.B * rows, G = gridDim.x;
  for (long long base = blockIdx.x; base < total; base += G * kCombineThreads) {
    const long long mine = base + tid * G;
    int ns = 0;
    if (mine < total) ns = p.sched_reqs[(mine / rows) * 2 + 1];
    const unsigned todo = __ballot_sync(0xffffffffu, ns > 1);
    if ((tid & 31) == 0) sm.todo[tid >> 5] = todo;
    __syncthreads();
#pragma unroll 1
    for (int w = 0; w < kCombineThreads / 32; ++w) {
      for (unsigned bits = sm.todo[w]; bits != 0; bits &= bits - 1) {
        const long long idx = base + (long long)(w * 32 + __ffs(bits) - 1) * G;
        const int b = int(idx / rows), grow = int(idx % rows);
        merge_row<Elem>(p, sm, b, grow, p.sched_reqs[b * 2 + 0], p.sched_reqs[b * 2 + 1]);
      }
    }
    __syncthreads();  // every thread has read sm.todo before the next round rewrites it
  }
}

void launch_combine(const DecodeParams& p, bool is_bf16, int num_sms, cudaStream_t stream) {
  const long long rows = (long long)p.B * p.Sq * p.H;
  if (rows == 0) return;
  const unsigned blocks = unsigned(std::min<long long>(rows, (long long)num_sms * kCombineCtasPerSm));
  if (is_bf16) launch_dependent(mla_decode_combine_kernel<__nv_bfloat16>, dim3(blocks), kCombineThreads, 0, stream, p);
  else launch_dependent(mla_decode_combine_kernel<__half>, dim3(blocks), kCombineThreads, 0, stream, p);
}

}  // namespace mla_decode_sm80
