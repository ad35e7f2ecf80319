// Host api of the SM100 (Blackwell) attention backward: validation, planning (pure host, exposed as
// plan_bwd for CPU tests) and our device-level orchestration around CUTLASS example 77's backward
// main kernels:
//   per batch chunk: prep (ours, fp32 sum(O*dO), -inf LSE rows) -> memset fp32 dQ accumulator ->
//   main kernel (128x128 kernel, or the MLA kernel Q64 x KV128) -> convert (ours, int64 offsets).
//
// bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
//     softmax_scale, causal, bottom_right, deterministic) -> None   (contract: docs/architecture.md)
//
// * Only the variable-length problem shape is compiled; dense (B, S, H, D) tensors are viewed as
//   (B*S, H, D) with cu_seqlens = arange * S (copied first when batch/sequence cannot be merged).
// * Varlen cu_seqlens are sanitised on the device (sm100_fmha_cu.h) and the gradients zeroed first, so
//   any values stay inside the tensors and the workspace (see ws_tail) without a host synchronisation.
// * Workspace sizes in int64 (CUTLASS's get_workspace_size overflows int). The workspace is padded
//   per batch to max_seqlen_q; batches are processed in chunks so that (a) a skewed varlen batch
//   does not allocate B * max_q rows when the tokens are far fewer, and (b) for dense inputs every
//   int32 offset inside the CUTLASS kernel (dK/dV stores, LSE loads) stays below 2^31 (the chunk's
//   base pointers are moved on the host in int64).
// * GQA: the 128x128 kernel sums dK/dV over the query-head group inside the CTA. The MLA kernel
//   needs one query head per kv head: K/V are expanded to the query heads, and dK/dV of the group
//   are summed afterwards.
// * deterministic=True is refused: dQ is accumulated with fp32 TMA reduce-add from all K tiles.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "sm100/fmha/sm100_fmha_host.h"

