// The split-KV rule, one definition for the places that apply it: the metadata kernel (decode_schedule, and
// decode() for large batches), the main kernels' inline schedule (decode() without a schedule, small batches: each
// CTA derives its own item, so no metadata kernel runs; work_item in kernel.cuh) and the merge kernel, which then
// derives the split counts it needs the same way (mla_decode_sm80_combine.cu).
//
// Work of request b: x_b = ceil(L_b / kBlockN) tiles. Budget per part T = max(ceil(sum x_b / num_parts),
// min_tiles). Request b gets s_b = clamp(round(x_b / T), 1, max(x_b, 1)) splits (or force_splits, capped the
// same way). Rounding can ask for more than num_parts items although the requests would fit in num_parts (7 equal
// requests of 1024 tiles on 132 SMs: T = 55, 19 splits each, 133 items, one CTA in a second wave: 146 us per call
// on the H200 against 89 us without it); then, when B <= num_parts, every count is rounded down instead (18 each,
// 126 items). Split j covers tiles [floor(j x_b / s_b), floor((j+1) x_b / s_b)); its splits are the items
// sum_{b' < b} s_b' .. + s_b - 1 (sum s_b <= num_parts + B = num_items, so the grid is fixed by shapes).
#pragma once
#include "sm80/mla_decode_sm80_config.h"
#include "sm80/mla_decode_sm80_params.h"

namespace mla_decode_sm80 {

__device__ __forceinline__ int tiles_of(int len) { return (max(len, 0) + kBlockN - 1) / kBlockN; }

__device__ __forceinline__ long long split_budget(long long total_tiles, int num_parts, int min_tiles) {
  const long long t = (total_tiles + num_parts - 1) / num_parts;
  return t < min_tiles ? min_tiles : t;
}

// Splits of a request with x tiles for the budget T: round(x / T), or rounded down.
__device__ __forceinline__ int splits_of(int x, long long T, int force_splits, bool round_down) {
  int s = force_splits > 0 ? force_splits : int(round_down ? x / T : (x + T / 2) / T);
  s = min(s, max(x, 1));
  return max(s, 1);
}

// Whether the rounded counts must be rounded down: they would need more than num_parts items, and one item per
// request would fit (B <= num_parts). rounded_items = sum of splits_of(..., false) over the requests.
__device__ __forceinline__ bool splits_round_down(long long rounded_items, int num_parts, int B, int force_splits) {
  return force_splits <= 0 && B <= num_parts && rounded_items > num_parts;
}

// First tile of split j of a request with x tiles in s splits (split j ends where split j+1 begins).
__device__ __forceinline__ int split_first_tile(int j, int x, int s) { return int((long long)j * x / s); }

// The rule applied by one warp (all 32 lanes call it: shuffles) to the B lengths of p.seqlens, for the inline
// schedule (B <= kInlineScheduleMaxBatch): requests are taken 32 at a time, in order, while more(first item of the
// next 32) holds, and visit(b, first item, splits, length) runs on the lane that holds request b.
template <typename Visit, typename More>
__device__ __forceinline__ void warp_request_splits(const DecodeParams& p, Visit&& visit, More&& more) {
  const int lane = threadIdx.x & 31;
  long long total = 0;
#pragma unroll 4
  for (int b = lane; b < p.B; b += 32) total += tiles_of(__ldg(p.seqlens + b));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
  const long long T = split_budget(total, p.num_parts, p.min_tiles);
  int rounded = 0;
  if (p.force_splits <= 0 && p.B <= p.num_parts) {
    for (int b = lane; b < p.B; b += 32) rounded += splits_of(tiles_of(__ldg(p.seqlens + b)), T, 0, false);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) rounded += __shfl_xor_sync(0xffffffffu, rounded, off);
  }
  const bool down = splits_round_down(rounded, p.num_parts, p.B, p.force_splits);
  int base = 0;  // first item of request c (uniform across the warp)
  for (int c = 0; c < p.B && more(base); c += 32) {
    const int b = c + lane;
    const int L = b < p.B ? max(__ldg(p.seqlens + b), 0) : 0;
    const int s = b < p.B ? splits_of(tiles_of(L), T, p.force_splits, down) : 0;
    int incl = s;  // inclusive scan of the splits over the warp's 32 requests
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += v;
    }
    if (b < p.B) visit(b, base + incl - s, s, L);
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
}

}  // namespace mla_decode_sm80
