// Tile configurations of the SM90 forward attention kernel, per (Dqk, Dv).
#pragma once

template <int kDqk, int kDv>
struct FmhaFwdSm90Config;

// kBlockNNoMask: the key-block width used without a causal mask (a wider block streams K/V fewer
// times per FLOP; under a causal mask the diagonal blocks waste more of a wide block, so kBlockN).

// 192/128: 128x128 tile, 2 consumer warpgroups (64 rows each), smem Q 48 + K 2x48 + V 2x32 + O staging 16
// = 224 KiB.
template <>
struct FmhaFwdSm90Config<192, 128> {
  static constexpr int kBlockM = 128, kBlockN = 128, kConsumerWG = 2, kStages = 2;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kBlockNNoMask = 128;
};

// 128/128: 128x128, 2 consumer WGs, smem Q 32 + K 2x32 + V 2x32 + O staging 16 = 176 KiB.
// Without a causal mask 128x176 (FA3's tile): smem Q 32 + K 2x44 + V 2x44 + O staging 16 = 224 KiB.
template <>
struct FmhaFwdSm90Config<128, 128> {
  static constexpr int kBlockM = 128, kBlockN = 128, kConsumerWG = 2, kStages = 2;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kBlockNNoMask = 176;
};

// 64/64: 192x128, 3 consumer WGs, smem Q 24 + K 2x16 + V 2x16 + O staging 24 = 112 KiB.
template <>
struct FmhaFwdSm90Config<64, 64> {
  static constexpr int kBlockM = 192, kBlockN = 128, kConsumerWG = 3, kStages = 2;
  static constexpr int kProducerRegs = 32, kConsumerRegs = 160;
  static constexpr int kBlockNNoMask = 128;
};
