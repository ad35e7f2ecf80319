// Preprocess kernel of the SM90 fused attention backward (family fmha_bwd_sm90): dpsum, lse_log2, and the
// cleared dQ accumulator block and semaphore of every M-block (fmha_bwd_sm90_kernel.cuh describes the whole).
#pragma once

#include "fmha_bwd_sm90_common.cuh"

namespace fmha_bwd_sm90 {

using namespace cute;

// Preprocess: dpsum = rowsum(dO * O) (fp32), lse_log2 = lse * log2(e) (+inf for rows with no key
// and padding rows, so P = 0 there), clear the dQ accumulator block and its semaphore.
// Grid (ceil(max_seqlen_q / BM), Hq, B) or the compact varlen grid (row_block_coords), 256 threads (4 per row).
template <class Element, int D, int DV, int BM>
__global__ void __launch_bounds__(256) fmha_bwd_sm90_preprocess(const FmhaBwdSm90Params p) {
  static_assert(BM * 4 == 256, "4 threads per row");
  static_assert(DV % 32 == 0, "dv multiple of 32");
  const int h = blockIdx.y;
  int m, b;
  if (!row_block_coords<BM>(p, m, b)) return;
  const Seq s = get_seq<BM>(p, b);
  if (m * BM >= s.seqlen_q) return;
  const int tid = threadIdx.x;
  const int r = tid >> 2, part = tid & 3;
  const int i = m * BM + r;
  float acc = 0.f;
  if (i < s.seqlen_q) {
    const Element* o = static_cast<const Element*>(p.o) + b * p.o_batch_stride +
                       (s.offset_q + i) * p.o_row_stride + h * p.o_head_stride;
    const Element* d = static_cast<const Element*>(p.dout) + b * p.do_batch_stride +
                       (s.offset_q + i) * p.do_row_stride + h * p.do_head_stride;
#pragma unroll
    for (int c = part * 8; c < DV; c += 32) {
      uint4 ov = *reinterpret_cast<const uint4*>(o + c);
      uint4 dv = *reinterpret_cast<const uint4*>(d + c);
      const Element* oe = reinterpret_cast<const Element*>(&ov);
      const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += float(oe[e]) * float(de[e]);
    }
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  const int64_t srow = int64_t(h) * p.scratch_rows + s.scratch_start + int64_t(m) * BM + r;
  if (part == 0) {
    float l2 = INFINITY;
    if (i < s.seqlen_q) {
      float l = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + s.offset_q + i];
      l2 = (l == -INFINITY) ? INFINITY : l * float(M_LOG2E);
      if (l2 != l2) l2 = INFINITY;  // NaN lse: treat as "no key"
    }
    p.lse_log2[srow] = l2;
    p.dpsum[srow] = (i < s.seqlen_q) ? acc : 0.f;
  }
  // clear the fp32 dQ accumulator rows of this block
  float4* acc4 = reinterpret_cast<float4*>(p.dq_accum +
                                           (int64_t(h) * p.scratch_rows + s.scratch_start + int64_t(m) * BM) * D);
  for (int idx = tid; idx < BM * D / 4; idx += 256) acc4[idx] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (p.deterministic && tid == 0) {
    p.dq_sem[int64_t(h) * (p.scratch_rows / BM) + s.scratch_start / BM + m] = 0;
  }
}

}  // namespace fmha_bwd_sm90
