// SM100 backward main-kernel instantiations: bf16, d=128 (tile 128 x 128, GQA looped in the CTA); masks residual / causal top-left / causal bottom-right.
#include "sm100/fmha/sm100_fmha_bwd_impl.cuh"
MLA_SM100_BWD_TU(bwd_bf16_mha, cutlass::bfloat16_t, false)
