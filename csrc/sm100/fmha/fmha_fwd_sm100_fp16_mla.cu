// SM100 forward instantiations: fp16, d_qk=192 d_vo=128; masks residual / causal top-left / causal bottom-right.
#include "sm100/fmha/sm100_fmha_fwd_impl.cuh"
MLA_SM100_FWD_TU(fwd_fp16_mla, cutlass::half_t, true)
