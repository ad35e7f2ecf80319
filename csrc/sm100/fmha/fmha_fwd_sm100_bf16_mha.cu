// SM100 forward instantiations: bf16, d=128; masks residual / causal top-left / causal bottom-right.
#include "sm100/fmha/sm100_fmha_fwd_impl.cuh"
MLA_SM100_FWD_TU(fwd_bf16_mha, cutlass::bfloat16_t, false)
