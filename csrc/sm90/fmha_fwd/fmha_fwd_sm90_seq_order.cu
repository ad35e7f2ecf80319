// The order kernel of the varlen schedules (mla_sm90::seq_order_kernel) behind a plain host function, for the host
// layer's test-only entry seq_order (the launchers call launch_seq_order themselves).
#include "sm90/fmha_fwd/fmha_fwd_sm90_params.h"
#include "sm90/sm90_seq_order.cuh"

cudaError_t fmha_fwd_sm90_seq_order(FmhaProblemParams const& p, cudaStream_t stream) {
  return mla_sm90::launch_seq_order(p, nullptr, stream);
}
