// Postprocess kernel of the SM90 fused attention backward (family fmha_bwd_sm90): dq = softmax_scale *
// dq_accum, converted to the 16-bit dtype (fmha_bwd_sm90_kernel.cuh describes the whole).
#pragma once

#include "fmha_bwd_sm90_common.cuh"

namespace fmha_bwd_sm90 {

using namespace cute;

// ------------------------------------------------------------------------------------------------
// Postprocess: dq = softmax_scale * dq_accum (undo the column permutation), cast, store.
// Grid (ceil(max_seqlen_q / BM), Hq, B) or the compact varlen grid (row_block_coords), 256 threads.
// Consecutive lanes read consecutive 16-byte vectors of the block (one warp instruction = 512 contiguous
// bytes), all of a thread's loads before its stores.
// Each vector holds two column pairs (dq_vec_col): two 4-byte stores of the converted pairs.
template <class Element, int D, int BM>
__global__ void __launch_bounds__(256) fmha_bwd_sm90_postprocess(const FmhaBwdSm90Params p) {
  static_assert(D % 32 == 0, "head dim multiple of 32 (pairs of 16-column groups)");
  constexpr int kRowVecs = D / 4;
  constexpr int kVecs = BM * kRowVecs / 256;  // per thread
  static_assert(BM * kRowVecs % 256 == 0, "whole vectors per thread");
  const int h = blockIdx.y;
  int m, b;
  if (!row_block_coords<BM>(p, m, b)) return;
  const Seq s = get_seq<BM>(p, b);
  if (m * BM >= s.seqlen_q) return;
  const float4* src = reinterpret_cast<const float4*>(
      p.dq_accum + (int64_t(h) * p.scratch_rows + s.scratch_start + int64_t(m) * BM) * D);
  float4 x[kVecs];
  CUTE_UNROLL
  for (int k = 0; k < kVecs; ++k) {
    const int f = threadIdx.x + 256 * k;
    x[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m * BM + f / kRowVecs < s.seqlen_q) x[k] = __ldcs(src + f);
  }
  using CuteElement = typename CuteType<Element>::type;  // same bits, with cutlass's converters
  using Pair = cutlass::Array<CuteElement, 2>;
  cutlass::NumericArrayConverter<CuteElement, float, 2, cutlass::FloatRoundStyle::round_to_nearest> conv;
  CUTE_UNROLL
  for (int k = 0; k < kVecs; ++k) {
    const int f = threadIdx.x + 256 * k;
    const int r = f / kRowVecs, c4 = f % kRowVecs, i = m * BM + r;
    if (i >= s.seqlen_q) continue;
    const int col = dq_vec_col(r, c4);
    Element* dst = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + (s.offset_q + i) * p.dq_row_stride +
                   h * p.dq_head_stride + col;
    cutlass::Array<float, 2> lo, hi;
    lo[0] = x[k].x * p.softmax_scale; lo[1] = x[k].y * p.softmax_scale;
    hi[0] = x[k].z * p.softmax_scale; hi[1] = x[k].w * p.softmax_scale;
    *reinterpret_cast<Pair*>(dst) = conv(lo);
    *reinterpret_cast<Pair*>(dst + 8) = conv(hi);
  }
}

}  // namespace fmha_bwd_sm90
