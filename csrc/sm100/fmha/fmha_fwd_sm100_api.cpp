// Host api of the SM100 (Blackwell) attention forward: validation, planning (pure host, exposed as
// plan_fwd for CPU tests), and the launch of CUTLASS example 77's forward kernel.
//
// fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
//     causal, bottom_right) -> None     (contract: docs/architecture.md)
//
// Design (docs/kernels/fmha_sm100.md):
// * Only the variable-length problem shape is compiled. Dense (B, S, H, D) tensors are viewed as
//   (B*S, H, D) with cu_seqlens = arange(B+1) * S (copied first if batch and sequence dims cannot
//   be merged); dense lse (B, H, S) is addressed through the lse batch stride (row offset cu[b] =
//   b*S, batch stride lse.stride(0) - S).
// * The varlen epilogue builds its TMA descriptor max_seqlen_q rows before out. If `out` has that
//   much of its own storage in front of it (allocate buf[(pad + T), H, Dv] and pass buf[pad:], see
//   plan_fwd()["out_pad_rows"]) it is written in place; otherwise the kernel writes a padded
//   staging buffer allocated here and the result is copied into `out`. The caller never has to pad.
// * Varlen cu_seqlens are sanitised on the device (sm100_fmha_cu.h: clamped into the packed rows and
//   made non-decreasing), so the kernels stay inside q, k, v, out and lse for any values, without a host
//   synchronisation. Bottom-right causal rows with no visible key (s_q > s_k) and sequences with s_k = 0
//   form their own batches with zero keys, for which the kernel writes O = 0 and LSE = -inf (never
//   NaN). An empty batch 0 is put in front so that CUTLASS's correction_empty debug print (block
//   (0,0,0) only) never fires.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "sm100/fmha/sm100_fmha_host.h"

