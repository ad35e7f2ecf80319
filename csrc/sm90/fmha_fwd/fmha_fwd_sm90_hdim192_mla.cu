// The MLA-native instantiation of the SM90 forward kernel: q_nope / q_pe and k_nope / k_pe read where they are,
// (Dn, Dr, Dv) = (128, 64, 128), bf16 and fp16.
#include "sm90/fmha_fwd/fmha_fwd_sm90_kernel.cuh"

MLA_FMHA_FWD_SM90_DEFINE_MLA_LAUNCHER()
