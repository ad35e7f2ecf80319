// Small helper kernel of the SM100 forward: the launched cu_seqlens (sm100_fmha_cu.h).
#include <cuda_runtime.h>

#include "sm100/fmha/sm100_fmha_cu.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 1000)
#error "mla_autograd: csrc/sm100 sources must be compiled for sm_100a"
#endif
