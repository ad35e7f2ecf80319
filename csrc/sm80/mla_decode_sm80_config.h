// Tile constants of the weight-absorbed MLA decode kernel (mma.sync / cp.async / ldmatrix; sm_80, sm_90).
#pragma once

namespace mla_decode_sm80 {

constexpr int kDimCkv = 512;               // latent (compressed KV) dim = V dim
constexpr int kDimKpe = 64;                // rope dim
constexpr int kDimQK = kDimCkv + kDimKpe;  // 576
constexpr int kThreads = 256;              // 8 warps per CTA
constexpr int kWarps = kThreads / 32;
constexpr int kBlockN = 32;                // KV tokens per pipeline stage
// Largest batch whose main-kernel CTAs derive their split-KV items inline, with no metadata kernel (a warp of
// each CTA reads all B lengths; mla_decode_sm80_schedule.h).
constexpr int kInlineScheduleMaxBatch = 256;
// Static shared memory of every main kernel (work_item's 16-byte inline-schedule slot, which the 128-byte
// alignment of the dynamic region rounds up; ptxas -v): the host subtracts it from the per-block budget.
constexpr int kStaticSmemBytes = 128;
constexpr int kMinStages = 2;
constexpr int kMaxStages = 5;              // cp.async stages (chosen at run time by the smem the device offers)
constexpr int kPageRing = 2 * kMaxStages;  // tiles of page ids staged in smem ahead of the loads
constexpr int kRowBytes = kDimQK * 2;      // 1152 B per smem row (Q and KV), 9 x 128 B, XOR-swizzled
constexpr int kPStride = kBlockN + 8;      // P row stride (elements), padded: conflict-free ldmatrix
constexpr float kRescaleLog2 = 8.f;        // wide kernel: the softmax reference max moves by more than this or not at all

// Rows (token, head) per CTA: 16, 32 or 64 (M = Sq * H rounded up to 16, capped at 64); BN KV tokens per
// step of the main loop (kBlockN, or 2 x kBlockN for the wide 64-row tile below).
// NARROW (64-row tiles): four warps compute S (16 x 32 each, no cross-warp row-max exchange needed for
// the columns) while the other four issue the next tiles' cp.async; otherwise all warps compute S.
// Wide (64-row tiles, BN = 64): all eight warps compute S over two 32-token tiles at once (kWC = 2 column
// groups of 32 tokens; the kernel's KSPLIT computes them as 32 x 32 tiles over half the contraction each, else
// as the NARROW 16 x 32 warp tile); half the barriers per token and twice the warps in the QK phase, which the
// NARROW layout spends with four warps idle. Two stages of 64
// tokens (one step in flight) fit the H200's 227 KB beside Q; the page-id ring is 4 steps and the row-sum
// exchange reuses the row-max buffer.
template <int M_TILE, bool NARROW = false, int BN = kBlockN>
struct TileConfig {
  static_assert(M_TILE == 16 || M_TILE == 32 || M_TILE == 64, "M_TILE must be 16, 32 or 64");
  static_assert(BN == kBlockN || (BN == 2 * kBlockN && M_TILE == 64 && !NARROW), "BN = 64 only for the wide 64-row tile");
  static constexpr bool kWide = BN != kBlockN;
  static constexpr int kMTiles = M_TILE / 16;                       // 16-row mma tiles in the PV phase
  static constexpr int kWR = M_TILE / 16;                           // QK warp grid: rows
  static constexpr int kWC = NARROW ? 1 : ((kWarps / kWR) < (BN / 8) ? (kWarps / kWR) : (BN / 8));  // QK warp grid: cols
  static constexpr int kQKWarps = kWR * kWC;                        // warps that compute S (the rest wait)
  static constexpr int kQKCols = BN / kWC;                          // tokens per QK warp
  static constexpr int kQKNTiles = kQKCols / 8;
  static constexpr int kPVCols = kDimCkv / kWarps;                  // 64 output dims per warp
  static constexpr int kPVNTiles = kPVCols / 8;
  static constexpr int kPStride = BN + 8;                           // P row stride (elements): conflict-free ldmatrix
  // Tiles of page ids in the smem ring: at least 2 * stages (the loads run 2 * stages - 2 tiles ahead).
  static constexpr int kRing = kWide ? 4 : kPageRing;
  static constexpr int kMaxStagesT = kRing / 2;
  static constexpr int kRedBufs = kWide ? 1 : 2;                    // row max and row sum: own buffers, or one
  static constexpr int kFixedStages = kWide ? kMaxStagesT : 0;      // > 0: stages known at compile time
  // Register budget: up to 64 rows x 64 fp32 accumulators per warp need one CTA per SM; 16/32-row tiles
  // are compiled for two co-resident CTAs (<= 128 registers) so one CTA's barriers hide behind the other.
  static constexpr int kMinBlocks = M_TILE <= 32 ? 2 : 1;
  static constexpr int kQKAcc = (kQKNTiles == 1 && M_TILE == 16) ? 4 : 2;            // independent accumulator chains per n-tile

