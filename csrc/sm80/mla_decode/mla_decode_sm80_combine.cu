// Split-KV merge of the rows (token, head) of every request the schedule split; requests with one split were
// written by the main kernel directly and are skipped. Partial LSEs are base 2; an all-empty row gives out 0, lse -inf.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <cstdint>

#include "sm80/mla_decode/mla_decode_sm80_config.h"
#include "sm80/mla_decode/mla_decode_sm80_launch.h"
#include "sm80/mla_decode/mla_decode_sm80_params.h"
#include "sm80/mla_decode/mla_decode_sm80_schedule.h"

namespace mla_decode_sm80 {

// One warp per CTA, each merging a slice of kCombineSliceDims output dims of a row: a row's merge is latency-bound
// (a few KB per split, from L2), and a 128-thread CTA per row put all of a row's bytes on one SM (B=4, H=16: 64 rows
// on 64 of the 132 SMs); four slices of a row go to four CTAs.
constexpr int kCombineThreads = 32;
constexpr int kCombineSliceDims = 128;                        // 4 output dims per lane
constexpr int kCombineSlices = kDimCkv / kCombineSliceDims;   // 4 per row
// Grid cap per SM. 2 measured the same at H=16 B=128 but slower at B=7, S=32768 (90.9 against 89.2 us per call on
// the H200: 264 CTAs for 448 units).
constexpr int kCombineCtasPerSm = 8;
constexpr int kCombineInFlight = 32;                          // splits whose partial rows are loaded at once

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

// The merge of output dims [kCombineSliceDims q, +kCombineSliceDims) of one row (request b, row grow = token * H +
// head) over its ns splits (items first .. first + ns - 1) by one warp; lane i owns 4 consecutive dims, so each
// split's slice (512 B) is read coalesced. Written for few dependent round trips after the PDL wait: per 32 splits
// the LSEs (one per lane) and the partial rows are loaded together; then the warp's LSE maximum, each lane's split
// weight, and the weighted sum with the weights broadcast by shuffles. More than 32 splits rescale the running sum
// per group of 32 (online, as in the kernels' softmax).
template <typename Elem>
__device__ __forceinline__ void merge_slice(const DecodeParams& p, int b, int grow, int q, int first, int ns) {
  const int lane = threadIdx.x & 31;
  const int rows = p.seqlen_q * p.hq;
  const int t = grow / p.hq, h = grow % p.hq;
  const float* lse_p = p.ws_lse + (long long)first * rows + grow;
  const float4* src =
      reinterpret_cast<const float4*>(p.ws_o + ((long long)first * rows + grow) * kDimCkv + q * kCombineSliceDims) + lane;
  const long long split_stride = (long long)rows * kDimCkv / 4;  // in float4

  float m = -INFINITY, sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int c0 = 0; c0 < ns; c0 += kCombineInFlight) {
    const int n = min(kCombineInFlight, ns - c0);
    const float l = lane < n ? __ldg(lse_p + (long long)(c0 + lane) * rows) : -INFINITY;
    // past n: row n - 1 again, with weight 0 (unconditional loads and FMAs)
    float4 v[kCombineInFlight];
#pragma unroll
    for (int u = 0; u < kCombineInFlight; ++u) v[u] = __ldg(src + (long long)(c0 + min(u, n - 1)) * split_stride);
    float cm = l;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, off));
    const float nm = fmaxf(m, cm);
    if (nm == -INFINITY) continue;  // no split so far saw a key (uniform: nm is the same in every lane)
    const float r = exp2f(m - nm);  // 0 while m is -inf
    sum *= r;
    acc.x *= r; acc.y *= r; acc.z *= r; acc.w *= r;
    const float w = exp2f(l - nm);  // this lane's split; 0 for an empty split or past n
