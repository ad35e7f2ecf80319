// Instantiation of the SM90 fused attention backward for (head_dim, head_dim_v) = (192, 128).
#include <stdexcept>
#include <string>
#include "fmha_bwd_sm90_kernel.cuh"

void fmha_bwd_sm90_run_192_128(const FmhaBwdSm90Params& p, const FmhaBwdSm90Options& opt, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.is_bf16) {
    fmha_bwd_sm90::run<__nv_bfloat16, 192, 128>(p, opt, s);
  } else {
    fmha_bwd_sm90::run<__half, 192, 128>(p, opt, s);
  }
}