namespace mla_sm100 {

int fwd_smem_bytes(DType dt, HeadDims hd, Mask m) {
  return pick_variant(dt, hd, fwd_bf16_mla_smem, fwd_bf16_mha_smem, fwd_fp16_mla_smem, fwd_fp16_mha_smem)(m);
}

cudaError_t fwd_launch(FwdLaunch const& p, cudaStream_t stream) {
  return pick_variant(p.dtype, p.head_dims, fwd_bf16_mla, fwd_bf16_mha, fwd_fp16_mla, fwd_fp16_mha)(p, stream);
}

namespace {

struct FwdPlan : ProblemPlan {
  std::string cu_rewrite;  // "none" | "prepend_empty_batch" | "split_bottom_right"
  int64_t cu_entries = 0;  // entries of the rewritten cu_seqlens
  int64_t batches = 0;     // batches of a launch
  int64_t launches = 1;    // kernel launches: one per batch for dense calls isolated per batch, else one
  int64_t launch_q = 0, launch_k = 0;  // q / k rows of a launch (its TMA extents)
  bool copy_q = false, copy_k = false, copy_v = false;
  bool out_staging = false;
  int64_t out_pad_rows = 0, out_staging_bytes = 0;
  bool lse_staging = false;
  RowHead q, k, v, o;
  int64_t lse_head = 0, lse_batch = 0, lse_staging_bytes = 0;
  int64_t lse_launch = 0;  // element offset of launch i's lse: i * lse_launch
  bool causal_sched = false;  // CausalIndividualTileScheduler (else IndividualTileScheduler)
  int64_t grid_x = 0, grid_y = 0, grid_z = 0;
};

FwdPlan make_plan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                  const at::Tensor& lse, const c10::optional<at::Tensor>& cu_q,
                  const c10::optional<at::Tensor>& cu_k, const c10::optional<int64_t>& max_seqlen_q, const c10::optional<int64_t>& max_seqlen_k,
                  double softmax_scale, bool causal, bool bottom_right) {
  FwdPlan P;
  plan_problem(P, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right);

  P.q = row_head_of(q);
  P.k = row_head_of(k);
  P.v = row_head_of(v);
  P.o = row_head_of(out);
  auto as_contig = [](RowHead& r, int64_t H, int64_t D, bool& copy) {
    if (!r.merged) {
      copy = true;
      r.row = H * D;
      r.head = D;
      r.merged = true;
    }
  };
  as_contig(P.q, P.Hq, P.dqk, P.copy_q);
  as_contig(P.k, P.Hk, P.dqk, P.copy_k);
  as_contig(P.v, P.Hk, P.dvo, P.copy_v);

  // Dense batches are isolated from each other. Example 77's varlen loads bound a tile only by the packed
  // tensor's extent, so a sequence's last partial key tile reads the next sequence's first rows, and P = 0
  // there times a NaN/Inf in V is NaN in this sequence's output. With one launch per batch the TMA extent
  // ends at the batch and zero-fills the rest. Only dense calls whose key length leaves a partial 128-row
  // tile need it (varlen sequences are packed by the caller: docs/architecture.md).
  P.launches = (!P.varlen && P.B > 1 && P.Sk % 128 != 0) ? P.B : 1;
  const int64_t LB = P.launches > 1 ? 1 : P.B;  // sequences of a launch
  P.launch_q = P.launches > 1 ? P.Sq : P.total_q;
  P.launch_k = P.launches > 1 ? P.Sk : P.total_k;

  // cu_seqlens rewrite and launched batches
  const bool split = P.mask == Mask::kCausalBottomRight && (P.varlen || P.Sq > P.Sk);
  if (split) {
    P.cu_rewrite = "split_bottom_right";
    P.cu_entries = 2 * LB + 2;
    P.batches = 2 * LB + 1;
  } else if (P.varlen) {
    P.cu_rewrite = "prepend_empty_batch";
    P.cu_entries = P.B + 2;
    P.batches = P.B + 1;
  } else {
    P.cu_rewrite = "none";
    P.cu_entries = LB + 1;
    P.batches = LB;
  }
  MLA_CHECK(P.batches <= 65535, "mla_autograd sm100: ", P.B, " sequences give ", P.batches,
              " launched batches, above the grid limit 65535; split the batch");

  // out: written in place when max_q rows of its own storage precede it, else staged
  P.out_pad_rows = P.max_q;
  {
    bool o_ok = P.o.merged;
    int64_t need = P.max_q * P.o.row;
    if (o_ok) o_ok = out.storage_offset() >= need;
    if (!o_ok) {
      P.out_staging = true;
      P.o.row = P.Hq * P.dvo;
      P.o.head = P.dvo;
      P.o.merged = true;
      P.out_staging_bytes = (P.max_q + P.total_q) * P.Hq * P.dvo * int64_t(out.element_size());
    }
  }
  MLA_CHECK(P.max_q * (P.batches + 1) <= kInt32Max, "mla_autograd sm100: max_seqlen_q * (batches + 1) = ",
              P.max_q * (P.batches + 1), " must be below 2^31 (int32 extent of the CUTLASS varlen output descriptor)");

  // lse addressing: kernel writes lse_ptr[(cu[b] + r) + h * lse_head + b * lse_batch]
  if (P.varlen) {
    bool ok = (P.total_q <= 1 || lse.stride(1) == 1) && (P.Hq <= 1 || lse.stride(0) <= kInt32Max);
    if (ok) {
      P.lse_head = P.Hq > 1 ? lse.stride(0) : P.total_q;
      P.lse_batch = 0;
    } else {
      P.lse_staging = true;
    }
  } else if (split && P.launches == 1) {
    P.lse_staging = true;  // launched batch index != user batch index
  } else {  // one launched batch per user batch (or one launch per batch, each at its lse offset)
    bool ok = (P.Sq <= 1 || lse.stride(2) == 1);
    int64_t sb = P.B > 1 ? lse.stride(0) - P.Sq : 0;
    int64_t sh = P.Hq > 1 ? lse.stride(1) : P.Sq;
    ok = ok && sb >= 0 && sb <= kInt32Max && sh <= kInt32Max;
    if (ok) {
      P.lse_head = sh;
      P.lse_batch = sb;
    } else {
      P.lse_staging = true;
    }
  }
  if (P.lse_staging) {  // (Hq, total_q) float32
    P.lse_head = P.total_q;
    P.lse_batch = 0;
    P.lse_staging_bytes = P.Hq * P.total_q * 4;
  }
  if (P.launches > 1) {  // batch b's lse starts b * (Sq + batch gap) elements in; its launched batches share it
    P.lse_launch = P.Sq + P.lse_batch;
    P.lse_batch = 0;
  }
  {
    int64_t max_off = P.total_q + (P.Hq - 1) * P.lse_head + (P.batches - 1) * P.lse_batch;
    MLA_CHECK(max_off <= kInt32Max, "mla_autograd sm100: lse addressing exceeds int32 (", max_off,
                "); split the batch");
  }
  for (auto* r : {&P.q, &P.k, &P.v, &P.o}) {
    MLA_CHECK(r->row <= kInt32Max && r->head <= kInt32Max, "mla_autograd sm100: strides must be below 2^31");
  }
  // The launcher forms the kv-group strides head * h_r in int32, and example 77's epilogue moves the output
  // pointer back by max_seqlen_q * row stride in int32 (its varlen descriptor starts max_q rows before out).
  MLA_CHECK(P.q.head * P.h_r <= kInt32Max && P.o.head * P.h_r <= kInt32Max && P.lse_head * P.h_r <= kInt32Max,
            "mla_autograd sm100: head stride x (query heads / kv heads) must be below 2^31");
  MLA_CHECK(P.max_q * P.o.row <= kInt32Max, "mla_autograd sm100: max_seqlen_q x output row stride = ",
            P.max_q * P.o.row, " must be below 2^31 (int32 output offset of CUTLASS example 77's forward epilogue; ",
            "the dispatch table sends such calls elsewhere)");
  // TMA coordinates of example 77 are int32: query rows cu[b] + row (below total_q + the grid's rows), key
  // rows cu_k[b] + row (below total_k + one 128-row tile), the output's first coordinate max_q - len + row.
  const int64_t grid_rows = round_up(P.max_q, 256);
  MLA_CHECK(P.total_q + grid_rows <= kInt32Max && P.max_q + grid_rows <= kInt32Max && P.total_k + 128 <= kInt32Max,
            "mla_autograd sm100: q rows + round_up(max_seqlen_q, 256) = ", P.total_q + grid_rows, " (or k rows + 128 = ",
            P.total_k + 128, ") must be below 2^31 (int32 TMA row coordinates of CUTLASS example 77's forward)");
  // Tile scheduler as FlashMLA picks it (and example 77's MLA runner): the causal one for causal masks when
  // the query heads are a multiple of its head group (8); its grid is (heads, q tiles, batches).
  const int64_t q_tiles = ceil_div(P.max_q, 256);
  MLA_CHECK(q_tiles <= 65535, "mla_autograd sm100: max_seqlen_q = ", P.max_q, " gives ", q_tiles,
            " query tiles of 256 rows, above the grid limit 65535");
  P.causal_sched = P.mask != Mask::kNone && P.Hq % 8 == 0;
  P.grid_x = P.causal_sched ? P.Hq : q_tiles;
  P.grid_y = P.causal_sched ? q_tiles : P.Hq;
  P.grid_z = P.batches;
  return P;
}

py::dict plan_to_dict(const FwdPlan& P) {
  py::dict d;
  bool mla = P.hd == HeadDims::kMla192x128;
  d["kernel"] = std::string("fmha_fwd_sm100<") + dtype_name(P.dtype) + "," + head_dims_name(P.hd) + "," +
                mask_name(P.mask) + ",varlen>";
  d["dtype"] = dtype_name(P.dtype);
  d["head_dims"] = tup({I(P.dqk), I(P.dvo)});
  d["mask"] = mask_name(P.mask);
  d["tile_shape"] = mla ? tup({I(256), I(128), tup({I(128), I(64)})}) : tup({I(256), I(128), I(128)});
  d["varlen_input"] = P.varlen;
  d["batch"] = P.B;
  d["empty"] = P.empty.empty() ? py::object(py::none()) : py::object(py::str(P.empty));
  d["cu_rewrite"] = P.cu_rewrite;
  d["cu_entries"] = P.cu_entries;
  d["cu_sanitized"] = P.cu_rewrite != "none";
  d["batches_launched"] = P.batches;
  py::object D = mla ? py::object(tup({I(128), I(64)})) : py::object(I(128));
  // VariableLength leaves shown as (max_length, total_length)
  // one launch's problem shape (launches of them, one per batch for isolated dense batches)
  d["problem_shape"] = tup({tup({I(P.max_q), I(P.launch_q)}), tup({I(P.max_k), I(P.launch_k)}), D,
                            tup({tup({I(P.h_r), I(P.Hk)}), I(P.batches)})});
  d["launches"] = P.launches;
  d["stride_q"] = tup({I(P.q.row), I(1), tup({tup({I(P.q.head), I(P.q.head * P.h_r)}), I(0)})});
  d["stride_k"] = tup({I(P.k.row), I(1), tup({tup({I(0), I(P.k.head)}), I(0)})});
  d["stride_v"] = tup({I(P.v.row), I(1), tup({tup({I(0), I(P.v.head)}), I(0)})});
  d["stride_o"] = tup({I(P.o.row), I(1), tup({tup({I(P.o.head), I(P.o.head * P.h_r)}), I(0)})});
  d["stride_lse"] = tup({I(1), tup({tup({I(P.lse_head), I(P.lse_head * P.h_r)}), I(P.lse_batch)})});
  d["copy_q"] = P.copy_q;
  d["copy_k"] = P.copy_k;
  d["copy_v"] = P.copy_v;
  d["out_pad_rows"] = P.out_pad_rows;
  d["out_staging"] = P.out_staging;
  d["out_staging_bytes"] = P.out_staging_bytes;
  d["lse_staging"] = P.lse_staging;
  d["lse_staging_bytes"] = P.lse_staging_bytes;
  d["workspace_bytes"] = int64_t(0);
  d["tile_scheduler"] = P.causal_sched ? "CausalIndividualTileScheduler" : "IndividualTileScheduler";
  d["grid"] = tup({I(P.grid_x), I(P.grid_y), I(P.grid_z)});
  d["threads"] = 512;
  d["smem_bytes"] = fwd_smem_bytes(P.dtype, P.hd, P.mask);
  d["softmax_scale"] = P.scale;
  return d;
}

}  // namespace

