// Parameters of the MLA decode kernels; every pointer's shape and strides are spelled out.
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

namespace mla_decode_sm80 {

struct DecodeParams {
  // q_nope (B, Sq, H, 512), q_pe (B, Sq, H, 64); strides in elements, last-dim stride 1.
  const void* q_nope;
  const void* q_pe;
  int64_t qn_batch_stride, qn_row_stride, qn_head_stride;
  int64_t qp_batch_stride, qp_row_stride, qp_head_stride;
  // ckv_cache (P, page_size, 512), kpe_cache (P, page_size, 64); may be views of one (P, page_size, 576).
  const void* ckv;
  const void* kpe;
  int64_t ckv_page_stride, ckv_row_stride;
  int64_t kpe_page_stride, kpe_row_stride;
  // block_table int32 (B, max_pages) with row stride bt_batch_stride; cache_seqlens int32 (B).
  // The kernels are memory-safe for any values in these two tensors: a length is clamped to [0, kv_capacity]
  // (request_len, schedule.h) and a page id outside [0, num_pages) reads as a page of zeros (page_in_cache,
  // kernel.cuh), so no address outside block_table's rows or the caches is formed.
  const int* block_table;
  int64_t bt_batch_stride;
  int max_pages;
  int num_pages;     // pages in the caches (ckv_cache.size(0))
  int kv_capacity;   // min(max_pages * page_size, INT_MAX); INT_MAX in decode_schedule, which has no block_table
  const int* seqlens;
  // out (B, Sq, H, 512) dtype of q; lse (B, H, Sq) fp32 (strides in elements).
  void* out;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  float* lse;
  int64_t lse_batch_stride, lse_head_stride;
  // Split-KV workspace: ws_o (num_items, Sq*H, 512) fp32 normalised partial outputs; ws_lse (num_items, Sq*H)
  // fp32 partial LSE in base 2. sched: scheduling metadata written on the device by the metadata kernel:
  //   items[num_items][4] = (request b or -1, split index, kv_begin, kv_end)
  //   reqs[B][2]          = (first item of request b, number of splits of request b)
  float* ws_o;
  float* ws_lse;
  int* sched_items;
  int* sched_reqs;
  int num_items;     // grid.y of the main kernel = B + num_parts (sized from shapes only)
  int num_parts;     // target number of CTAs per m-block (SM count / m-blocks)
  int min_tiles;     // a split covers at least this many kBlockN-token tiles
  int force_splits;  // > 0: every request with enough tiles gets exactly this many splits (tests)

  int batch, seqlen_q, hq;  // B, Sq, H: requests, new tokens per request, query heads
  int page_size, log2_page;
  int num_mblocks;   // ceil(Sq*H / M_TILE)
  int stages;        // cp.async stages (run time, 2..kMaxStages)
  int ws;            // 1: the warp-specialized kernel (WsTileConfig; 16/32-row tiles, one CTA per SM)
  int groups;        // 1: 64-row tiles run the row-group kernel (GroupsConfig), 0: the all-warps one (TileConfig<64>)
  int wgmma;         // 1: 64-row tiles run the Hopper wgmma + TMA kernel (csrc/sm90/mla_decode; sm_90a, 9.0 only)
  int pdl;           // 1: main and merge kernels launched as programmatic dependents (sm_90+; launch.h)
  float scale_log2;  // softmax_scale * log2(e)
  bool causal;
  // 1: no schedule was given and B <= kInlineScheduleMaxBatch: each main-kernel CTA derives its item from the
  // lengths (work_item) and no metadata kernel runs; the merge kernel derives the split counts the same way.
  // Neither sched_items nor sched_reqs is then read or written.
  int sched_inline;
  // Per-CTA timer stamps (mla_decode_sm80_stamps.h): null unless the module was built with -DMLA_DECODE_STAMPS.
  unsigned long long* stamps;
};

// Host launchers (defined in the .cu files), each returning its launch's cudaError_t (common/cuda_check.h).
cudaError_t launch_metadata(const DecodeParams& p, cudaStream_t stream);
cudaError_t launch_decode(const DecodeParams& p, int m_tile, bool is_bf16, cudaStream_t stream);
cudaError_t launch_combine(const DecodeParams& p, bool is_bf16, int num_sms, cudaStream_t stream);
int max_stages_for(int m_tile, int smem_optin);
int ws_max_stages_for(int m_tile, int smem_optin);  // 0: the warp-specialized kernel does not fit
int smem_bytes_for(int m_tile, int stages);
bool qk_mbar_build();  // the warp-specialized kernel's QK warps sync on an mbarrier (-DMLA_DECODE_QK_MBAR)

}  // namespace mla_decode_sm80
