// The rows of one sequence of a packed (varlen) batch, the one rule every SM90 kernel of the fused attention
// (forward, backward, their helper kernels) reads cu_seqlens by. Plain CUDA, no CuTe: small kernels include it alone.
#pragma once

#include <cstdint>

namespace mla_sm90 {

// Rows of sequence b of a packed (varlen) batch, as every SM90 kernel reads them (forward and backward):
// cu[b] and cu[b + 1] clamped into [0, rows] (the packed tensor's rows) with the end at least the start,
// and the length capped at max_len (max_seqlen, which sizes the grids). For valid cu_seqlens and max_seqlen
// this is exactly rows [cu[b], cu[b + 1]); for any other values (negative, decreasing, past the tensor,
// longer than max_seqlen) no row outside the tensor is read or written, and every kernel of a call agrees on
// the clamped ranges. What such a sequence computes is documented in mla_autograd.attention_varlen.
__host__ __device__ __forceinline__ void varlen_rows(int const* cu, int b, int rows, int max_len, int64_t& start,
                                                    int& len) {
  int const s = cu[b] < 0 ? 0 : (cu[b] > rows ? rows : cu[b]);
  int const e = cu[b + 1] < s ? s : (cu[b + 1] > rows ? rows : cu[b + 1]);
  start = s;
  len = e - s < max_len ? e - s : max_len;
}

}  // namespace mla_sm90
