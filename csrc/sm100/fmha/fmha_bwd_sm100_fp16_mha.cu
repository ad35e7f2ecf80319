// SM100 backward main-kernel instantiations: fp16, d=128 (tile 128 x 128, GQA looped in the CTA); masks residual / causal top-left / causal bottom-right.
#include "sm100/fmha/sm100_fmha_bwd_impl.cuh"
MLA_SM100_BWD_TU(bwd_fp16_mha, cutlass::half_t, false)
