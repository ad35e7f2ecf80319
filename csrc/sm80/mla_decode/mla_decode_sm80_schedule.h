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
#include "sm80/mla_decode/mla_decode_sm80_config.h"
#include "sm80/mla_decode/mla_decode_sm80_params.h"

namespace mla_decode_sm80 {

__device__ __forceinline__ int tiles_of(int len) { return (max(len, 0) + kBlockN - 1) / kBlockN; }

// The length of a request as every kernel uses it: cache_seqlens[b] clamped to [0, kv_capacity], so that a negative
// or oversized value can never index block_table past its row (what such a request computes is documented in
// mla_autograd.decode; check_values reports the value instead).
__device__ __forceinline__ int request_len(const DecodeParams& p, int b) {
  return min(max(__ldg(p.seqlens + b), 0), p.kv_capacity);
}

// Divisions in 32 bits whenever the operands fit (always in practice): a 64-bit division is a subroutine call,
// and these run on every main-kernel CTA's critical path (the inline schedule).
__device__ __forceinline__ long long split_budget(long long total_tiles, int num_parts, int min_tiles) {
  const long long n = total_tiles + num_parts - 1;
  const long long t = n <= 0xffffffffLL ? (long long)(unsigned(n) / unsigned(num_parts)) : n / num_parts;
  return t < min_tiles ? min_tiles : t;
}

// Splits of a request with x tiles for the budget T: round(x / T), or rounded down. In 32 bits: x < 2^26, and a
// budget past INT_MAX gives the same 0 as T itself (the warp-wide inline schedule runs it per request).
__device__ __forceinline__ int splits_of(int x, long long T, int force_splits, bool round_down) {
  const int t = T > 0x7fffffffLL ? 0x7fffffff : int(T);
  int s = force_splits > 0 ? force_splits : (round_down ? x / t : int((unsigned(x) + unsigned(t) / 2u) / unsigned(t)));
  s = min(s, max(x, 1));
  return max(s, 1);
}

// Whether the rounded counts must be rounded down: they would need more than num_parts items, and one item per
// request would fit (B <= num_parts). rounded_items = sum of splits_of(..., false) over the requests.
__device__ __forceinline__ bool splits_round_down(long long rounded_items, int num_parts, int B, int force_splits) {
  return force_splits <= 0 && B <= num_parts && rounded_items > num_parts;
}

// First tile of split j of a request with x tiles in s splits (split j ends where split j+1 begins).
__device__ __forceinline__ int split_first_tile(int j, int x, int s) {
  const unsigned long long jx = (unsigned long long)unsigned(j) * unsigned(x);  // j, x >= 0
  return jx >> 32 ? int(jx / unsigned(s)) : int(unsigned(jx) / unsigned(s));
}

// The rule applied by one warp (all 32 lanes call it: shuffles) to the B <= kInlineScheduleMaxBatch lengths of
// p.seqlens, for the inline schedule: every length is loaded once into registers (lane l holds requests l, l + 32,
// ...), then requests are taken 32 at a time, in order, while more(first item of the next 32) holds, and
// visit(b, first item, splits, length) runs on the lane that holds request b.
// It is on every main-kernel CTA's critical path (nothing can load before the CTA knows its item), so it is written
// for a short dependency chain: one round trip for the lengths, the two warp sums as single-instruction reductions
// (redux.sync), 32-bit divisions, and the scans of all groups of 32 requests side by side. The first version
// (three passes over the lengths, each re-reading them, 64-bit divisions, one group's scan after another) made the
// main kernel ~2 us longer than with a precomputed schedule at B=128 on the H200 (torch.profiler, after an L2 flush).
// kPerLane groups of 32 requests per warp: 1 for B <= 32, whose call then costs what one group needs.
template <int kPerLane, typename Visit, typename More>
__device__ __forceinline__ void warp_request_splits_groups(const DecodeParams& p, Visit&& visit, More&& more) {
  const unsigned full = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  int len[kPerLane], x[kPerLane], s[kPerLane];
  int lane_tiles = 0;  // < 8 * 2^26 tiles: fits 32 bits per lane, not per warp
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int b = k * 32 + lane;
    len[k] = b < p.batch ? request_len(p, b) : 0;
    x[k] = tiles_of(len[k]);
    lane_tiles += x[k];
  }
  // the warp's total in two 32-bit reductions of 16-bit halves (each sum < 2^21), since it may pass 2^32
  const unsigned lo = __reduce_add_sync(full, unsigned(lane_tiles) & 0xffffu);
  const unsigned hi = __reduce_add_sync(full, unsigned(lane_tiles) >> 16);
  const long long T = split_budget((static_cast<long long>(hi) << 16) + lo, p.num_parts, p.min_tiles);
  // splits_of on every slot, then 0 past B: a select, not a branch around each division
  int lane_splits = 0;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int sk = splits_of(x[k], T, p.force_splits, false);
    s[k] = k * 32 + lane < p.batch ? sk : 0;
    lane_splits += s[k];
  }
  // Without force_splits, each count is at most x / T + 1 and T >= total / num_parts, so they sum to at most
  // num_parts + B: the 32-bit sum is exact whenever splits_round_down reads it.
  const int rounded = int(__reduce_add_sync(full, unsigned(lane_splits)));
  if (splits_round_down(rounded, p.num_parts, p.batch, p.force_splits)) {  // uniform across the warp
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int sk = splits_of(x[k], T, p.force_splits, true);
      s[k] = k * 32 + lane < p.batch ? sk : 0;
    }
  }
  int incl[kPerLane];  // inclusive scans of the splits over each group of 32 requests, all groups at once
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) incl[k] = s[k];
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int v = __shfl_up_sync(full, incl[k], off);
      if (lane >= off) incl[k] += v;
    }
  }
  int base = 0;  // first item of group k (uniform across the warp)
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    if (k * 32 >= p.batch || !more(base)) break;
    if (k * 32 + lane < p.batch) visit(k * 32 + lane, base + incl[k] - s[k], s[k], len[k]);
    base += __shfl_sync(full, incl[k], 31);
  }
}

// The form by batch size: the eight-group form alone makes the main kernel at B=128 as short as with a precomputed
// schedule, but costs B=4 and B=7 0.3-0.9 us per call against a one-group form, which is all a small batch needs
// (H200). Choosing by B is faster than either form alone at B = 4, 7, 32 and 128.
template <typename Visit, typename More>
__device__ __forceinline__ void warp_request_splits(const DecodeParams& p, Visit&& visit, More&& more) {
  if (p.batch <= 32) warp_request_splits_groups<1>(p, visit, more);
  else warp_request_splits_groups<kInlineScheduleMaxBatch / 32>(p, visit, more);
}

}  // namespace mla_decode_sm80
