// Instantiations of the SM90 forward kernel for (Dqk, Dv) = (64, 64), bf16 and fp16.
#include "sm90/fmha_fwd/fmha_fwd_sm90_kernel.cuh"

MLA_FMHA_FWD_SM90_DEFINE_LAUNCHER(64, 64)