  static constexpr int smem_bytes(int stages) {
    return M_TILE * kRowBytes                 // Q
         + stages * BN * kRowBytes            // KV stages
         + M_TILE * kPStride * 2              // P (bf16/fp16)
         + kRedBufs * kWC * M_TILE * 4        // row max / row sum exchange
         + kRing * BN * 4;                    // page-id ring
  }
};

// Wide 64-row tile with two decoupled row groups (mla_decode_groups_kernel, set_tuning wide=3): group r (warps
// 4r..4r+3) owns rows [32 r, 32 r + 32) through QK, softmax and PV; the wide kernel's smem plus four mbarriers.
struct GroupsConfig {
  using Base = TileConfig<64, false, 2 * kBlockN>;  // smem layout of the wide kernel (Q, stages, P, row max, ring)
  static constexpr int kBN = 2 * kBlockN;            // 64 KV tokens per step
  static constexpr int kStages = 2;
  static constexpr int kRing = Base::kRing;          // page ids of 4 tiles
  static constexpr int kGroupWarps = kWarps / 2;     // 4
  static constexpr int kGroupThreads = kGroupWarps * 32;
  static constexpr int kGroupRows = 32;
  static constexpr int kMT = kGroupRows / 16;        // 16-row mma tiles per group in PV
  static constexpr int kPVCols = kDimCkv / kGroupWarps;  // 128 output dims per warp
  static constexpr int kPVN = kPVCols / 8;
  static constexpr int kPStride = Base::kPStride;
  static constexpr int smem_bytes() { return Base::smem_bytes(kStages) + 4 * 8; }  // + full[2], empty[2]
  static_assert(Base::smem_bytes(kStages) % 8 == 0, "mbarriers need 8-byte alignment");
  static_assert(kGroupRows * kPStride * 2 >= 2 * 4 * 32 * 16, "a group's P rows hold its two QK exchange slots");
};

// Warp-specialized variant for 16/32-row tiles (H * Sq <= 32: the memory-bound decode), one CTA per SM.
// Warps 0-3 issue the KV loads and compute S = Q K^T, each over a 144-dim slice of the 576-dim contraction
// with its Q fragments held in registers (K read from smem once per tile, Q never), then the online
// softmax; warps 4-7 compute O += P V on 128 output dims each. P is double-buffered, so QK/softmax of
// tile j+1 overlaps PV of tile j. S stages keep S-1 tiles in flight beside the one being computed.
template <int M_TILE>
struct WsTileConfig {
  static_assert(M_TILE == 16 || M_TILE == 32, "the warp-specialized kernel takes 16- or 32-row tiles");
  static constexpr int kMTiles = M_TILE / 16;
  static constexpr int kQKWarps = 4;                   // loads, S = Q K^T, softmax
  static constexpr int kPVWarps = kWarps - kQKWarps;   // O += P V
  static constexpr int kQKThreads = kQKWarps * 32;
  static constexpr int kKSlice = kDimQK / kQKWarps;    // 144 contraction dims per QK warp
  static constexpr int kKSteps = kKSlice / 16;         // 9 mma k-steps
  static constexpr int kSStride = kBlockN + 8;         // fp32 partial-S row stride: conflict-free float2 stores
  static constexpr int kTPR = kQKThreads / M_TILE;     // softmax threads per row: 8 or 4
  static constexpr int kEPT = kBlockN / kTPR;          // softmax elements per thread: 4 or 8
  static constexpr int kPVCols = kDimCkv / kPVWarps;   // 128 output dims per PV warp
  static constexpr int kPVNTiles = kPVCols / 8;
  static constexpr int kMinStages = 3;                 // two tiles in flight (1 would expose the full latency)
  static_assert(kKSlice % 16 == 0 && kEPT % 4 == 0, "tile shape");

  static constexpr int smem_bytes(int stages) {
    return stages * kBlockN * kRowBytes               // KV stages
         + kQKWarps * M_TILE * kSStride * 4           // partial S of each QK warp
         + 2 * M_TILE * kPStride * 2                  // P, double-buffered (16-bit)
         + 3 * kQKThreads * 4                         // alpha (2 buffers) and 1/l, a slot per softmax thread
         + kPageRing * kBlockN * 4                    // page-id ring
         + 8;                                         // the QK warps' mbarrier (8-byte aligned: every term is)
  }
};

}  // namespace mla_decode_sm80
