// Work decomposition and launch order of the SM90 fused attention backward's main kernel (family
// fmha_bwd_sm90): what one CTA does (CtaWork, on the device) and how many (kv head, batch) pairs one launch
// group takes (pair_group, on the host). fmha_bwd_sm90_kernel.cuh describes the whole.
#pragma once

#include "fmha_bwd_sm90_common.cuh"

namespace fmha_bwd_sm90 {

using namespace cute;

// ------------------------------------------------------------------------------------------------
// What one CTA of the main kernel does (uniform over the CTA).
struct CtaWork {
  Seq sq;
  int n_block, hkv, b;
  int m_min, n_m;    // M-blocks [m_min, m_min + n_m) of every query head of the group
  int group, off;    // query heads per kv head; causal diagonal offset (Sk - Sq bottom-right, else 0)
  int total_iters;   // group * n_m

  // The first M-block whose steps need no mask; the steps of [m_min, first) need it. All steps of a
  // K/V block that crosses seq_k do; under a causal mask the M-blocks holding a query that some key
  // of the block must not see (key - off > query). Rows past seq_q need none (lse_log2 = +inf).
  template <int BM, int BN>
  __device__ __forceinline__ int first_unmasked_m(bool causal) const {
    const int end = m_min + n_m;
    if ((n_block + 1) * BN > sq.seqlen_k) return end;
    if (!causal) return m_min;
    const int x = (n_block + 1) * BN - 1 - off;  // query q needs no mask iff q >= x
    const int m = x <= 0 ? 0 : (x + BM - 1) / BM;
    return m < m_min ? m_min : (m > end ? end : m);
  }
};

// The (K/V block, kv head, batch) of this CTA in the launch order of p.pair_group; false for a CTA of the compact
// varlen grid (p.kv_slots) past the last block that holds keys. Warp-collective there (all 32 lanes, converged):
// every warp that calls it scans cu_seqlens_k on its own. In deterministic mode block n waits for block n-1's dQ
// adds of the same pair: every grouping dispatches n-1 first.
template <int BN>
__device__ __forceinline__ bool cta_coords(const FmhaBwdSm90Params& p, int& n_block, int& hkv, int& b) {
  const int lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const mla_sm90::GroupedTile t = mla_sm90::grouped_tile(lin, gridDim.y * gridDim.z, gridDim.x, p.pair_group);
  if (p.kv_slots > 0) {  // grid (kv_slots, Hkv, 1): the pairs are the kv heads, the ranks the numbered K/V blocks
    mla_sm90::VarlenNumbering<BN, true> numbering;
    const mla_sm90::VarlenNumber v = numbering.find(p, t.rank, 1);
    n_block = v.r;
    hkv = t.pair;
    b = v.b;
    return v.b >= 0;
  }
  n_block = t.rank;
  hkv = t.pair % gridDim.y;
  b = t.pair / gridDim.y;
  return true;
}

// The CtaWork of this CTA. Called by each warpgroup role after its setmaxnreg, so that the values
// are computed where they are used instead of living across the warpgroup split (held there, they
// spilled under the producer's 24 registers).
template <int BM, int BN>
__device__ __forceinline__ CtaWork make_cta_work(const FmhaBwdSm90Params& p, int n_block, int hkv, int b) {
  CtaWork w;
  w.sq = get_seq<BM>(p, b);
  w.n_block = n_block; w.hkv = hkv; w.b = b;
  const mla_sm90::MaskInfo mask(w.sq.seqlen_q, w.sq.seqlen_k, p.causal, p.bottom_right);  // the forward's geometry
  w.off = mask.diag;
  int m_max;
  mask.m_block_range<BM, BN>(n_block, w.m_min, m_max);
  w.n_m = m_max > w.m_min ? m_max - w.m_min : 0;
  w.group = p.hq / p.hkv;
  w.total_iters = w.group * w.n_m;
  return w;
}

// ------------------------------------------------------------------------------------------------
// (kv head, batch) pairs per launch group of the main kernel (FmhaBwdSm90Params::pair_group).
// - Not causal: every CTA does the same work; one pair after another keeps that pair's Q/dO and dQ
//   accumulator hot in L2 while its K/V blocks run.
// - Causal, deterministic: every pair interleaved, so block n-1 (whose dQ adds block n waits for) runs
//   a whole round earlier: on the H200 that took 192/128 from 226 to 305 TF/s and 128/128 from 279 to 438.
// - Causal: work falls with the K/V block index. One pair after another starts each pair's longest CTA
//   last, so the grid's last wave is uneven; every pair interleaved streams all heads' Q/dO at once. In
//   between: groups of pairs whose Q, dO and fp32 dQ accumulator fit in a share of the L2, longest block
//   first inside a group; a power of two, so that groups divide the usual head counts (a small last group
//   brings the uneven tail back). H200, B=2 H=16 S=8192, kernel TF/s (one run; cuDNN moved 453-473 / 514-538
//   between the processes): pairs per group 1 / 2 / 3 / 4 / 6 / all:
//   192/128 443 / 456 / 455 / 457 / 450 / 419; 128/128 528 / 541 / 542 / 556 / 531 / 526.
// `forced` (FmhaBwdSm90Options::pair_group, from bwd_with_options) overrides it: N pairs per group, 0 all
// pairs interleaved; negative: this choice, for a device with l2_bytes of L2.
// On the compact varlen grid (p.kv_slots) the pairs are the kv heads alone.
inline int pair_group(const FmhaBwdSm90Params& p, int forced, int l2_bytes) {
  const int pairs = p.kv_slots > 0 ? p.hkv : p.hkv * p.batch;
  if (forced == 0) return pairs;
  if (forced > 0) return forced < pairs ? forced : pairs;
  if (!p.causal) return 1;
  if (p.deterministic) return pairs;
  const double per_pair = double(p.seqlen_q) * (p.hq / p.hkv) *
                          ((p.head_dim_qk + p.head_dim_v) * 2.0 + p.head_dim_qk * 4.0);
  const double fit = per_pair > 0 ? kFmhaBwdSm90L2GroupShare * l2_bytes / per_pair : pairs;
  int g = 1;
  while (2 * g <= fit && 2 * g <= pairs) g *= 2;
  return g;
}

// The size of a compact varlen grid over `rows` packed rows in blocks of `block` (FmhaBwdSm90Params::kv_slots,
// q_slots): (rows + batch * (block - 1)) / block, the most blocks that sequences which do not overlap can hold
// (valid cu_seqlens never overlap; for overlapping ones, which the documentation leaves racing, the blocks past
// that count are not run). 0, the grid over max_seqlen x batch, for dense problems, when not `allowed`, and
// where that grid is not larger.
inline int compact_slots(bool varlen, bool allowed, int rows, int max_len, int batch, int block) {
  if (!varlen || !allowed) return 0;
  const int64_t slots = (int64_t(rows) + int64_t(batch) * (block - 1)) / block;
  const int64_t full = int64_t((max_len + block - 1) / block) * batch;
  return slots < full ? int(slots) : 0;
}

// The launcher's fields of p for a kernel of tiles BM x BN (kv_slots, q_slots, pair_group, and seq_order kept
// only for a compact main grid). The main kernel keeps the grid over max_seqlen x batch in deterministic mode,
// whose ordered dQ adds want block n-1 of every sequence a whole round of the grid ahead of block n (every pair
// interleaved, pair_group).
template <int BM, int BN>
inline void plan_launch(FmhaBwdSm90Params& p, const FmhaBwdSm90Options& opt, int l2_bytes) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  p.q_slots = compact_slots(varlen, opt.compact_varlen, p.rows_q, p.seqlen_q, p.batch, BM);
  p.kv_slots = compact_slots(varlen, opt.compact_varlen && !p.deterministic, p.rows_k, p.seqlen_k, p.batch, BN);
  p.pair_group = pair_group(p, opt.pair_group, l2_bytes);
  p.dq_wg_barriers = opt.dq_wg_barriers;
  // The order matters to the main kernel's compact grid alone (where the grid is over max_seqlen x batch, every
  // sequence's blocks are launched in place): without one, no order kernel runs and every grid keeps cu_seqlens order.
  if (p.kv_slots == 0) p.seq_order = nullptr;
}

}  // namespace fmha_bwd_sm90
