// The uncovered-rows kernel of the SM90 fused attention backward (family fmha_bwd_sm90), packed (varlen) batches
// only: the gradient rows that no sequence covers are 0 (the contract of attention_varlen), and the other kernels
// write only the rows their sequences cover. Zeroing the whole gradients first wrote dq, dk and dv once more per
// call (536 MB at 32k tokens, H=16, 192/128); this kernel writes only the rows between and around the sequences,
// which with valid cu_seqlens are none.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#include "sm90/fmha_bwd/fmha_bwd_sm90_params.h"

namespace {

__device__ __forceinline__ int64_t clamp_rows(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// One warp per gap g = 0 .. batch, for each tensor: the rows from the end of what sequence g - 1 covers (row 0 for
// g = 0) to the start of sequence g (the tensor's last row for g = batch). Sequence b covers rows [s, s + n), with
// s = cu[b] clamped into [0, rows], its end cu[b + 1] clamped into [s, rows] and n cut at max_seqlen: the rule of
// every kernel of the backward. Every uncovered row lies in some gap (a walk from s_0 to the last covered end that
// only ever steps forward over covered rows or gaps, and back); a gap may also hold rows that an overlapping
// sequence covers (decreasing cu_seqlens), which that sequence's kernels then write after this one. The values of
// cu_seqlens are only read and clamped: any values are memory-safe.
__global__ void __launch_bounds__(256) fmha_bwd_sm90_zero_rows_kernel(const FmhaBwdSm90ZeroRows z) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t warp0 = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  for (int i = 0; i < z.count; ++i) {
    const FmhaBwdSm90GradRows& t = z.t[i];
    for (int64_t g = warp0; g <= z.batch; g += warps) {
      int64_t lo = 0, hi = t.rows;
      if (g > 0) {
        const int64_t s = clamp_rows(t.cu_seqlens[g - 1], 0, t.rows);
        const int64_t e = clamp_rows(t.cu_seqlens[g], s, t.rows);
        lo = s + (e - s < t.max_seqlen ? e - s : t.max_seqlen);
      }
      if (g < z.batch) hi = clamp_rows(t.cu_seqlens[g], 0, t.rows);
      if (hi <= lo) continue;
      const int64_t per_row = int64_t(t.heads) * t.cols;
      const int64_t n = (hi - lo) * per_row;
      uint16_t* const base = static_cast<uint16_t*>(t.ptr);  // bf16 / fp16 zero: all bits clear
      for (int64_t x = lane; x < n; x += 32) {
        const int64_t row = lo + x / per_row, in_row = x % per_row;
        base[row * t.row_stride + (in_row / t.cols) * t.head_stride + in_row % t.cols] = 0;
      }
    }
  }
}

}  // namespace

cudaError_t fmha_bwd_sm90_zero_uncovered_rows(const FmhaBwdSm90ZeroRows& z, cudaStream_t stream) {
  if (z.count < 0 || z.count > kFmhaBwdSm90ZeroRowsMaxTensors || z.batch < 0) return cudaErrorInvalidValue;
  if (z.count == 0) return cudaSuccess;
  const int64_t warps = int64_t(z.batch) + 1;  // one per gap
  const int ctas = int((warps + 7) / 8 < 1024 ? (warps + 7) / 8 : 1024);
  fmha_bwd_sm90_zero_rows_kernel<<<ctas, 256, 0, stream>>>(z);
  return cudaGetLastError();
}
