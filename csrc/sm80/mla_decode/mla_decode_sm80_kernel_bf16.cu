// bf16 instantiations of the MLA decode kernels (all-warps and warp-specialized).
#include "sm80/mla_decode/mla_decode_sm80_ws_kernel.cuh"

namespace mla_decode_sm80 {
cudaError_t launch_decode_bf16(const DecodeParams& p, int m_tile, cudaStream_t stream) {
  return launch_decode_any<__nv_bfloat16>(p, m_tile, stream);
}
}  // namespace mla_decode_sm80
