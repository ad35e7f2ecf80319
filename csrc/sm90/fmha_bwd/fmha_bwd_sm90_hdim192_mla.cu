// The MLA-native instantiation of the SM90 fused attention backward: q_nope / q_pe and k_nope / k_pe read where they
// are, dK written as dk_nope and dk_pe, (Dn, Dr, Dv) = (128, 64, 128), bf16 and fp16.
#include "fmha_bwd_sm90_kernel.cuh"

cudaError_t fmha_bwd_sm90_run_mla_192_128(const FmhaBwdSm90Params& p, const FmhaBwdSm90RopeParts& rope,
                                          const FmhaBwdSm90Options& opt, int l2_bytes, cudaStream_t stream) {
  return p.is_bf16 ? fmha_bwd_sm90::run_mla<__nv_bfloat16>(p, rope, opt, l2_bytes, stream)
                   : fmha_bwd_sm90::run_mla<__half>(p, rope, opt, l2_bytes, stream);
}
