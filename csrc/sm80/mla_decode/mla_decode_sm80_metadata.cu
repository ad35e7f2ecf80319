// Split-KV scheduling metadata computed on the device (no host sync, CUDA-graph capturable), plus the
// host-side dispatch of the main kernel and the stamp buffer of profiling builds (mla_decode_sm80_stamps.h).
// The split rule is in mla_decode_sm80_schedule.h.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "sm80/mla_decode/mla_decode_sm80_config.h"
#include "sm80/mla_decode/mla_decode_sm80_launch.h"
#include "sm80/mla_decode/mla_decode_sm80_params.h"
#include "sm80/mla_decode/mla_decode_sm80_schedule.h"
#include "sm80/mla_decode/mla_decode_sm80_stamps.h"

namespace mla_decode_sm80 {

constexpr int kMetaThreads = 256;

__global__ void __launch_bounds__(kMetaThreads) mla_decode_metadata_kernel(const DecodeParams p) {
  using Reduce = cub::BlockReduce<long long, kMetaThreads>;
  using Scan = cub::BlockScan<int, kMetaThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ long long s_budget;
  // B <= kMetaThreads: request b's first item and split count, so that the items are written one per thread
  __shared__ int s_base[kMetaThreads], s_splits[kMetaThreads];

  allow_dependent_launch();  // the main kernel's CTAs may take their SMs now and wait for this schedule
  // (PDL) before any read or write: the lengths may come from the previous kernel, and that kernel may still
  // read the memory this schedule is written to
  grid_dependency_wait();
  const int tid = threadIdx.x;
  const int per = (p.batch + kMetaThreads - 1) / kMetaThreads;
  const int b0 = tid * per, b1 = min(p.batch, b0 + per);

  long long w = 0;
  for (int b = b0; b < b1; ++b) w += tiles_of(request_len(p, b));
  const long long total = Reduce(tmp.reduce).Sum(w);
  if (tid == 0) s_budget = split_budget(total, p.num_parts, p.min_tiles);
  __syncthreads();
  const long long T = s_budget;

  int my = 0;
  for (int b = b0; b < b1; ++b) my += splits_of(tiles_of(request_len(p, b)), T, p.force_splits, false);
  int base = 0, used = 0;
  Scan(tmp.scan).ExclusiveSum(my, base, used);
  const bool down = splits_round_down(used, p.num_parts, p.batch, p.force_splits);  // uniform: used is the block's sum
  if (down) {
    my = 0;
    for (int b = b0; b < b1; ++b) my += splits_of(tiles_of(request_len(p, b)), T, 0, true);
    __syncthreads();  // the first scan's temporary storage is free
    Scan(tmp.scan).ExclusiveSum(my, base, used);
  }

  auto write_item = [&](int it, int b, int j, int tb, int te, int L) {
    p.sched_items[it * 4 + 0] = b;
    p.sched_items[it * 4 + 1] = j;
    p.sched_items[it * 4 + 2] = tb * kBlockN;
    p.sched_items[it * 4 + 3] = min(te * kBlockN, L);
  };
  if (p.batch <= kMetaThreads) {
    // One request per thread; then one item per thread, its request found by binary search over the first
    // items (a thread writing all splits of its request took 1.2 us more for B=4 x 32 splits on the H200).
    if (tid < p.batch) {
      s_base[tid] = base;
      s_splits[tid] = my;
      p.sched_reqs[tid * 2 + 0] = base;
      p.sched_reqs[tid * 2 + 1] = my;
    }
    __syncthreads();
    for (int it = tid; it < used && it < p.num_items; it += kMetaThreads) {
      int lo = 0, hi = p.batch - 1;  // the last b with s_base[b] <= it (every request has >= 1 split)
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_base[mid] <= it) lo = mid;
        else hi = mid - 1;
      }
      const int b = lo, j = it - s_base[b], sp = s_splits[b];
      const int L = request_len(p, b), x = tiles_of(L);
      write_item(it, b, j, split_first_tile(j, x, sp), split_first_tile(j + 1, x, sp), L);
    }
  } else {  // several requests per thread, each writing its requests' items
    for (int b = b0; b < b1; ++b) {
      const int L = request_len(p, b);
      const int x = tiles_of(L);
      const int s = splits_of(x, T, p.force_splits, down);
      p.sched_reqs[b * 2 + 0] = base;
      p.sched_reqs[b * 2 + 1] = s;
      // the floors are carried as quotient q plus a running remainder, so the loop has no division (with two
      // 64-bit divisions per split, one thread writing 32 splits had taken 9 us on the H200)
      const int q = x / s, r = x % s;
      int tb = 0, rem = 0;
      for (int j = 0; j < s; ++j) {
        const int it = base + j;
        if (it >= p.num_items) break;  // cannot happen when num_items is sized as documented
        int te = tb + q;
        rem += r;
        if (rem >= s) { rem -= s; ++te; }
        write_item(it, b, j, tb, te, L);
        tb = te;
      }
      base += s;
    }
  }
  for (int it = used + tid; it < p.num_items; it += kMetaThreads) {
    p.sched_items[it * 4 + 0] = -1;
    p.sched_items[it * 4 + 1] = 0;
    p.sched_items[it * 4 + 2] = 0;
    p.sched_items[it * 4 + 3] = 0;
  }
}

