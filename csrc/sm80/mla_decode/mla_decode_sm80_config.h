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
constexpr float kRescaleLog2 = 8.f;        // row-group kernel: the softmax reference max moves by more than this or not at all

// All-warps kernel (mla_decode_kernel): M_TILE rows (token, head) per CTA, 16, 32 or 64 (M = Sq * H rounded up
// to 16, capped at 64), kBlockN KV tokens per step of the main loop.
// 16/32-row tiles: the QK warp grid covers the tile with 16 x 8 (16 rows) or 16 x 32 (32 rows) warp tiles.
// 64-row tiles: four warps compute S (16 x 32 each, no cross-warp row-max exchange needed for the columns)
// while the other four issue the next tiles' cp.async.
template <int M_TILE>
struct TileConfig {
  static_assert(M_TILE == 16 || M_TILE == 32 || M_TILE == 64, "M_TILE must be 16, 32 or 64");
  static constexpr int kMTiles = M_TILE / 16;                       // 16-row mma tiles in the PV phase
  static constexpr int kWR = M_TILE / 16;                           // QK warp grid: rows
  static constexpr int kWC = M_TILE == 64 ? 1 : ((kWarps / kWR) < (kBlockN / 8) ? (kWarps / kWR) : (kBlockN / 8));  // cols
  static constexpr int kQKWarps = kWR * kWC;                        // warps that compute S (the rest load or wait)
  static constexpr int kQKCols = kBlockN / kWC;                     // tokens per QK warp
  static constexpr int kQKNTiles = kQKCols / 8;
  static constexpr int kPVCols = kDimCkv / kWarps;                  // 64 output dims per warp
  static constexpr int kPVNTiles = kPVCols / 8;
  // Register budget: up to 64 rows x 64 fp32 accumulators per warp need one CTA per SM; 16/32-row tiles
  // are compiled for two co-resident CTAs (<= 128 registers) so one CTA's barriers hide behind the other.
  static constexpr int kMinBlocks = M_TILE <= 32 ? 2 : 1;
  static constexpr int kQKAcc = (kQKNTiles == 1 && M_TILE == 16) ? 4 : 2;            // independent accumulator chains per n-tile

  static constexpr int smem_bytes(int stages) {
    return M_TILE * kRowBytes                 // Q
         + stages * kBlockN * kRowBytes       // KV stages
         + M_TILE * kPStride * 2              // P (bf16/fp16)
         + 2 * kWC * M_TILE * 4               // row max and row sum exchange
         + kPageRing * kBlockN * 4;           // page-id ring
  }
};

// Row-group kernel for 64-row tiles (mla_decode_groups_kernel): 64 KV tokens per step, two stages; group r (warps
// 4r..4r+3) owns rows [32 r, 32 r + 32) through QK, softmax and PV. Its QK warps compute S as 32 x 32 tiles over
// half of the contraction each (two column halves of 32 tokens, whose row maxima and sums meet in smem).
struct GroupsConfig {
  static constexpr int kBN = 2 * kBlockN;            // 64 KV tokens per step
  static constexpr int kStages = 2;
  static constexpr int kRing = 4;                    // page ids of 4 steps (staged two steps ahead of the loads)
  static constexpr int kGroupWarps = kWarps / 2;     // 4
  static constexpr int kGroupThreads = kGroupWarps * 32;
  static constexpr int kGroupRows = 32;
  static constexpr int kMT = kGroupRows / 16;        // 16-row mma tiles per group in PV
  static constexpr int kPVCols = kDimCkv / kGroupWarps;  // 128 output dims per warp
  static constexpr int kPVN = kPVCols / 8;
  static constexpr int kPStride = kBN + 8;           // P row stride (elements), padded: conflict-free ldmatrix
  static constexpr int kBarOffset = 64 * kRowBytes   // Q
                                  + kStages * kBN * kRowBytes  // KV stages
                                  + 64 * kPStride * 2          // P
                                  + 2 * 64 * 4                 // row max, then row sum, of the two column halves
                                  + kRing * kBN * 4;           // page-id ring
  static constexpr int smem_bytes() { return kBarOffset + 4 * 8; }  // + mbarriers full[2], empty[2]
  static_assert(kBarOffset % 8 == 0, "mbarriers need 8-byte alignment");
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
