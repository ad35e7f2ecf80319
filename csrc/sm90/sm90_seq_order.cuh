// The order in which the SM90 varlen schedules take a packed batch's sequences (FmhaProblemParams::seq_order): the
// kernel that writes it and its launcher. Used by the fmha_fwd_sm90 and fmha_bwd_sm90 launchers, each of which runs
// it before its kernels.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "common/fmha_params.h"
#include "sm90/sm90_attn_common.cuh"

namespace mla_sm90 {

// The order of a packed batch's sequences in the varlen schedules (FmhaProblemParams::seq_order): longest first
// (rows len_q + len_k as varlen_rows clamps them, descending; ties by index), so that the last CTAs of a grid (the
// backward's) or the last tiles of the dynamic schedule (the forward's) are short ones and no SM is left running
// the longest sequence's blocks while the others idle (docs/kernels/fmha_fwd_sm90.md, "Which tiles, and who takes
// them", has the measurements).
// One CTA, one thread per sequence, each ranking its own against every other in shared memory: batches of up to
// kSeqOrderMaxBatch sequences (common/fmha_params.h; the host layers leave larger ones in cu_seqlens order). The
// result is a permutation of [0, batch) whatever cu_seqlens holds. `counter`, when given, is zeroed too (the
// forward's dynamic tile counter, which then needs no memset of its own).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) seq_order_kernel(FmhaProblemParams const p, int* counter) {
  __shared__ unsigned key[kThreads];
  int const b = int(threadIdx.x);
  unsigned k = 0;  // len_q + len_k < 2^32
  if (b < p.batch) {
    int64_t start;
    int len_q, len_k;
    varlen_rows(p.cu_seqlens_q, b, p.rows_q, p.seqlen_q, start, len_q);
    varlen_rows(p.cu_seqlens_k, b, p.rows_k, p.seqlen_k, start, len_k);
    k = unsigned(len_q) + unsigned(len_k);
  }
  key[b] = k;
  __syncthreads();
  if (b < p.batch) {
    int rank = 0;
    for (int j = 0; j < p.batch; ++j) {
      unsigned const kj = key[j];
      rank += (kj > k || (kj == k && j < b)) ? 1 : 0;
    }
    p.seq_order[rank] = b;
  }
  if (counter != nullptr && b == 0) *counter = 0;
}

// Writes p.seq_order (p.batch <= kSeqOrderMaxBatch, varlen) on `stream`, and zeroes *counter when not nullptr.
inline cudaError_t launch_seq_order(FmhaProblemParams const& p, int* counter, cudaStream_t stream) {
  if (p.seq_order == nullptr || p.batch > kSeqOrderMaxBatch || p.cu_seqlens_q == nullptr ||
      p.cu_seqlens_k == nullptr) {
    return cudaErrorInvalidValue;
  }
  seq_order_kernel<kSeqOrderMaxBatch><<<1, kSeqOrderMaxBatch, 0, stream>>>(p, counter);
  return cudaGetLastError();
}

}  // namespace mla_sm90
