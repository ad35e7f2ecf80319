// The split-KV rule, one definition for the two places that apply it: the metadata kernel (decode_schedule,
// and decode() for large batches) and the main kernels' inline schedule (decode() without a schedule, small
// batches: each CTA derives its own item, so no metadata kernel runs; work_item in kernel.cuh).
//
// Work of request b: x_b = ceil(L_b / kBlockN) tiles. Budget per part T = max(ceil(sum x_b / num_parts),
// min_tiles). Request b gets s_b = clamp(round(x_b / T), 1, max(x_b, 1)) splits (or force_splits, capped the
// same way), split j covering tiles [floor(j x_b / s_b), floor((j+1) x_b / s_b)); its splits are the items
// sum_{b' < b} s_b' .. + s_b - 1 (sum s_b <= num_parts + B = num_items, so the grid is fixed by shapes).
#pragma once
#include "sm80/mla_decode_sm80_config.h"

namespace mla_decode_sm80 {

__device__ __forceinline__ int tiles_of(int len) { return (max(len, 0) + kBlockN - 1) / kBlockN; }

__device__ __forceinline__ long long split_budget(long long total_tiles, int num_parts, int min_tiles) {
  const long long t = (total_tiles + num_parts - 1) / num_parts;
  return t < min_tiles ? min_tiles : t;
}

__device__ __forceinline__ int splits_of(int x, long long T, int force_splits) {
  int s = force_splits > 0 ? force_splits : int((x + T / 2) / T);
  s = min(s, max(x, 1));
  return max(s, 1);
}

// First tile of split j of a request with x tiles in s splits (split j ends where split j+1 begins).
__device__ __forceinline__ int split_first_tile(int j, int x, int s) { return int((long long)j * x / s); }

}  // namespace mla_decode_sm80