// A programmatic dependent (p.pdl) like the main and merge kernels: launched plainly after a kernel it starts
// about 2 us after that kernel's end on the H200, as a dependent at once.
cudaError_t launch_metadata(const DecodeParams& p, cudaStream_t stream) {
  return launch_dependent(mla_decode_metadata_kernel, dim3(1), kMetaThreads, 0, stream, p);
}

#if defined(MLA_DECODE_STAMPS)
// One buffer per process, grown as needed and never freed (a profiling build; calls on one stream at a time).
// After a failed CUDA call there are no stamps (read_stamps() returns an empty tensor) until a call succeeds.
static unsigned long long* g_stamps = nullptr;
static long long g_stamps_cap = 0, g_stamps_ctas = 0;
static cudaError_t stamps_buffer(long long ctas, cudaStream_t stream) {
  const size_t bytes = size_t(ctas) * kStampSlots * sizeof(unsigned long long);
  if (ctas > g_stamps_cap) {
    if (g_stamps != nullptr) {
      const cudaError_t e = cudaFree(g_stamps);
      g_stamps = nullptr;
      g_stamps_cap = 0;
      MLA_CUDA_TRY(e);
    }
    if (const cudaError_t e = cudaMalloc(&g_stamps, bytes); e != cudaSuccess) {
      g_stamps = nullptr;
      return e;
    }
    g_stamps_cap = ctas;
  }
  return cudaMemsetAsync(g_stamps, 0, bytes, stream);
}
cudaError_t stamps_for_launch(long long ctas, cudaStream_t stream, unsigned long long** stamps) {
  g_stamps_ctas = 0;
  *stamps = nullptr;
  MLA_CUDA_TRY(stamps_buffer(ctas, stream));
  g_stamps_ctas = ctas;
  *stamps = g_stamps;
  return cudaSuccess;
}
unsigned long long* stamps_last(long long* ctas) {
  *ctas = g_stamps ? g_stamps_ctas : 0;
  return g_stamps;
}
#else
cudaError_t stamps_for_launch(long long, cudaStream_t, unsigned long long** stamps) {
  *stamps = nullptr;
  return cudaSuccess;
}
unsigned long long* stamps_last(long long* ctas) { *ctas = 0; return nullptr; }
#endif

// Whether this module was built with -DMLA_DECODE_QK_MBAR (mla_decode_sm80_ws_kernel.cuh: the warp-specialized
// kernel's QK warps sync on an mbarrier, for compute-sanitizer racecheck).
bool qk_mbar_build() {
#if defined(MLA_DECODE_QK_MBAR)
  return true;
#else
  return false;
#endif
}

cudaError_t launch_decode_bf16(const DecodeParams& p, int m_tile, cudaStream_t stream);
cudaError_t launch_decode_fp16(const DecodeParams& p, int m_tile, cudaStream_t stream);

cudaError_t launch_decode(const DecodeParams& p, int m_tile, bool is_bf16, cudaStream_t stream) {
  return is_bf16 ? launch_decode_bf16(p, m_tile, stream) : launch_decode_fp16(p, m_tile, stream);
}

int smem_bytes_for(int m_tile, int stages) {
  switch (m_tile) {
    case 16: return TileConfig<16>::smem_bytes(stages);
    case 32: return TileConfig<32>::smem_bytes(stages);
    default: return TileConfig<64>::smem_bytes(stages);
  }
}

// The most stages in [min_stages, kMaxStages] whose shared memory (bytes(stages)) fits smem_optin; 0 if none.
template <class Bytes>
static int most_stages_that_fit(int min_stages, int smem_optin, Bytes bytes) {
  int best = 0;
  for (int s = min_stages; s <= kMaxStages; ++s)
    if (bytes(s) <= smem_optin) best = s;
  return best;
}

int max_stages_for(int m_tile, int smem_optin) {
  return most_stages_that_fit(kMinStages, smem_optin, [&](int s) { return smem_bytes_for(m_tile, s); });
}

int ws_max_stages_for(int m_tile, int smem_optin) {
  return most_stages_that_fit(WsTileConfig<16>::kMinStages, smem_optin, [&](int s) {
    return m_tile <= 16 ? WsTileConfig<16>::smem_bytes(s) : WsTileConfig<32>::smem_bytes(s);
  });
}

}  // namespace mla_decode_sm80
