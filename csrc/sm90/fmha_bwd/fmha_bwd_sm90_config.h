// Tile constants of the SM90 fused attention backward (family fmha_bwd_sm90).
//
// One CTA owns one K/V block of kBlockN keys of one kv head and loops over the query heads of its
// GQA group and over M-blocks of kBlockM queries. 3 warpgroups: WG0 = producer (one thread issues
// TMA and, in warp 1, adds each M-block's dQ to the fp32 workspace with one bulk reduce), WG1/WG2 =
// consumers. Unswapped (kSwapSdP false): every GEMM is a warpgroup wgmma with both operands in smem;
// the two consumer warpgroups split the N dimension of every GEMM:
//   S   = Q K^T      (BM x BN,  K = D)      dP  = dO V^T     (BM x BN, K = DV)
//   dV^T += dO^T P   (DV x BN, K = BM)      dK^T += Q^T dS   (D x BN,  K = BM)
//   dQ  = dS K       (BM x D,  K = BN)  -> fp32 smem block -> bulk reduce-add, converted by a postprocess
// P and dS go through smem (stored transposed, keys-major); dK/dV live in registers until the end.
//
// kSwapSdP (d <= 128, FlashAttention-3's choice there): S^T = K Q^T and dP^T = V dO^T instead, with
// the consumer warpgroups splitting the keys (M = BN = 2 x 64). P^T and dS^T are then already the
// register A operands of dV = P^T dO and dK = dS^T Q (RS wgmma): P never goes through smem, and only
// dS^T is stored (4-byte stores, two buffers) for dQ = dS K. The per-query lse/dpsum come into smem
// with each Q/dO stage (bulk copies on the same mbarrier). d = 192 keeps the unswapped schedule
// (BN = 112 is not two 64-row atoms).
#pragma once

template <int kHeadDim, int kHeadDimV>
struct FmhaBwdSm90Config;

// BN = 112 (per consumer WG, N = 56 for S/dP/dV^T/dK^T): every K/V block's dQ adds go through the L2 as
// fp32 bulk reduces, so their bytes scale with 1/BN, and at the H200's power cap energy per call sets the
// speed. 112 is the most that fits: dK^T/dV^T take 140 of the consumers' 240 registers and the smem is
// 227 KiB (Q/dO two stages, K, V, P^T, dS^T, the fp32 dQ block). Against BN = 96, H200, B=2 H=16 S=8192:
// main kernel -8% (causal) and -7% (full), per call -6.5% (docs/kernels/fmha_bwd_sm90.md).
template <>
struct FmhaBwdSm90Config<192, 128> {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 112;
  static constexpr int kStages = 2;   // Q/dO pipeline stages
  static constexpr bool kSwapSdP = false;
};

template <>
struct FmhaBwdSm90Config<128, 128> {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;   // 3 (226 KiB at 128/128) measured no faster on the H200
  static constexpr bool kSwapSdP = true;
};

template <>
struct FmhaBwdSm90Config<64, 64> {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;   // 3 measured no faster on the H200
  static constexpr bool kSwapSdP = true;
};

// Every config uses the same M-block for the preprocess/postprocess and the fp32 scratch layout.
constexpr int kFmhaBwdSm90BlockM = 64;

// Causal launch groups (pair_group in fmha_bwd_sm90_scheduler.cuh): the share of the L2 that one group's
// Q, dO and fp32 dQ accumulator may fill.
constexpr double kFmhaBwdSm90L2GroupShare = 0.75;  // H200 (60 MB): 4 pairs at S=8192, d=192 or 128
