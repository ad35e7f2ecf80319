// Tile constants of the Hopper MLA decode kernel (wgmma + TMA, sm_90a), which serves the 64-row tiles of the
// mla_decode_sm80 family's calls on compute capability 9.0 (mla_decode_sm90_kernel.cuh).
#pragma once

namespace mla_decode_sm90 {

struct DecodeSm90Config {
  static constexpr int kBlockM = 64;       // (token, head) rows per CTA: one wgmma M
  static constexpr int kBlockN = 64;       // cache tokens per block: the N of S = Q K^T, the K of O += P V
  static constexpr int kStages = 2;        // KV tiles in flight (Q 72 KB + 2 x 72 KB + P 8 KB: the opt-in smem)
  static constexpr int kTileParts = 2;     // a stage's 9 column groups land on this many barriers, in order; the QK
                                           // issues each part's k-steps as it lands (part p: groups
                                           // [9p / kTileParts, 9(p + 1) / kTileParts))
  static constexpr int kHalfV = 256;       // output columns per PV warpgroup (64 x 256 fp32: 128 registers)
  static constexpr int kThreads = 384;     // loader warpgroup + S warpgroup + V warpgroup
  static constexpr int kLoaderRegs = 40;   // setmaxnreg: 40 + 2 x 232 <= 512 per thread slot
  static constexpr int kConsumerRegs = 232;
  static constexpr int kMaxBoxRows = 32;   // TMA box rows: splits start on 32-token boundaries, so a box of
                                           // min(page, 32) rows never crosses a page
  static constexpr int kMinPageSize = 8;   // smaller pages would take 64 / page boxes per column group per block
  static constexpr float kRescaleLog2 = 8.f;  // a row's softmax reference moves by more than this or not at all
};

// Dynamic shared memory of the kernel (bytes), for the host's launch decision.
int sm90_smem_bytes();

}  // namespace mla_decode_sm90
