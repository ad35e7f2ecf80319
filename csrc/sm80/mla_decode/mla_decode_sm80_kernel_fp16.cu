// fp16 instantiations of the MLA decode kernels (all-warps, warp-specialized, row-group, and the Hopper wgmma kernel).
#include "sm80/mla_decode/mla_decode_sm80_ws_kernel.cuh"
#include "sm90/mla_decode/mla_decode_sm90_kernel.cuh"

namespace mla_decode_sm80 {
cudaError_t launch_decode_fp16(const DecodeParams& p, int m_tile, cudaStream_t stream) {
  if (p.wgmma && m_tile == 64) return mla_decode_sm90::launch_decode_sm90<__half>(p, stream);
  return launch_decode_any<__half>(p, m_tile, stream);
}
}  // namespace mla_decode_sm80
