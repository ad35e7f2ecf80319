// The attention problem that every SM90 fused-attention parameter block starts with (FmhaFwdSm90Params,
// FmhaBwdSm90Params): the inputs q, k, v with their shapes and strides, the packed-batch offsets, the
// scale and the mask. Plain C++: the g++-compiled host layers fill it, the nvcc-compiled kernels read it.
// Strides are in elements; every tensor's last dim has unit stride.
#pragma once

#include <cstdint>

struct FmhaProblemParams {
  // q (B, Sq, Hq, head_dim_qk) dense or (rows_q, Hq, head_dim_qk) varlen; k (.., Hkv, head_dim_qk) and
  // v (.., Hkv, head_dim_v) likewise. Strides per row (sequence position), head and batch; the batch stride
  // is 0 for varlen. 16-byte aligned pointers (TMA).
  void const* q;
  void const* k;
  void const* v;
  int64_t q_row_stride, q_head_stride, q_batch_stride;
  int64_t k_row_stride, k_head_stride, k_batch_stride;
  int64_t v_row_stride, v_head_stride, v_batch_stride;
  // varlen: int32 (B + 1), sequence b is rows [cu[b], cu[b + 1]) as mla_sm90::varlen_rows clamps them;
  // nullptr when dense.
  int const* cu_seqlens_q;
  int const* cu_seqlens_k;
  // varlen: the order in which the kernels' schedules take the sequences, a permutation of [0, batch) written
  // on the stream before them by mla_sm90::launch_seq_order (longest first), or nullptr: cu_seqlens order.
  int* seq_order;

  int batch;                    // number of sequences
  int hq, hkv;                  // query heads, key/value heads (hq % hkv == 0; query head h reads kv head h / (hq / hkv))
  int head_dim_qk, head_dim_v;  // head dims of q/k and of v/out
  int seqlen_q, seqlen_k;       // dense: the lengths; varlen: max_seqlen, a bound on every sequence's length
  int rows_q, rows_k;           // rows of q / k along the sequence dim (dense: Sq / Sk; varlen: the packed rows)

  float softmax_scale;
  bool causal;        // query i sees key j iff j < Sk and (!causal or j <= i + diag) ...
  bool bottom_right;  // ... with diag = Sk - Sq (bottom-right alignment) or 0 (top-left)
  bool is_bf16;       // element type: bfloat16, else float16
};

// The most sequences a packed batch may have for its kernels to take them longest first (FmhaProblemParams::seq_order,
// mla_sm90::seq_order_kernel: one CTA, a thread per sequence); larger batches keep cu_seqlens order.
constexpr int kSeqOrderMaxBatch = 256;
