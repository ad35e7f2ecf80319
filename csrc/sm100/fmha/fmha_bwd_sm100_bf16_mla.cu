// SM100 backward main-kernel instantiations: bf16, d_qk=192 d_vo=128 (MLA kernel, tile Q 64 x KV 128); masks residual / causal top-left / causal bottom-right.
#include "sm100/fmha/sm100_fmha_bwd_impl.cuh"
MLA_SM100_BWD_TU(bwd_bf16_mla, cutlass::bfloat16_t, true)