#pragma unroll
    for (int u = 0; u < kCombineInFlight; ++u) {
      const float wu = __shfl_sync(0xffffffffu, w, u);
      sum += wu;
      acc.x += wu * v[u].x; acc.y += wu * v[u].y; acc.z += wu * v[u].z; acc.w += wu * v[u].w;
    }
    m = nm;
  }

  Elem* out = reinterpret_cast<Elem*>(p.out) + (long long)b * p.o_batch_stride + (long long)t * p.o_row_stride +
              (long long)h * p.o_head_stride + q * kCombineSliceDims + lane * 4;
  float* lse_out = p.lse + (long long)b * p.lse_batch_stride + (long long)h * p.lse_head_stride + t;
  if (m == -INFINITY) {  // an all-empty row: out 0, lse -inf
    store4<Elem>(out, 0.f, 0.f, 0.f, 0.f);
    if (q == 0 && lane == 0) *lse_out = -INFINITY;
    return;
  }
  // empty splits have w = 0 and a zero partial O; sum >= 1 since the max split contributes exp2(0)
  const float inv = 1.f / sum;
  store4<Elem>(out, acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  if (q == 0 && lane == 0) *lse_out = (m + __log2f(sum)) * 0.6931471805599453f;
}

// A grid of at most kCombineCtasPerSm one-warp CTAs per SM over the B * Sq * H * kCombineSlices (row, slice) units;
// CTA c owns units c, c + G, c + 2G, ..., so a row's slices land on consecutive CTAs. Requests with one split were
// written by the main kernel directly and are skipped: each lane looks up one unit's request, and a ballot says
// which of the warp's next 32 units need a merge. Why not one CTA per row: when nothing is split (B=128, H=128:
// 16,384 rows) the launch of that many CTAs alone took 29 us after the main kernel ended on the H200 (they cannot
// become resident before it ends: its shared memory fills the SM).
//
// The split counts come from the precomputed schedule, or, with the inline schedule, from the split rule applied
// to the lengths here (into shared memory). Both are read before the PDL wait: the main kernel lets this kernel
// launch only after its own wait, so whatever wrote them has completed (work_item). After the wait, a unit costs
// one round trip to L2 (its LSEs and partial rows together).
template <typename Elem>
__global__ void __launch_bounds__(kCombineThreads) mla_decode_combine_kernel(const DecodeParams p) {
  __shared__ int2 s_req[kInlineScheduleMaxBatch];  // inline schedule: (first item, splits) per request
  const int lane = threadIdx.x;
  const int rows = p.seqlen_q * p.hq;
  const long long units = (long long)p.batch * rows * kCombineSlices, G = gridDim.x;
  if (p.sched_inline) {
    warp_request_splits(
        p, [&](int b, int first, int s, int) { s_req[b] = make_int2(first, s); }, [](int) { return true; });
    __syncwarp();
  }
  auto lookup = [&](long long u) {
    if (u >= units) return make_int2(0, 0);
    const int b = int(u / kCombineSlices / rows);
    return p.sched_inline ? s_req[b] : make_int2(__ldg(p.sched_reqs + 2 * b), __ldg(p.sched_reqs + 2 * b + 1));
  };
  int2 req = lookup(blockIdx.x + lane * G);  // the first round's, before the wait
  // (PDL) before reading the partial outputs and before any write, in every CTA
  grid_dependency_wait();
  for (long long base = blockIdx.x; base < units; base += kCombineThreads * G) {
    if (base != blockIdx.x) req = lookup(base + lane * G);
    for (unsigned bits = __ballot_sync(0xffffffffu, req.y > 1); bits != 0; bits &= bits - 1) {
      const int src = __ffs(bits) - 1;
      const int first = __shfl_sync(0xffffffffu, req.x, src), ns = __shfl_sync(0xffffffffu, req.y, src);
      const long long row = (base + src * G) / kCombineSlices;
      merge_slice<Elem>(p, int(row / rows), int(row % rows), int((base + src * G) % kCombineSlices), first, ns);
    }
  }
}

cudaError_t launch_combine(const DecodeParams& p, bool is_bf16, int num_sms, cudaStream_t stream) {
  const long long units = (long long)p.batch * p.seqlen_q * p.hq * kCombineSlices;
  if (units == 0) return cudaSuccess;
  const unsigned blocks = unsigned(std::min<long long>(units, (long long)num_sms * kCombineCtasPerSm));
  return is_bf16
             ? launch_dependent(mla_decode_combine_kernel<__nv_bfloat16>, dim3(blocks), kCombineThreads, 0, stream, p)
             : launch_dependent(mla_decode_combine_kernel<__half>, dim3(blocks), kCombineThreads, 0, stream, p);
}

}  // namespace mla_decode_sm80
