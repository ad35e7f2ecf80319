// Does compute-sanitizer racecheck understand a named barrier that two warp groups reach from different
// code? The decode kernel's warp-specialized hand-off is exactly that, and racecheck flags it. Four
// minimal kernels, one per run, 256 threads: warps 0-3 write shared memory, warps 4-7 read what the
// other group wrote.
//   0 named_split   : writers `bar.sync 3, 256` after the store; readers `bar.sync 3, 256` at another PC
//   1 named_same_pc : both groups pass the same `bar.sync 3, 256` instruction (store before, load after)
//   2 syncthreads   : __syncthreads() instead (control: must be clean)
//   3 no_barrier    : no barrier at all (control: a real race, must be reported)
//   4 ring          : the decode kernel's protocol: 8 hand-offs through a double buffer, one
//                     `bar.sync 3, 256` per hand-off reached from different code by the two groups
//   5 ring_bar1     : as 4, and the writers also sync among themselves (`bar.sync 1, 128`) before each
//                     store, as the decode kernel's QK warps do
//   6 ring_mbar     : as 5 with an mbarrier (arrive + parity wait) for the writers' own sync instead of
//                     `bar.sync 1, 128`: does racecheck keep the ordering then?
// Build and run (tools/gpu_check.sh does this with RACECHECK_PROBE=1):
//   nvcc -arch=sm_90 -lineinfo -o racecheck_probe tools/racecheck_probe.cu
//   for k in 0 1 2 3 4 5 6; do compute-sanitizer --tool racecheck ./racecheck_probe $k; done
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));    \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

__device__ __forceinline__ void bar_sync_3_256() { asm volatile("bar.sync 3, 256;" ::: "memory"); }

__device__ __forceinline__ void bar_sync_1_128() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

// The 128 writers meet at an mbarrier: each arrives, then waits for the phase to complete.
__device__ __forceinline__ void mbar_sync(uint32_t bar, uint32_t& parity) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared.b64 st, [%0];\n}\n" :: "r"(bar) : "memory");
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n mbarrier.test_wait.parity.shared.b64 done, [%0], %1;\n @!done bra WAIT_%=;\n}\n"
      :: "r"(bar), "r"(parity) : "memory");
  parity ^= 1u;
}

__global__ void probe(int mode, int* out) {
  __shared__ int buf[128];
  __shared__ int ring[2][128];
  __shared__ __align__(8) unsigned long long mbar;
  const uint32_t mbar_a = static_cast<uint32_t>(__cvta_generic_to_shared(&mbar));
  if (threadIdx.x == 0) asm volatile("mbarrier.init.shared.b64 [%0], 128;" :: "r"(mbar_a) : "memory");
  __syncthreads();
  uint32_t parity = 0;
  const int tid = threadIdx.x;
  const bool writer = tid < 128;
  int v = -1;
  if (mode == 0) {
    if (writer) {
      buf[tid] = tid * 3 + 1;
      bar_sync_3_256();
    } else {
      bar_sync_3_256();
      v = buf[255 - tid];
    }
  } else if (mode == 1) {
    if (writer) buf[tid] = tid * 3 + 1;
    bar_sync_3_256();
    if (!writer) v = buf[255 - tid];
  } else if (mode == 2) {
    if (writer) buf[tid] = tid * 3 + 1;
    __syncthreads();
    if (!writer) v = buf[255 - tid];
  } else if (mode == 3) {
    if (writer) buf[tid] = tid * 3 + 1;
    if (!writer) v = buf[255 - tid];
  } else {
    // 8 hand-offs; the readers sum what they read, so the expected value is the same as above
    int acc = 0;
    for (int j = 0; j < 8; ++j) {
      if (writer) {
        if (mode == 5) bar_sync_1_128();
        if (mode == 6) mbar_sync(mbar_a, parity);
        ring[j & 1][tid] = (j == 7) ? tid * 3 + 1 : j;
        bar_sync_3_256();
      } else {
        bar_sync_3_256();
        acc += ring[j & 1][255 - tid];
      }
    }
    if (!writer) v = acc - (0 + 1 + 2 + 3 + 4 + 5 + 6);
  }
  if (!writer) out[tid - 128] = v;
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  int* d = nullptr;
  CHECK(cudaMalloc(&d, 128 * sizeof(int)));
  probe<<<1, 256>>>(mode, d);
  CHECK(cudaGetLastError());
  int h[128];
  CHECK(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int i = 0; i < 128; ++i) bad += h[i] != (127 - i) * 3 + 1;
  std::printf("racecheck_probe mode %d: %d wrong values\n", mode, bad);
  CHECK(cudaFree(d));
  return 0;
}
