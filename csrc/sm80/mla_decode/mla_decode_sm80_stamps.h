// Per-CTA %globaltimer stamps of the warp-specialized kernel: where a CTA's time goes (PDL wait, split schedule,
// first tile, KV loop, epilogue) and how the CTAs' end times spread. Compiled in only with -DMLA_DECODE_STAMPS on
// the nvcc command line; tools/decode_stamps.py builds such a module in its own cache and prints the phases.
// Without the macro every stamp call below is an empty inline function and p.stamps stays null.
//
// Layout: p.stamps[(item * gridDim.x + m-block) * kStampSlots + slot], nanoseconds (globaltimer), each slot written
// by one thread of the CTA (thread 0, kStampEnd a PV thread); the host zeroes the buffer before each call
// (stamps_for_launch). Only the warp-specialized kernel writes every slot; the others write kStampWaited only.
#pragma once
#include <cuda_runtime.h>

#include "sm80/mla_decode/mla_decode_sm80_params.h"

namespace mla_decode_sm80 {

enum StampSlot : int {
  kStampEntry = 0,   // the CTA's first instruction
  kStampWaited,      // past griddepcontrol.wait (work_item)
  kStampScheduled,   // the CTA's item known (inline schedule or precomputed), after the CTA barrier
  kStampFirstTile,   // the Q tile (and with it KV tile 0's commit group) landed: the KV loop starts
  kStampLoopEnd,     // the QK warps' last tile done
  kStampEnd,         // the PV warps' output stores issued
  kStampId,          // item | smid << 32
  kStampTiles,       // KV tiles of the item (-1: unused item)
  kStampSlots
};

#if defined(__CUDACC__)
#if defined(MLA_DECODE_STAMPS)
__device__ __forceinline__ unsigned long long stamp_clock() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void stamp_value(const DecodeParams& p, int item, StampSlot slot, unsigned long long v) {
  if (p.stamps) p.stamps[(static_cast<size_t>(item) * gridDim.x + blockIdx.x) * kStampSlots + slot] = v;
}
__device__ __forceinline__ void stamp_id(const DecodeParams& p, int item, int n_tiles) {
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  stamp_value(p, item, kStampId, static_cast<unsigned long long>(item) | static_cast<unsigned long long>(smid) << 32);
  stamp_value(p, item, kStampTiles, static_cast<unsigned long long>(static_cast<long long>(n_tiles)));
}
#else
__device__ __forceinline__ unsigned long long stamp_clock() { return 0; }
__device__ __forceinline__ void stamp_value(const DecodeParams&, int, StampSlot, unsigned long long) {}
__device__ __forceinline__ void stamp_id(const DecodeParams&, int, int) {}
#endif
__device__ __forceinline__ void stamp_now(const DecodeParams& p, int item, StampSlot slot) {
  stamp_value(p, item, slot, stamp_clock());
}
#endif  // __CUDACC__

// Host: *stamps = the stamp buffer for a launch of `ctas` CTAs, zeroed on `stream` (null unless built with the
// macro; the error of its allocation or memset is returned), and the last launch's buffer with its CTA count
// (null, 0 if none). Defined in mla_decode_sm80_metadata.cu.
cudaError_t stamps_for_launch(long long ctas, cudaStream_t stream, unsigned long long** stamps);
unsigned long long* stamps_last(long long* ctas);

}  // namespace mla_decode_sm80
