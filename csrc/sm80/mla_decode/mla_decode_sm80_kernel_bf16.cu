// bf16 instantiations of the MLA decode kernels (all-warps, warp-specialized, row-group, and the Hopper wgmma kernel).
#include "sm80/mla_decode/mla_decode_sm80_ws_kernel.cuh"
#include "sm90/mla_decode/mla_decode_sm90_kernel.cuh"

namespace mla_decode_sm80 {
cudaError_t launch_decode_bf16(const DecodeParams& p, int m_tile, cudaStream_t stream) {
  if (p.wgmma && m_tile == 64) return mla_decode_sm90::launch_decode_sm90<__nv_bfloat16>(p, stream);
  return launch_decode_any<__nv_bfloat16>(p, m_tile, stream);
}
}  // namespace mla_decode_sm80

namespace mla_decode_sm90 {
int sm90_smem_bytes() { return DecodeSm90Traits<cutlass::bfloat16_t>::kSmemBytes; }
}  // namespace mla_decode_sm90
