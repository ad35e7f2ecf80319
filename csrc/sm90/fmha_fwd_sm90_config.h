// Tile configurations of the SM90 forward attention kernel, per (Dqk, Dv).
#pragma once

template <int kDqk, int kDv>
struct FmhaFwdSm90Config;

// 192/128: 128x128 tile, 2 consumer warpgroups (64 rows each), smem Q 48 + K 2x48 + V 2x32 = 208 KiB.
template <>
struct FmhaFwdSm90Config<192, 128> {
  static constexpr int kBlockM = 128, kBlockN = 128, kConsumerWG = 2, kStages = 2;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kSched = 0;  // see FwdTraits; 2 (pingpong) is off for d=192 in FA3/FA4
};

// 128/128: 128x128, 2 consumer WGs, smem Q 32 + K 2x32 + V 2x32 = 160 KiB.
template <>
struct FmhaFwdSm90Config<128, 128> {
  static constexpr int kBlockM = 128, kBlockN = 128, kConsumerWG = 2, kStages = 2;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kSched = 0;  // 2 (pingpong) is FA3's choice here: to be measured
};

// 64/64: 192x128, 3 consumer WGs, smem Q 24 + K 2x16 + V 2x16 = 88 KiB.
template <>
struct FmhaFwdSm90Config<64, 64> {
  static constexpr int kBlockM = 192, kBlockN = 128, kConsumerWG = 3, kStages = 2;
  static constexpr int kProducerRegs = 32, kConsumerRegs = 160;
  static constexpr int kSched = 0;  // 2 (pingpong) is FA3's choice here: to be measured
};
