// Instantiation of the SM90 fused attention backward for (head_dim, head_dim_v) = (64, 64).
#include "fmha_bwd_sm90_kernel.cuh"

cudaError_t fmha_bwd_sm90_run_64_64(const FmhaBwdSm90Params& p, const FmhaBwdSm90Options& opt, int l2_bytes,
                                    cudaStream_t stream) {
  return p.is_bf16 ? fmha_bwd_sm90::run<__nv_bfloat16, 64, 64>(p, opt, l2_bytes, stream)
                   : fmha_bwd_sm90::run<__half, 64, 64>(p, opt, l2_bytes, stream);
}