namespace mla_sm100 {

int bwd_smem_bytes(DType dt, HeadDims hd, Mask m) {
  return pick_variant(dt, hd, bwd_bf16_mla_smem, bwd_bf16_mha_smem, bwd_fp16_mla_smem, bwd_fp16_mha_smem)(m);
}

cudaError_t bwd_launch(BwdLaunch const& p, cudaStream_t stream) {
  return pick_variant(p.dtype, p.head_dims, bwd_bf16_mla, bwd_bf16_mha, bwd_fp16_mla, bwd_fp16_mha)(p, stream);
}

namespace {

struct BwdPlan : ProblemPlan {
  Mask mask_requested;  // the caller's mask (ProblemPlan::mask: the one the kernel is instantiated with, which
                        // differs where an equivalent mask replaces it)
  std::string gqa;    // "none" | "native" | "expand_kv"
  int64_t kern_h_r = 1, kern_h_k = 1;  // heads as the kernel sees them
  bool copy_q = false, copy_k = false, copy_v = false, copy_o = false, copy_do = false;
  bool stage_dq = false, stage_dk = false, stage_dv = false;
  RowHead q, k, v, o, dout, dq, dk, dv;  // strides as launched (after copies / staging / expansion)
  int64_t lse_head = 0, lse_batch = 0;   // lse addressing for prep
  int64_t qp = 0, dp = 0;
  int64_t chunk = 0, num_chunks = 0;
  bool isolate = false;  // dense batches launched one per chunk (see make_plan)
  int64_t ws_tail = 0;  // floats past the end of the lse / sum(O*dO) workspaces (see make_plan)
  int64_t ws_scaled_lse = 0, ws_sum_odo = 0, ws_dq_acc = 0, workspace_bytes = 0, workspace_bytes_unchunked = 0;
  int64_t expand_bytes = 0;
};

// largest element offset touched by a (rows, heads, d) operand with the given strides, plus one
int64_t extent(int64_t rows, int64_t row, int64_t heads, int64_t head, int64_t d) {
  if (rows == 0 || heads == 0) return 0;
  return (rows - 1) * row + (heads - 1) * head + d;
}

BwdPlan make_plan(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
                  const at::Tensor& dv, const c10::optional<at::Tensor>& cu_q, const c10::optional<at::Tensor>& cu_k,
                  const c10::optional<int64_t>& max_seqlen_q, const c10::optional<int64_t>& max_seqlen_k, double softmax_scale, bool causal, bool bottom_right,
                  bool deterministic) {
  BwdPlan P;
  MLA_CHECK(!deterministic,
              "mla_autograd sm100: deterministic=True is not supported by the SM100 backward (dQ is accumulated "
              "with fp32 TMA reduce-add across key tiles, whose order varies run to run)");
  plan_problem(P, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right);
  check_same_dtype(dout, q, "dout");
  check_same_dtype(dq, q, "dq");
  check_same_dtype(dk, q, "dk");
  check_same_dtype(dv, q, "dv");
  const int64_t nd = P.varlen ? 3 : 4;
  using Named = std::pair<const at::Tensor*, const char*>;
  for (auto [t, name] : std::initializer_list<Named>{{&dout, "dout"}, {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}}) {
    MLA_CHECK(t->dim() == nd, "mla_autograd sm100: ", name, " must be ", nd, "-D, got shape ", t->sizes());
  }
  if (P.varlen) {
    check_shape(dout, "dout", {P.total_q, P.Hq, P.dvo});
    check_shape(dq, "dq", {P.total_q, P.Hq, P.dqk});
    check_shape(dk, "dk", {P.total_k, P.Hk, P.dqk});
    check_shape(dv, "dv", {P.total_k, P.Hk, P.dvo});
  } else {
    check_shape(dout, "dout", {P.B, P.Sq, P.Hq, P.dvo});
    check_shape(dq, "dq", {P.B, P.Sq, P.Hq, P.dqk});
    check_shape(dk, "dk", {P.B, P.Sk, P.Hk, P.dqk});
    check_shape(dv, "dv", {P.B, P.Sk, P.Hk, P.dvo});
  }
  // CUTLASS 4.2 example 77's MLA backward (64-row Q tiles, 128-key blocks) applies its top-left diagonal
  // mask only to Q tile j of key block j, but block j's diagonal starts at tile 2j: tiles 2j and 2j+1 go
  // unmasked. Its bottom-right mask is right, and it is the same mask wherever every sequence has as many
  // queries as keys: dense Sq == Sk, or varlen with one cu_seqlens tensor for both (lengths never read here).
  P.mask_requested = P.mask;
  if (P.hd == HeadDims::kMla192x128 && P.mask == Mask::kCausalTopLeft) {
    const bool equal_lengths = P.varlen ? (cu_q->data_ptr() == cu_k->data_ptr() && cu_q->sizes() == cu_k->sizes() &&
                                           cu_q->strides() == cu_k->strides())
                                        : P.Sq == P.Sk;
    MLA_CHECK(equal_lengths, "mla_autograd sm100: causal top-left masking at head dims (192, 128) needs Sq == Sk "
              "(dense) or one cu_seqlens tensor for queries and keys (varlen): the MLA backward kernel's top-left "
              "diagonal mask is wrong otherwise (the dispatch table sends such calls elsewhere)");
    P.mask = Mask::kCausalBottomRight;
  }
  check_operand(dout, "dout");
  check_operand(dq, "dq");
  check_operand(dk, "dk");
  check_operand(dv, "dv");
  if (P.varlen) {
    MLA_CHECK(P.total_q <= 1 || lse.stride(1) == 1, "mla_autograd sm100: lse must have unit stride over tokens");
    P.lse_head = lse.stride(0);
    P.lse_batch = 0;
  } else {
    MLA_CHECK(P.Sq <= 1 || lse.stride(2) == 1, "mla_autograd sm100: lse must have unit stride over seqlen_q");
    P.lse_head = lse.stride(1);
    P.lse_batch = lse.stride(0);
  }

  if (P.empty.empty()) {
    MLA_CHECK(P.max_k > 0, "mla_autograd sm100: max_seqlen_k is 0 but k has ", P.total_k, " rows");
  }

  auto contig = [](RowHead& r, int64_t H, int64_t D, bool& flag) {
    if (!r.merged) {
      flag = true;
      r = RowHead{H * D, D, true};
    }
  };
  P.q = row_head_of(q);     contig(P.q, P.Hq, P.dqk, P.copy_q);
  P.k = row_head_of(k);     contig(P.k, P.Hk, P.dqk, P.copy_k);
  P.v = row_head_of(v);     contig(P.v, P.Hk, P.dvo, P.copy_v);
  P.o = row_head_of(out);   contig(P.o, P.Hq, P.dvo, P.copy_o);
  P.dout = row_head_of(dout); contig(P.dout, P.Hq, P.dvo, P.copy_do);
  P.dq = row_head_of(dq);   contig(P.dq, P.Hq, P.dqk, P.stage_dq);
  P.dk = row_head_of(dk);   contig(P.dk, P.Hk, P.dqk, P.stage_dk);
  P.dv = row_head_of(dv);   contig(P.dv, P.Hk, P.dvo, P.stage_dv);

  // GQA
  if (P.h_r == 1) {
    P.gqa = "none";
    P.kern_h_r = 1;
    P.kern_h_k = P.Hk;
  } else if (P.hd == HeadDims::kMla192x128) {
    P.gqa = "expand_kv";  // K/V expanded to the query heads; dK/dV (Tk, Hq, d) summed over the group after
    P.kern_h_r = 1;
    P.kern_h_k = P.Hq;
    P.k = RowHead{P.Hq * P.dqk, P.dqk, true};
    P.v = RowHead{P.Hq * P.dvo, P.dvo, true};
    P.dk = RowHead{P.Hq * P.dqk, P.dqk, true};
    P.dv = RowHead{P.Hq * P.dvo, P.dvo, true};
    P.expand_bytes = 2 * P.total_k * P.Hq * (P.dqk + P.dvo) * int64_t(q.element_size());
  } else {
    P.gqa = "native";
    P.kern_h_r = P.h_r;
    P.kern_h_k = P.Hk;
  }
  const int64_t KH = P.kern_h_r * P.kern_h_k;  // = Hq
  for (auto* r : {&P.q, &P.k, &P.v, &P.o, &P.dout, &P.dk, &P.dv}) {
    MLA_CHECK(r->row <= kInt32Max && r->head <= kInt32Max, "mla_autograd sm100: strides must be below 2^31");
  }
  // The launcher forms the kv-group strides of q and dO (head stride x query heads per kv head) in int32.
  MLA_CHECK(P.q.head * P.kern_h_r <= kInt32Max && P.dout.head * P.kern_h_r <= kInt32Max,
            "mla_autograd sm100: q / dout head stride x (query heads / kv heads) = ",
            std::max(P.q.head, P.dout.head) * P.kern_h_r, " must be below 2^31 (int32 kv-group stride of the CUTLASS "
            "backward)");
  // TMA row coordinates are int32: cu[b] + row, below the packed rows + one tile.
  MLA_CHECK(P.total_q + 128 <= kInt32Max && P.total_k + 128 <= kInt32Max,
            "mla_autograd sm100: q / k rows + 128 must be below 2^31 (int32 TMA row coordinates of the CUTLASS backward)");

  // workspace: [b][h][qp] scaled lse, [b][h][qp] -sum(O*dO), [b][h][qp][dp] fp32 dQ (int64 sizes)
  P.qp = round_up(P.max_q, 8);
  P.dp = round_up(P.dqk, 8);
  const int64_t per_batch = KH * P.qp * (2 + P.dp) * 4;
  P.workspace_bytes_unchunked = P.B * per_batch;
  MLA_CHECK(P.dp * P.qp * KH <= kInt32Max, "mla_autograd sm100: heads * round8(max_seqlen_q) * round8(d_qk) = ",
              P.dp * P.qp * KH, " must be below 2^31 (int32 batch stride of the CUTLASS dQ accumulator)");
  // The kernel reads a sequence's LSE and sum(O*dO) rows q < len_q from its batch's qp rows of workspace. A
  // varlen sequence longer than max_seqlen_q (a bad value, not checked on the host) reads past them, into
  // the next batches' rows, and for the last batch of a chunk at most total_q floats past the end: both
  // workspaces are allocated that much longer, and their int32 offsets are bounded with it.
  P.ws_tail = P.varlen ? P.total_q : 0;
  MLA_CHECK(P.qp * KH + P.ws_tail <= kInt32Max, "mla_autograd sm100: heads * round8(max_seqlen_q) + q rows = ",
            P.qp * KH + P.ws_tail, " must be below 2^31 (int32 offsets of the CUTLASS backward's LSE loads)");
  int64_t chunk = std::max<int64_t>(P.B, 1);
  // (a) memory: padded rows of a chunk at most max(2 * total_q, max_q)
  chunk = std::min(chunk, std::max<int64_t>(1, std::max(2 * P.total_q, P.qp) / std::max<int64_t>(P.qp, 1)));
  // (b) int32 offsets inside the kernel: LSE / sum loads b*qp*H + h*qp + q
  chunk = std::min(chunk, std::max<int64_t>(1, (kInt32Max - P.ws_tail) / std::max<int64_t>(P.qp * KH, 1)));
  // (c) dK/dV plain stores: (cu[b] + r) * row + h * head + d; dense: rows of a chunk = chunk * Sk
  auto kv_extent = [&](int64_t rows) {
    return std::max({extent(rows, P.dk.row, P.kern_h_k, P.dk.head, P.dqk),
                     extent(rows, P.dv.row, P.kern_h_k, P.dv.head, P.dvo)});
  };
  if (P.varlen) {
    MLA_CHECK(kv_extent(P.total_k) <= kInt32Max, "mla_autograd sm100: varlen backward needs every dk/dv offset "
                "below 2^31 (CUTLASS stores dK/dV with int32 offsets), got ", kv_extent(P.total_k),
                "; split the batch (cu_seqlens_k) into smaller calls");
  } else if (P.Sk > 0) {
    MLA_CHECK(kv_extent(P.Sk) <= kInt32Max, "mla_autograd sm100: one sequence of dk/dv spans ", kv_extent(P.Sk),
                " elements, above the int32 offsets of the CUTLASS backward");
    while (chunk > 1 && kv_extent(chunk * P.Sk) > kInt32Max) {
      chunk = std::max<int64_t>(1, std::min(chunk - 1, kInt32Max / kv_extent(P.Sk)));
    }
  }
  // (d) dense batches isolated from each other: the varlen loads bound a tile only by the chunk's rows, so a
  // batch's last partial query tile (64 rows MLA, 128 otherwise) or key tile (128) reads the next batch's
  // first q/dO or k/v rows, and P = 0 there times a NaN/Inf in them is NaN in this batch's dQ, dK, dV. One
  // batch per chunk ends the TMA extents at the batch, which zero-fill the rest.
  const int64_t tile_q = P.hd == HeadDims::kMla192x128 ? 64 : 128;
  P.isolate = !P.varlen && P.B > 1 && (P.Sq % tile_q != 0 || P.Sk % 128 != 0);
  if (P.isolate) chunk = 1;
  chunk = std::min(chunk, int64_t(65535));
  P.chunk = chunk;
  P.num_chunks = P.B > 0 ? ceil_div(P.B, chunk) : 0;
  P.ws_scaled_lse = (chunk * KH * P.qp + P.ws_tail) * 4;
  P.ws_sum_odo = (chunk * KH * P.qp + P.ws_tail) * 4;
  P.ws_dq_acc = chunk * KH * P.qp * P.dp * 4;
  P.workspace_bytes = P.ws_scaled_lse + P.ws_sum_odo + P.ws_dq_acc;
  return P;
}

py::dict plan_to_dict(const BwdPlan& P) {
  py::dict d;
  bool mla = P.hd == HeadDims::kMla192x128;
  d["kernel"] = std::string("fmha_bwd_sm100<") + dtype_name(P.dtype) + "," + head_dims_name(P.hd) + "," +
                mask_name(P.mask) + ",varlen>";
  d["dtype"] = dtype_name(P.dtype);
  d["head_dims"] = tup({I(P.dqk), I(P.dvo)});
  d["mask"] = mask_name(P.mask);
  d["mask_requested"] = mask_name(P.mask_requested);
  d["main_kernel"] = mla ? "Sm100FmhaBwdMlaKernelTmaWarpSpecialized" : "Sm100FmhaBwdKernelTmaWarpSpecialized";
  d["tile_shape"] = mla ? tup({I(64), I(128), I(192), I(128)}) : tup({I(128), I(128), I(128), I(128)});
  d["varlen_input"] = P.varlen;
  d["batch"] = P.B;
  d["empty"] = P.empty.empty() ? py::object(py::none()) : py::object(py::str(P.empty));
  d["gqa"] = P.gqa;
  d["kernel_heads"] = tup({I(P.kern_h_r), I(P.kern_h_k)});
  py::object hb = mla ? py::object(tup({I(P.kern_h_r * P.kern_h_k), I(P.chunk)}))
                      : py::object(tup({tup({I(P.kern_h_r), I(P.kern_h_k)}), I(P.chunk)}));
  // one chunk's launch: dense chunks see chunk * S rows (their TMA extents)
  const int64_t rows_q = P.varlen ? P.total_q : P.chunk * P.Sq, rows_k = P.varlen ? P.total_k : P.chunk * P.Sk;
  d["problem_shape"] = tup({tup({I(P.max_q), I(rows_q)}), tup({I(P.max_k), I(rows_k)}), I(P.dqk), I(P.dvo), hb});
  auto sq = [&](const RowHead& r) { return tup({I(r.row), I(1), tup({I(r.head), I(0)})}); };
  d["stride_q"] = sq(P.q);
  d["stride_k"] = sq(P.k);
  d["stride_v"] = sq(P.v);
  d["stride_o"] = sq(P.o);
  d["stride_do"] = sq(P.dout);
  d["stride_dq"] = sq(P.dq);
  d["stride_dk"] = sq(P.dk);
  d["stride_dv"] = sq(P.dv);
  const int64_t KH = P.kern_h_r * P.kern_h_k;
  d["stride_lse_workspace"] = tup({I(1), tup({I(P.qp), I(P.qp * KH)})});
  d["stride_dq_acc"] = tup({I(P.dp), I(1), tup({I(P.dp * P.qp), I(P.dp * P.qp * KH)})});
  d["copies"] = tup({py::bool_(P.copy_q), py::bool_(P.copy_k), py::bool_(P.copy_v), py::bool_(P.copy_o),
                     py::bool_(P.copy_do)});
  d["staged_outputs"] = tup({py::bool_(P.stage_dq), py::bool_(P.stage_dk), py::bool_(P.stage_dv)});
  d["qp"] = P.qp;
  d["dp"] = P.dp;
  d["chunk_batches"] = P.chunk;
  d["isolated_batches"] = P.isolate;
  d["num_chunks"] = P.num_chunks;
  d["workspace_scaled_lse_bytes"] = P.ws_scaled_lse;
  d["workspace_sum_odo_bytes"] = P.ws_sum_odo;
  d["workspace_dq_acc_bytes"] = P.ws_dq_acc;
  d["workspace_tail_floats"] = P.ws_tail;
  d["cu_sanitized"] = P.varlen;
  d["workspace_bytes"] = P.workspace_bytes;
  d["workspace_bytes_unchunked"] = P.workspace_bytes_unchunked;
  d["expand_kv_bytes"] = P.expand_bytes;
  d["grid"] = tup({I(ceil_div(P.max_k, 128)), I(mla ? KH : P.kern_h_k), I(P.chunk)});
  d["threads"] = 512;
  d["smem_bytes"] = bwd_smem_bytes(P.dtype, P.hd, P.mask);
  d["softmax_scale"] = P.scale;
  d["deterministic"] = false;
  return d;
}

}  // namespace

py::dict plan_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
                  const at::Tensor& dv, const c10::optional<at::Tensor>& cu_seqlens_q,
                  const c10::optional<at::Tensor>& cu_seqlens_k, const c10::optional<int64_t>& max_seqlen_q, const c10::optional<int64_t>& max_seqlen_k,
                  double softmax_scale, bool causal, bool bottom_right, bool deterministic) {
  return plan_to_dict(make_plan(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, softmax_scale, causal, bottom_right, deterministic));
}

void bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
         const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
         const c10::optional<at::Tensor>& cu_seqlens_q, const c10::optional<at::Tensor>& cu_seqlens_k,
         const c10::optional<int64_t>& max_seqlen_q, const c10::optional<int64_t>& max_seqlen_k, double softmax_scale, bool causal, bool bottom_right,
         bool deterministic) {
  BwdPlan P = make_plan(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, bottom_right, deterministic);
  MLA_CHECK(q.is_cuda(), "mla_autograd sm100: q must be a CUDA tensor");
  for (const at::Tensor* t : {&dout, &k, &v, &out, &lse, static_cast<const at::Tensor*>(&dq),
                              static_cast<const at::Tensor*>(&dk), static_cast<const at::Tensor*>(&dv)}) {
    MLA_CHECK(t->is_cuda() && t->device() == q.device(),
                "mla_autograd sm100: dout, q, k, v, out, lse, dq, dk, dv must be on the same CUDA device");
  }
  if (P.varlen) {
    MLA_CHECK(cu_seqlens_q->device() == q.device(), "mla_autograd sm100: cu_seqlens_q must be on q's device");
    MLA_CHECK(cu_seqlens_k->device() == q.device(), "mla_autograd sm100: cu_seqlens_k must be on q's device");
  }
  c10::cuda::CUDAGuard guard(q.device());
  const DeviceInfo& dev = device_info(q.get_device());
  MLA_CHECK(dev.major == 10, "mla_autograd sm100: fmha_bwd_sm100 needs an SM100 GPU (compute capability 10.x, "
              "built for sm_100a); this device is ", dev.major, ".", dev.minor);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();

  if (P.empty == "no_query_rows") {  // no query attends: dK = dV = 0
    dk.zero_();
    dv.zero_();
    return;
  }
  if (P.empty == "no_keys") {  // no key: dQ = 0 (dK/dV have no rows)
    dq.zero_();
    return;
  }
  auto i32 = at::TensorOptions().dtype(at::kInt).device(q.device());
  at::Tensor qc = P.copy_q ? q.contiguous() : q;
  at::Tensor kc = P.copy_k ? k.contiguous() : k;
  at::Tensor vc = P.copy_v ? v.contiguous() : v;
  at::Tensor oc = P.copy_o ? out.contiguous() : out;
  at::Tensor doc = P.copy_do ? dout.contiguous() : dout;
  at::Tensor dqt = P.stage_dq ? at::empty(dq.sizes(), dq.options()) : dq;
  at::Tensor dkt = P.stage_dk ? at::empty(dk.sizes(), dk.options()) : dk;
  at::Tensor dvt = P.stage_dv ? at::empty(dv.sizes(), dv.options()) : dv;
  if (P.gqa == "expand_kv") {
    kc = kc.repeat_interleave(P.h_r, -2).contiguous();  // head h reads kv head h / h_r
    vc = vc.repeat_interleave(P.h_r, -2).contiguous();
    auto shp_k = kc.sizes().vec(), shp_v = vc.sizes().vec();
    dkt = at::empty(shp_k, dk.options());
    dvt = at::empty(shp_v, dv.options());
  }

  const int64_t KH = P.kern_h_r * P.kern_h_k;
  at::Tensor ws_lse = at::empty({P.chunk * KH * P.qp + P.ws_tail}, q.options().dtype(at::kFloat));
  at::Tensor ws_sum = at::empty({P.chunk * KH * P.qp + P.ws_tail}, q.options().dtype(at::kFloat));
  at::Tensor ws_dq = at::empty({P.chunk * KH * P.qp * P.dp}, q.options().dtype(at::kFloat));

  at::Tensor cu_dense_q, cu_dense_k, cu_san_q, cu_san_k;
  if (P.varlen) {
    // sanitised on the device (sm100_fmha_cu.h); rows that no sequence covers get zero gradients
    std::tie(cu_san_q, cu_san_k) = launched_cu(*cu_seqlens_q, *cu_seqlens_k, P.B, P.total_q, P.total_k,
                                               CuLayout::kPlain, stream, "fmha_bwd_sm100");
    dqt.zero_();
    dkt.zero_();
    dvt.zero_();
  } else {
    cu_dense_q = at::arange(0, (P.chunk + 1) * P.Sq, P.Sq, i32).narrow(0, 0, P.chunk + 1);
    cu_dense_k = at::arange(0, (P.chunk + 1) * P.Sk, P.Sk, i32).narrow(0, 0, P.chunk + 1);
  }
  const int64_t esz = q.element_size();
  auto at_off = [&](const at::Tensor& t, int64_t elems) {
    return static_cast<void*>(static_cast<char*>(t.data_ptr()) + elems * esz);
  };

  for (int64_t b0 = 0; b0 < P.B; b0 += P.chunk) {
    const int64_t nb = std::min(P.chunk, P.B - b0);
    const int* cuq;
    const int* cuk;
    int64_t oq = 0, ok = 0;  // element offsets of the chunk's first batch (dense), per tensor
    const float* lse_ptr = lse.data_ptr<float>();
    int64_t tq = P.total_q, tk = P.total_k;
    if (P.varlen) {
      cuq = cu_san_q.data_ptr<int>() + b0;
      cuk = cu_san_k.data_ptr<int>() + b0;
    } else {
      cuq = cu_dense_q.data_ptr<int>();
      cuk = cu_dense_k.data_ptr<int>();
      oq = b0 * P.Sq;  // rows
      ok = b0 * P.Sk;
      lse_ptr += b0 * P.lse_batch;
      tq = nb * P.Sq;
      tk = nb * P.Sk;
    }
    BwdPrep pr{};
    pr.dtype = P.dtype;
    pr.batch = int(nb);
    pr.hq = int(KH);
    pr.d_vo = int(P.dvo);
    pr.qp = int(P.qp);
    pr.cu_q = cuq;
    pr.o = at_off(oc, oq * P.o.row);
    pr.o_row_stride = P.o.row;
    pr.o_head_stride = P.o.head;
    pr.dout = at_off(doc, oq * P.dout.row);
    pr.do_row_stride = P.dout.row;
    pr.do_head_stride = P.dout.head;
    pr.lse = lse_ptr;
    pr.lse_head_stride = P.lse_head;
    pr.lse_batch_stride = P.varlen ? 0 : P.lse_batch;
    pr.lse_rows_from_cu = P.varlen;
    pr.scaled_lse = ws_lse.data_ptr<float>();
    pr.neg_sum_odo = ws_sum.data_ptr<float>();
    MLA_CUDA_CHECK(bwd_prep_launch(pr, stream), "fmha_bwd_sm100: preprocess kernel launch");
    MLA_CUDA_CHECK(cudaMemsetAsync(ws_dq.data_ptr(), 0, size_t(nb * KH * P.qp * P.dp) * sizeof(float), stream),
                   "fmha_bwd_sm100: clearing the dQ accumulator");

    BwdLaunch L{};
    L.dtype = P.dtype;
    L.head_dims = P.hd;
    L.mask = P.mask;
    L.max_seqlen_q = int(P.max_q);
    L.max_seqlen_k = int(P.max_k);
    L.total_q = int(tq);
    L.total_k = int(tk);
    L.batch = int(nb);
    L.h_r = int(P.kern_h_r);
    L.h_k = int(P.kern_h_k);
    L.cu_q = cuq;
    L.cu_k = cuk;
    L.q = at_off(qc, oq * P.q.row);       L.q_row_stride = int(P.q.row);     L.q_head_stride = int(P.q.head);
    L.k = at_off(kc, ok * P.k.row);       L.k_row_stride = int(P.k.row);     L.k_head_stride = int(P.k.head);
    L.v = at_off(vc, ok * P.v.row);       L.v_row_stride = int(P.v.row);     L.v_head_stride = int(P.v.head);
    L.dout = at_off(doc, oq * P.dout.row); L.do_row_stride = int(P.dout.row); L.do_head_stride = int(P.dout.head);
    L.dk = at_off(dkt, ok * P.dk.row);    L.dk_row_stride = int(P.dk.row);   L.dk_head_stride = int(P.dk.head);
    L.dv = at_off(dvt, ok * P.dv.row);    L.dv_row_stride = int(P.dv.row);   L.dv_head_stride = int(P.dv.head);
    L.scaled_lse = ws_lse.data_ptr<float>();
    L.neg_sum_odo = ws_sum.data_ptr<float>();
    L.dq_acc = ws_dq.data_ptr<float>();
    L.qp = int(P.qp);
    L.dp = int(P.dp);
    L.softmax_scale = P.scale;
    MLA_CUDA_CHECK(bwd_launch(L, stream), "fmha_bwd_sm100: backward kernel launch (", nb, " batches, max_seqlen_k ",
                   L.max_seqlen_k, ")");

    BwdConvert cv{};
    cv.dtype = P.dtype;
    cv.batch = int(nb);
    cv.hq = int(KH);
    cv.d_qk = int(P.dqk);
    cv.qp = int(P.qp);
    cv.dp = int(P.dp);
    cv.max_seqlen_q = int(P.max_q);
    cv.cu_q = cuq;
    cv.dq_acc = ws_dq.data_ptr<float>();
    cv.dq = at_off(dqt, oq * P.dq.row);
    cv.dq_row_stride = P.dq.row;
    cv.dq_head_stride = P.dq.head;
    cv.scale = P.scale;
    MLA_CUDA_CHECK(bwd_convert_launch(cv, stream), "fmha_bwd_sm100: dQ conversion kernel launch");
  }

  if (P.gqa == "expand_kv") {
    auto sum_group = [&](const at::Tensor& exp, at::Tensor& target) {
      auto s = exp.sizes().vec();
      std::vector<int64_t> shp(s.begin(), s.end() - 2);
      shp.push_back(P.Hk);
      shp.push_back(P.h_r);
      shp.push_back(s.back());
      target.copy_(exp.view(shp).sum(-2));  // fp32 accumulation inside sum for bf16/fp16
    };
    sum_group(dkt, dk);
    sum_group(dvt, dv);
  } else {
    if (P.stage_dk) dk.copy_(dkt);
    if (P.stage_dv) dv.copy_(dvt);
  }
  if (P.stage_dq) dq.copy_(dqt);
}

}  // namespace mla_sm100

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mla_autograd SM100 (Blackwell, sm_100a) attention backward built on CUTLASS 4.2 example 77";
  m.def("bwd", &mla_sm100::bwd, "attention backward (see docs/architecture.md)", py::arg("dout"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
        py::arg("softmax_scale"), py::arg("causal"), py::arg("bottom_right"), py::arg("deterministic"));
  mla_sm100::bind_sanitize_cu(m);
  m.def("plan_bwd", &mla_sm100::plan_bwd,
        "pure-host plan of bwd(...) for the same arguments (meta/CPU tensors fine): validates and returns problem "
        "shape, strides, int64 workspace sizes, chunking, GQA handling, grid; launches nothing",
        py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dq"),
        py::arg("dk"), py::arg("dv"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("softmax_scale"), py::arg("causal"), py::arg("bottom_right"),
        py::arg("deterministic"));
}