py::dict plan_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                  const at::Tensor& lse, const c10::optional<at::Tensor>& cu_seqlens_q,
                  const c10::optional<at::Tensor>& cu_seqlens_k, const c10::optional<int64_t>& max_seqlen_q, const c10::optional<int64_t>& max_seqlen_k,
                  double softmax_scale, bool causal, bool bottom_right) {
  return plan_to_dict(make_plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal, bottom_right));
}

void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
         const c10::optional<at::Tensor>& cu_seqlens_q, const c10::optional<at::Tensor>& cu_seqlens_k,
         const c10::optional<int64_t>& max_seqlen_q, const c10::optional<int64_t>& max_seqlen_k, double softmax_scale, bool causal, bool bottom_right) {
  FwdPlan P = make_plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                        causal, bottom_right);
  MLA_CHECK(q.is_cuda(), "mla_autograd sm100: q must be a CUDA tensor");
  for (auto* t : {&k, &v, static_cast<const at::Tensor*>(&out), static_cast<const at::Tensor*>(&lse)}) {
    MLA_CHECK(t->is_cuda() && t->device() == q.device(), "mla_autograd sm100: q, k, v, out, lse must be on the same CUDA device");
  }
  if (P.varlen) {
    MLA_CHECK(cu_seqlens_q->device() == q.device(), "mla_autograd sm100: cu_seqlens_q must be on q's device");
    MLA_CHECK(cu_seqlens_k->device() == q.device(), "mla_autograd sm100: cu_seqlens_k must be on q's device");
  }
  c10::cuda::CUDAGuard guard(q.device());
  const DeviceInfo& dev = device_info(q.get_device());
  MLA_CHECK(dev.major == 10, "mla_autograd sm100: fmha_fwd_sm100 needs an SM100 GPU (compute capability 10.x, built for sm_100a); this device is ",
              dev.major, ".", dev.minor);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();

  if (P.empty == "no_query_rows") return;
  if (P.empty == "no_keys") {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return;
  }
  auto i32 = at::TensorOptions().dtype(at::kInt).device(q.device());
  at::Tensor qc = P.copy_q ? q.contiguous() : q;
  at::Tensor kc = P.copy_k ? k.contiguous() : k;
  at::Tensor vc = P.copy_v ? v.contiguous() : v;

  at::Tensor cu_q, cu_k;
  if (P.varlen) {
    cu_q = *cu_seqlens_q;
    cu_k = *cu_seqlens_k;
  } else {  // the sequences of one launch
    const int64_t LB = P.launches > 1 ? 1 : P.B;
    cu_q = at::arange(0, (LB + 1) * P.Sq, std::max<int64_t>(P.Sq, 1), i32).narrow(0, 0, LB + 1);
    cu_k = at::arange(0, (LB + 1) * P.Sk, std::max<int64_t>(P.Sk, 1), i32).narrow(0, 0, LB + 1);
  }
  if (P.cu_rewrite != "none") {  // every varlen call (the caller's values sanitised) and the dense bottom-right split
    const CuLayout layout = P.cu_rewrite == "split_bottom_right" ? CuLayout::kSplitBottomRight : CuLayout::kPrependEmpty;
    std::tie(cu_q, cu_k) =
        launched_cu(cu_q, cu_k, cu_q.size(0) - 1, P.launch_q, P.launch_k, layout, stream, "fmha_fwd_sm100");
  }

  at::Tensor out_buf;
  char* o_ptr = static_cast<char*>(out.data_ptr());
  if (P.out_staging) {
    out_buf = at::empty({P.max_q + P.total_q, P.Hq, P.dvo}, out.options());
    o_ptr = static_cast<char*>(out_buf.data_ptr()) + P.max_q * P.o.row * out.element_size();
  }
  at::Tensor lse_buf;
  float* lse_ptr = lse.data_ptr<float>();
  if (P.lse_staging) {
    lse_buf = at::empty({P.Hq, P.total_q}, lse.options());
    lse_ptr = lse_buf.data_ptr<float>();
  }

  FwdLaunch L{};
  L.dtype = P.dtype;
  L.head_dims = P.hd;
  L.mask = P.mask;
  L.max_seqlen_q = int(P.max_q);
  L.max_seqlen_k = int(P.max_k);
  L.total_q = int(P.launch_q);
  L.total_k = int(P.launch_k);
  L.batch = int(P.batches);
  L.h_r = int(P.h_r);
  L.h_k = int(P.Hk);
  L.cu_q = cu_q.data_ptr<int>();
  L.cu_k = cu_k.data_ptr<int>();
  L.q = qc.data_ptr(); L.q_row_stride = int(P.q.row); L.q_head_stride = int(P.q.head); L.q_batch_stride = 0;
  L.k = kc.data_ptr(); L.k_row_stride = int(P.k.row); L.k_head_stride = int(P.k.head); L.k_batch_stride = 0;
  L.v = vc.data_ptr(); L.v_row_stride = int(P.v.row); L.v_head_stride = int(P.v.head); L.v_batch_stride = 0;
  L.o = o_ptr;         L.o_row_stride = int(P.o.row); L.o_head_stride = int(P.o.head); L.o_batch_stride = 0;
  L.lse = lse_ptr; L.lse_head_stride = int(P.lse_head); L.lse_batch_stride = int(P.lse_batch);
  L.softmax_scale = P.scale;
  L.sm_count = dev.sm_count;
  L.causal_scheduler = P.causal_sched;
  const int64_t esz = q.element_size();
  for (int64_t i = 0; i < P.launches; ++i) {  // launch i: batch i of an isolated dense call (int64 offsets)
    FwdLaunch Li = L;
    if (i > 0) {
      Li.q = static_cast<const char*>(L.q) + i * P.Sq * P.q.row * esz;
      Li.k = static_cast<const char*>(L.k) + i * P.Sk * P.k.row * esz;
      Li.v = static_cast<const char*>(L.v) + i * P.Sk * P.v.row * esz;
      Li.o = static_cast<char*>(L.o) + i * P.Sq * P.o.row * esz;
      Li.lse = L.lse + i * P.lse_launch;
    }
    MLA_CUDA_CHECK(fwd_launch(Li, stream), "fmha_fwd_sm100: forward kernel launch (", Li.batch,
                   " batches, max_seqlen_q ", Li.max_seqlen_q, ")");
  }

  if (P.out_staging) {
    at::Tensor view = out_buf.narrow(0, P.max_q, P.total_q);
    out.copy_(P.varlen ? view : view.view({P.B, P.Sq, P.Hq, P.dvo}));
  }
  if (P.lse_staging) {
    if (P.varlen) {
      lse.copy_(lse_buf);
    } else {
      lse.copy_(lse_buf.view({P.Hq, P.B, P.Sq}).permute({1, 0, 2}));
    }
  }
}

int64_t out_pad_rows(int64_t max_seqlen_q) { return max_seqlen_q; }

}  // namespace mla_sm100

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mla_autograd SM100 (Blackwell, sm_100a) attention forward built on CUTLASS 4.2 example 77";
  m.def("fwd", &mla_sm100::fwd, "attention forward (see docs/architecture.md)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
        py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("bottom_right"));
  m.def("plan_fwd", &mla_sm100::plan_fwd,
        "pure-host plan of fwd(...) for the same arguments (meta/CPU tensors fine): validates and returns the "
        "problem shape, packed strides, cu_seqlens rewrite, staging, grid; launches nothing",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("softmax_scale"),
        py::arg("causal"), py::arg("bottom_right"));
  mla_sm100::bind_sanitize_cu(m);
  m.def("out_pad_rows", &mla_sm100::out_pad_rows,
        "rows of (heads*d_vo) elements that must precede `out` in its own storage for an in-place varlen write "
        "(allocate buf[pad + total_q] and pass buf[pad:]); otherwise fwd stages and copies",
        py::arg("max_seqlen_q"));
}
