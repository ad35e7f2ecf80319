// The uncovered-rows kernel of the SM90 fused attention backward (family fmha_bwd_sm90), packed (varlen) batches
// only: the gradient rows that no sequence covers are 0 (the contract of attention_varlen), and the other kernels
// write only the rows their sequences cover. Zeroing the whole gradients first wrote dq, dk and dv once more per
// call (536 MB at 32k tokens, H=16, 192/128); this kernel writes only the rows between and around the sequences,
// which with valid cu_seqlens are none.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#include "sm90/fmha_bwd/fmha_bwd_sm90_params.h"
#include "sm90/sm90_varlen_rows.cuh"

namespace {

// One warp per gap g = 0 .. batch, for each tensor: the rows from the end of sequence g - 1 (row 0 for g = 0) to the
// start of sequence g (the tensor's last row for g = batch), with the sequences' rows as mla_sm90::varlen_rows gives
// them to every kernel of the backward. Every uncovered row lies in some gap (a walk from the first sequence's start
// to the last covered end that only ever steps forward over covered rows or gaps, and back); a gap may also hold
// rows that an overlapping sequence covers (decreasing cu_seqlens), which that sequence's kernels then write after
// this one. The values of cu_seqlens are only read and clamped: any values are memory-safe.
__global__ void __launch_bounds__(256) fmha_bwd_sm90_zero_rows_kernel(const FmhaBwdSm90ZeroRows z) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t warp0 = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  for (int i = 0; i < z.count; ++i) {
    const FmhaBwdSm90GradRows& t = z.t[i];
    for (int64_t g = warp0; g <= z.batch; g += warps) {
      int64_t lo = 0, hi = t.rows;
      int64_t start;
      int len;
      if (g > 0) {
        mla_sm90::varlen_rows(t.cu_seqlens, int(g) - 1, t.rows, t.max_seqlen, start, len);
        lo = start + len;
      }
      if (g < z.batch) {
        mla_sm90::varlen_rows(t.cu_seqlens, int(g), t.rows, t.max_seqlen, start, len);
        hi = start;
      }
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
