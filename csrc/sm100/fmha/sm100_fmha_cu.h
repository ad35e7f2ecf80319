// The cu_seqlens the SM100 kernels are launched with, made on the device from the caller's (no host
// synchronisation) by one block of kCuThreads threads, so that CUTLASS example 77's kernels, which take
// cumulative lengths as given, stay inside their tensors for any values:
//
//   c[0] = clamp(cu[0], 0, rows),  c[b] = clamp(cu[b], c[b - 1], rows)   (running maximum, clamped)
//
// so every launched sequence [c[b], c[b + 1]) lies inside the packed tensor and none overlaps another. For
// valid values (non-decreasing, inside [0, rows]) c == cu. The launched arrays are then laid out from c
// (CuLayout). Everything here is plain host/device code: the host api runs the same steps serially
// (sanitize_cu_host) for the CPU tests and the planner; the kernel (sm100_fmha_cu.cuh) runs them with a
// block-wide prefix maximum.
#pragma once

#include <cstdint>

#include "sm100/fmha/sm100_fmha_launch.h"

#if defined(__CUDACC__)
#define MLA_SM100_HD __host__ __device__ __forceinline__
#else
#define MLA_SM100_HD inline
#endif

namespace mla_sm100 {

constexpr int kCuThreads = 1024;

// Launched layout of the sanitised arrays c_q, c_k (B + 1 entries each):
//   kPlain (B + 1 entries): c itself.
//   kPrependEmpty (B + 2): [c[0], c[0], c[1], ..., c[B]]: an empty batch 0 in front, so block (0,0,0) never
//     runs CUTLASS's correction_empty (it prints there).
//   kSplitBottomRight (2B + 2): batch 0 empty; batch 2b+1 = the first skip_b = max(0, len_q - len_k) query
//     rows of sequence b with no keys (the kernel writes O = 0, LSE = -inf for them); batch 2b+2 = the rest
//     with all keys of sequence b, so every launched bottom-right causal problem has len_q <= len_k.
enum class CuLayout : int { kPlain = 0, kPrependEmpty = 1, kSplitBottomRight = 2 };

inline int64_t cu_entries(CuLayout l, int64_t batch) {
  return l == CuLayout::kPlain ? batch + 1 : l == CuLayout::kPrependEmpty ? batch + 2 : 2 * batch + 2;
}

struct CuSanitize {
  const int* cu_q;
  const int* cu_k;  // caller's, batch + 1 entries each
  int batch;
  int rows_q, rows_k;  // packed rows of q and k
  CuLayout layout;
  int* c_q;  // sanitised, batch + 1 entries each (scratch for the layouts other than kPlain)
  int* c_k;
  int* dst_q;  // launched, cu_entries(layout, batch) entries each (== c_q / c_k for kPlain)
  int* dst_k;
};

MLA_SM100_HD int clamp_cu(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }
MLA_SM100_HD int max_i(int a, int b) { return a > b ? a : b; }

// Entries [i0, i1) of thread t of `threads` over n entries.
MLA_SM100_HD void cu_chunk(int t, int threads, int n, int& i0, int& i1) {
  const int per = (n + threads - 1) / threads;
  i0 = t * per < n ? t * per : n;
  i1 = i0 + per < n ? i0 + per : n;
}

// Step 1 (per thread): the maximum of clamp(cu[i], 0, rows) over the chunk (0 if empty).
MLA_SM100_HD int cu_chunk_max(const int* cu, int i0, int i1, int rows) {
  int m = 0;
  for (int i = i0; i < i1; ++i) m = max_i(m, clamp_cu(cu[i], 0, rows));
  return m;
}

// Step 2 (per thread, after the exclusive prefix maximum `lo` of the chunk maxima): c over the chunk.
MLA_SM100_HD void cu_chunk_apply(const int* cu, int i0, int i1, int rows, int lo, int* c) {
  for (int i = i0; i < i1; ++i) {
    lo = clamp_cu(cu[i], lo, rows);
    c[i] = lo;
  }
}

// Step 3 (per thread, after c_q and c_k are complete): the launched entries that sequences [i0, i1) own.
MLA_SM100_HD void cu_chunk_layout(const CuSanitize& p, int i0, int i1) {
  for (int b = i0; b < i1; ++b) {
    const int q0 = p.c_q[b], k0 = p.c_k[b];
    if (p.layout == CuLayout::kPrependEmpty) {
      p.dst_q[b + 1] = q0;
      p.dst_k[b + 1] = k0;
      if (b == 0) { p.dst_q[0] = q0; p.dst_k[0] = k0; }
    } else if (p.layout == CuLayout::kSplitBottomRight) {
      if (b == 0) { p.dst_q[0] = q0; p.dst_k[0] = k0; }
      p.dst_q[2 * b + 1] = q0;
      p.dst_k[2 * b + 1] = k0;
      if (b < p.batch) {
        const int len_q = p.c_q[b + 1] - q0, len_k = p.c_k[b + 1] - k0;
        const int skip = len_q > len_k ? len_q - len_k : 0;
        p.dst_q[2 * b + 2] = q0 + skip;  // rows [q0, q0 + skip) see no key: their own batch with 0 keys
        p.dst_k[2 * b + 2] = k0;
      }
    }
  }
}

// The kernel (sm100_fmha_cu.cuh; defined in each family's aux .cu): one block on `stream`; returns the
// launch's error.
cudaError_t sanitize_cu(CuSanitize const& p, cudaStream_t stream);

// The kernel's steps run serially on the host, thread by thread (same chunks, same prefix maximum).
inline void sanitize_cu_host(const CuSanitize& p) {
  const int n = p.batch + 1;
  const int* cus[2] = {p.cu_q, p.cu_k};
  int* cs[2] = {p.c_q, p.c_k};
  const int rows[2] = {p.rows_q, p.rows_k};
  for (int w = 0; w < 2; ++w) {
    int lo = 0;  // exclusive prefix maximum of the chunk maxima
    for (int t = 0; t < kCuThreads; ++t) {
      int i0, i1;
      cu_chunk(t, kCuThreads, n, i0, i1);
      const int m = cu_chunk_max(cus[w], i0, i1, rows[w]);
      cu_chunk_apply(cus[w], i0, i1, rows[w], lo, cs[w]);
      lo = max_i(lo, m);
    }
  }
  if (p.layout == CuLayout::kPlain) return;
  for (int t = 0; t < kCuThreads; ++t) {
    int i0, i1;
    cu_chunk(t, kCuThreads, n, i0, i1);
    cu_chunk_layout(p, i0, i1);
  }
}

}  // namespace mla_sm100
