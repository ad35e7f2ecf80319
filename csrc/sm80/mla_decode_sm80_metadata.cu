// Split-KV scheduling metadata computed on the device (no host sync, CUDA-graph capturable), plus the
// host-side dispatch of the main kernel.
//
// Work of request b: x_b = ceil(L_b / kBlockN) tiles. Budget per part T = max(ceil(sum x_b / num_parts),
// min_tiles). Request b gets s_b = clamp(round(x_b / T), 1, max(x_b, 1)) splits (sum s_b <= num_parts + B =
// num_items, so the grid is fixed by shapes), split j covering tiles [j x_b / s_b, (j+1) x_b / s_b).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "sm80/mla_decode_sm80_config.h"
#include "sm80/mla_decode_sm80_launch.h"
#include "sm80/mla_decode_sm80_params.h"

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

  allow_dependent_launch();  // the main kernel's CTAs may take their SMs now and wait for this schedule
  const int tid = threadIdx.x;
  const int per = (p.B + kMetaThreads - 1) / kMetaThreads;
  const int b0 = tid * per, b1 = min(p.B, b0 + per);

  long long w = 0;
  for (int b = b0; b < b1; ++b) w += (max(p.seqlens[b], 0) + kBlockN - 1) / kBlockN;
  const long long total = Reduce(tmp.reduce).Sum(w);
  if (tid == 0) {
    long long t = (total + p.num_parts - 1) / p.num_parts;
    s_budget = t < p.min_tiles ? p.min_tiles : t;
  }
  __syncthreads();
  const long long T = s_budget;

  auto splits_of = [&](int x) -> int {
    int s;
    if (p.force_splits > 0) s = p.force_splits;
    else s = int((x + T / 2) / T);
    s = min(s, max(x, 1));
    return max(s, 1);
  };
  int my = 0;
  for (int b = b0; b < b1; ++b) my += splits_of((max(p.seqlens[b], 0) + kBlockN - 1) / kBlockN);
  int base = 0, used = 0;
  Scan(tmp.scan).ExclusiveSum(my, base, used);

  for (int b = b0; b < b1; ++b) {
    const int L = max(p.seqlens[b], 0);
    const int x = (L + kBlockN - 1) / kBlockN;
    const int s = splits_of(x);
    p.sched_reqs[b * 2 + 0] = base;
    p.sched_reqs[b * 2 + 1] = s;
    // split j covers tiles [floor(j x / s), floor((j+1) x / s)): the floor is carried as quotient q plus a
    // running remainder, so the loop has no division (one thread writes all of a request's splits: with two
    // 64-bit divisions per split the kernel took 9 us for 4 requests of 32 splits on the H200, now 4 us)
    const int q = x / s, r = x % s;
    int tb = 0, rem = 0;
    for (int j = 0; j < s; ++j) {
      const int it = base + j;
      if (it >= p.num_items) break;  // cannot happen when num_items is sized as documented
      int te = tb + q;
      rem += r;
      if (rem >= s) { rem -= s; ++te; }
      p.sched_items[it * 4 + 0] = b;
      p.sched_items[it * 4 + 1] = j;
      p.sched_items[it * 4 + 2] = tb * kBlockN;
      p.sched_items[it * 4 + 3] = min(te * kBlockN, L);
      tb = te;
    }
    base += s;
  }
  for (int it = used + tid; it < p.num_items; it += kMetaThreads) {
    p.sched_items[it * 4 + 0] = -1;
    p.sched_items[it * 4 + 1] = 0;
    p.sched_items[it * 4 + 2] = 0;
    p.sched_items[it * 4 + 3] = 0;
  }
}

void launch_metadata(const DecodeParams& p, cudaStream_t stream) {
  mla_decode_metadata_kernel<<<1, kMetaThreads, 0, stream>>>(p);
}

void launch_decode_bf16(const DecodeParams& p, int m_tile, cudaStream_t stream);
void launch_decode_fp16(const DecodeParams& p, int m_tile, cudaStream_t stream);

void launch_decode(const DecodeParams& p, int m_tile, bool is_bf16, cudaStream_t stream) {
  if (is_bf16) launch_decode_bf16(p, m_tile, stream);
  else launch_decode_fp16(p, m_tile, stream);
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

int wide_stages_for(int smem_optin) {
  using Cfg = TileConfig<64, false, 2 * kBlockN>;
  int best = 0;
  for (int st = kMinStages; st <= Cfg::kMaxStagesT; ++st)
    if (Cfg::smem_bytes(st) <= smem_optin) best = st;
  return best;
}

int ws_max_stages_for(int m_tile, int smem_optin) {
  return most_stages_that_fit(WsTileConfig<16>::kMinStages, smem_optin, [&](int s) {
    return m_tile <= 16 ? WsTileConfig<16>::smem_bytes(s) : WsTileConfig<32>::smem_bytes(s);
  });
}

}  // namespace mla_decode_sm80
