// Host layer of the mla_decode_sm80 family: validates every input, then launches on the current stream
// the device-side scheduler (unless the caller passes a schedule from decode_schedule), the decode kernel
// and (when a request was split) the merge kernel.
// No host sync: grid and workspace sizes depend on shapes only, so a decode step can be graph-captured.
// Plan/run split (as FlashMLA's get_mla_metadata): decode_schedule(cache_seqlens, Sq, H) runs the scheduler
// alone, once per decode step; every layer's decode(..., schedule=) then skips it.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/cuda_check.h"
#include "common/device_info.h"
#include "sm80/mla_decode/mla_decode_sm80_config.h"
#include "sm80/mla_decode/mla_decode_sm80_params.h"
#include "sm80/mla_decode/mla_decode_sm80_stamps.h"
#include "sm90/mla_decode/mla_decode_sm90_config.h"

namespace mds = mla_decode_sm80;

namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }


// Launch options of the test entry points (decode_with_options, decode_schedule_with_options, launch_info): each
// one, away from its default, makes on this device a choice that the automatic launch makes on another device or
// for other inputs, so that one GPU can run every kernel configuration some device runs. The defaults are the
// automatic launch, which decode(), decode_schedule() and schedule_numel() always take.
struct LaunchOptions {
  int stages = 0;                // > 0: at most this many cp.async stages (the warp-specialized kernel: at least
                                 // 3), as on a device with less shared memory; 0: as many as fit
  int ctas_per_sm = 0;           // 1 or 2: CTAs per SM of the all-warps 16/32-row kernel (2 only where two fit);
                                 // 0: two where two fit
  bool warp_specialized = true;  // false: 16/32-row tiles run the all-warps kernel (as on 8.6/8.9, or for caches
                                 // with strides beyond 32 bits)
  bool groups = true;            // false: 64-row tiles run the all-warps kernel (as where the row-group kernel does
                                 // not fit: 8.0, 8.7)
  bool pdl = true;               // false: plain launches, no programmatic dependent launch (as on sm_80)
  bool wgmma = true;             // false: 64-row tiles on 9.0 run the row-group kernel (as on 8.x, or for caches
                                 // the TMA cannot read: page_size < 8, unaligned bases or strides)
};

const LaunchOptions kAutoLaunch{};

// Every option in range, checked before anything runs; fn names the caller.
void check_options(const LaunchOptions& opt, const char* fn) {
  MLA_CHECK(opt.stages == 0 || (opt.stages >= mds::kMinStages && opt.stages <= mds::kMaxStages), fn,
              ": options.stages must be 0 or in [", mds::kMinStages, ", ", mds::kMaxStages, "], got ", opt.stages);
  MLA_CHECK(opt.ctas_per_sm >= 0 && opt.ctas_per_sm <= 2, fn, ": options.ctas_per_sm must be 0, 1 or 2, got ",
              opt.ctas_per_sm);
}

// "(d0, d1, ...)" without streaming an IntArrayRef.
std::string shape_str(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

// Launch shape of a decode call: every decision that depends only on (B, Sq, H), the device and the launch
// options, among them the size of the split-KV schedule. decode() and decode_schedule() both take it from
// here, so a schedule and the decode that consumes it agree by construction; so does the size that the fake
// of mla_autograd::mla_decode_schedule reports (schedule_numel below).
struct LaunchShape {
  int64_t B = 0, rows = 0;  // rows = Sq * H (token, head) pairs per request
  int m_tile = 16, num_mblocks = 1;
  bool ws = false;          // the warp-specialized kernel (when the caches' strides also fit int32: decode_impl)
  int ws_stages = 0;        // its cp.async stages
  int stages = 0;           // stages of the all-warps kernel (also the fallback of the warp-specialized one)
  bool groups = false;      // 64-row tiles: the row-group kernel (64 KV tokens per step, two decoupled 4-warp
                            // groups of 32 rows, mla_decode_groups_kernel), else the all-warps kernel
  bool wgmma = false;       // 64-row tiles on 9.0: the Hopper wgmma + TMA kernel (csrc/sm90/mla_decode) where the
                            // caches allow it (decode_impl), else the row-group kernel
  int ctas = 1;             // CTAs per SM counted by num_parts
  int num_parts = 1;        // target number of CTAs per m-block
  int min_tiles = 2;        // a split covers at least this many kBlockN-token tiles
  int64_t num_items = 0;    // grid.y of the main kernel: B * force_splits, else B + num_parts
  // int32 schedule: items[num_items][4] then reqs[B][2] (params.h)
  int64_t sched_numel() const { return num_items * 4 + B * 2; }
};

LaunchShape launch_shape(int64_t B, int64_t Sq, int64_t H, const mla::DeviceInfo& prop, int64_t force_splits,
                         const LaunchOptions& opt, const char* fn) {
  LaunchShape ls;
  ls.B = B;
  ls.rows = Sq * H;
  ls.m_tile = ls.rows <= 16 ? 16 : (ls.rows <= 32 ? 32 : 64);
  const int m_tile = ls.m_tile;
  ls.num_mblocks = int((ls.rows + m_tile - 1) / m_tile);
  // All-warps kernel, 16/32-row tiles: two CTAs per SM when two fit (each with 2 stages); else one CTA with
  // the most stages.
  // The main kernels' static shared memory (work_item's inline-schedule slot) comes out of the same budget.
  const int dyn_optin = prop.smem_optin - mds::kStaticSmemBytes;
  int ctas = 1, stages = mds::max_stages_for(m_tile, dyn_optin);
  const int want_ctas = opt.ctas_per_sm > 0 ? opt.ctas_per_sm : (m_tile <= 32 ? 2 : 1);
  if (want_ctas >= 2 && m_tile <= 32) {
    const int per_cta = (prop.smem_per_sm / 2) - 1024 - mds::kStaticSmemBytes;  // 1 KB per CTA reserved by the runtime
    const int s2 = mds::max_stages_for(m_tile, per_cta);
    if (s2 >= mds::kMinStages) { ctas = 2; stages = s2; }
  }
  // 64-row tiles: the row-group kernel (64 KV tokens per step, two decoupled 4-warp groups of 32 rows, its two
  // stages fixed) wherever it fits (sm_90's 227 KB, not sm_80's 163 KB).
  if (m_tile == 64 && opt.groups && mds::GroupsConfig::smem_bytes() <= dyn_optin) {
    ls.groups = true;
    stages = mds::GroupsConfig::kStages;
  } else if (opt.stages > 0) {
    stages = std::min(stages, opt.stages);
  }
  ls.stages = stages;
  ls.wgmma = ls.groups && opt.wgmma && prop.major == 9 && prop.minor == 0 &&
             mla_decode_sm90::sm90_smem_bytes() <= dyn_optin;
  // 16/32-row tiles: the warp-specialized kernel (one CTA per SM, QK/softmax overlapped with PV) wherever
  // three of its stages fit (sm_80, sm_90; not the 99 KB of sm_86/89).
  const int ws_stages = m_tile <= 32 ? mds::ws_max_stages_for(m_tile, dyn_optin) : 0;
  ls.ws = ws_stages >= mds::WsTileConfig<16>::kMinStages && opt.warp_specialized;
  if (ls.ws) {
    ls.ws_stages = opt.stages > 0 ? std::max(mds::WsTileConfig<16>::kMinStages, std::min(ws_stages, opt.stages))
                                  : ws_stages;
    ctas = 1;
  }
  ls.ctas = ctas;
  MLA_CHECK((ls.ws ? ls.ws_stages : ls.stages) >= mds::kMinStages, fn, ": not enough shared memory per block (",
              prop.smem_optin, " B) for the m_tile ", m_tile, " kernel");
  ls.num_parts = std::max(1, prop.sm_count * ctas / ls.num_mblocks);
  ls.num_items = force_splits > 0 ? B * force_splits : B + ls.num_parts;
  MLA_CHECK(ls.num_items <= 65535, fn, ": too many work items (", ls.num_items, ")");
  // A split must read more KV than its partial output costs to write and merge (rows x 2 KB).
  ls.min_tiles = int(std::max<int64_t>(2, ls.rows * mds::kDimCkv * 4 / (2 * mds::kBlockN * mds::kRowBytes)));
  return ls;
}

// A caller's schedule must be the int32 tensor decode_schedule() makes for this call's shapes on its device
// (B == 0: empty). Its values are not read here (no host sync): they must come from this call's cache_seqlens
// (the Python API checks that the lengths tensor was not modified in place since).
void check_schedule_tensor(const at::Tensor& schedule, const c10::Device& dev) {
  MLA_CHECK(schedule.is_cuda() && schedule.device() == dev, "decode: schedule must be on ", dev.str(),
              " (same device as q_nope), got ", schedule.device().str());
  MLA_CHECK(schedule.scalar_type() == at::kInt, "decode: schedule must be int32 (from decode_schedule), got ",
              schedule.scalar_type());
  MLA_CHECK(schedule.dim() == 1 && schedule.is_contiguous(), "decode: schedule must be a contiguous 1-D tensor, got ",
              shape_str(schedule));
}

void check_schedule_size(const at::Tensor& schedule, int64_t need, int64_t B, int64_t Sq, int64_t H, int64_t force_splits) {
  const std::string splits = force_splits > 0 ? ", num_splits=" + std::to_string(force_splits) : std::string();
  MLA_CHECK(schedule.numel() == need, "decode: schedule has ", schedule.numel(), " elements but this call (B=", B,
              ", Sq=", Sq, ", H=", H, splits, ") needs ", need, ": compute it with decode_schedule(cache_seqlens, seqlen_q=",
              Sq, ", num_heads=", H, splits, ")");
}

// out (B, Sq, H, 512) and lse (B, H, Sq) float32 are the caller's, or allocated here when not given; returns them.
std::tuple<at::Tensor, at::Tensor> decode_impl(const at::Tensor& q_nope, const at::Tensor& q_pe,
                                               const at::Tensor& ckv_cache, const at::Tensor& kpe_cache,
                                               const at::Tensor& block_table, const at::Tensor& cache_seqlens,
                                               const c10::optional<at::Tensor>& out_arg,
                                               const c10::optional<at::Tensor>& lse_arg, double softmax_scale,
                                               bool causal, int64_t force_splits,
                                               const c10::optional<at::Tensor>& schedule, const LaunchOptions& opt) {
  // ---- validation (every argument named) ----
  MLA_CHECK(q_nope.is_cuda(), "decode: q_nope must be a CUDA tensor");
  const auto dev = q_nope.device();
  auto same_dev = [&](const at::Tensor& t, const char* name) {
    MLA_CHECK(t.is_cuda() && t.device() == dev, "decode: ", name, " must be on ", dev.str(), " (same device as q_nope)");
  };
  same_dev(q_pe, "q_pe"); same_dev(ckv_cache, "ckv_cache"); same_dev(kpe_cache, "kpe_cache");
  same_dev(block_table, "block_table"); same_dev(cache_seqlens, "cache_seqlens");
  const auto dt = q_nope.scalar_type();
  MLA_CHECK(dt == at::kBFloat16 || dt == at::kHalf, "decode: q_nope must be bfloat16 or float16, got ", dt);
  MLA_CHECK(q_pe.scalar_type() == dt, "decode: q_pe dtype ", q_pe.scalar_type(), " != q_nope dtype ", dt);
  MLA_CHECK(ckv_cache.scalar_type() == dt, "decode: ckv_cache dtype ", ckv_cache.scalar_type(), " != q_nope dtype ", dt);
  MLA_CHECK(kpe_cache.scalar_type() == dt, "decode: kpe_cache dtype ", kpe_cache.scalar_type(), " != q_nope dtype ", dt);
  MLA_CHECK(block_table.scalar_type() == at::kInt, "decode: block_table must be int32");
  MLA_CHECK(cache_seqlens.scalar_type() == at::kInt, "decode: cache_seqlens must be int32");

  MLA_CHECK(q_nope.dim() == 4 && q_nope.size(3) == mds::kDimCkv, "decode: q_nope must be (B, Sq, H, 512), got ", shape_str(q_nope));
  const int64_t B = q_nope.size(0), Sq = q_nope.size(1), H = q_nope.size(2);
  MLA_CHECK(q_pe.dim() == 4 && q_pe.size(0) == B && q_pe.size(1) == Sq && q_pe.size(2) == H && q_pe.size(3) == mds::kDimKpe,
              "decode: q_pe must be (B, Sq, H, 64) = (", B, ", ", Sq, ", ", H, ", 64), got ", shape_str(q_pe));
  MLA_CHECK(Sq >= 1 && H >= 1, "decode: q_nope needs Sq >= 1 and H >= 1, got ", shape_str(q_nope));
  const at::Tensor out = out_arg.has_value() ? *out_arg : at::empty({B, Sq, H, mds::kDimCkv}, q_nope.options());
  const at::Tensor lse = lse_arg.has_value() ? *lse_arg : at::empty({B, H, Sq}, q_nope.options().dtype(at::kFloat));
  same_dev(out, "out"); same_dev(lse, "lse");
  MLA_CHECK(out.scalar_type() == dt, "decode: out dtype ", out.scalar_type(), " != q_nope dtype ", dt);
  MLA_CHECK(lse.scalar_type() == at::kFloat, "decode: lse must be float32");
  MLA_CHECK(ckv_cache.dim() == 3 && ckv_cache.size(2) == mds::kDimCkv, "decode: ckv_cache must be (P, page_size, 512), got ", shape_str(ckv_cache));
  const int64_t P = ckv_cache.size(0), page_size = ckv_cache.size(1);
  MLA_CHECK(kpe_cache.dim() == 3 && kpe_cache.size(0) == P && kpe_cache.size(1) == page_size && kpe_cache.size(2) == mds::kDimKpe,
              "decode: kpe_cache must be (P, page_size, 64) = (", P, ", ", page_size, ", 64), got ", shape_str(kpe_cache));
  MLA_CHECK(page_size >= 1 && (page_size & (page_size - 1)) == 0 && page_size <= (1 << 20),
              "decode: ckv_cache page_size must be a power of two, got ", page_size);
  // A dimension of size 1 may have any stride (torch calls such a tensor contiguous): only index 0 is read.
  MLA_CHECK(block_table.dim() == 2 && block_table.size(0) == B && (block_table.stride(1) == 1 || block_table.size(1) <= 1),
              "decode: block_table must be (B, max_pages) int32 with unit last stride, got ", shape_str(block_table));
  MLA_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B && (cache_seqlens.stride(0) == 1 || B <= 1),
              "decode: cache_seqlens must be a contiguous int32 (B,) tensor, got ", shape_str(cache_seqlens));
  MLA_CHECK(out.dim() == 4 && out.size(0) == B && out.size(1) == Sq && out.size(2) == H && out.size(3) == mds::kDimCkv,
              "decode: out must be (B, Sq, H, 512), got ", shape_str(out));
  MLA_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H && lse.size(2) == Sq && lse.stride(2) == 1,
              "decode: lse must be (B, H, Sq) float32 with unit last stride, got ", shape_str(lse));

  auto check_rows = [](const at::Tensor& t, const char* name) {
    MLA_CHECK(t.stride(-1) == 1, "decode: ", name, " must have unit last-dim stride");
    for (int d = 0; d < t.dim() - 1; ++d)
      MLA_CHECK(t.size(d) == 1 || t.stride(d) % 8 == 0, "decode: ", name, " stride ", d, " (", t.stride(d),
                  ") must be a multiple of 8 elements");
    MLA_CHECK(aligned16(t), "decode: ", name, " must be 16-byte aligned");
  };
  check_rows(q_nope, "q_nope"); check_rows(q_pe, "q_pe"); check_rows(ckv_cache, "ckv_cache"); check_rows(kpe_cache, "kpe_cache");
  MLA_CHECK(out.stride(3) == 1, "decode: out must have unit last-dim stride");
  for (int d = 0; d < 3; ++d) MLA_CHECK(out.size(d) == 1 || out.stride(d) % 4 == 0, "decode: out stride ", d, " must be a multiple of 4");
  MLA_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 8 == 0, "decode: out must be 8-byte aligned");
  mla::check_softmax_scale(softmax_scale, "decode");
  MLA_CHECK(force_splits >= 0 && force_splits <= 4096, "decode: num_splits must be in [0, 4096]");
  check_options(opt, "decode");
  MLA_CHECK(B <= 60000, "decode: batch (", B, ") too large for one launch");
  if (schedule.has_value()) check_schedule_tensor(*schedule, dev);
  if (B == 0) {
    if (schedule.has_value()) check_schedule_size(*schedule, 0, B, Sq, H, force_splits);
    return {out, lse};
  }

  c10::cuda::CUDAGuard guard(dev);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  const mla::DeviceInfo& prop = mla::device_info(dev.index());
  MLA_CHECK(prop.major >= 8, "decode: mla_decode_sm80 needs compute capability >= 8.0, got major ", prop.major);

  // Launch shape from (B, Sq, H), the device and the options (the same function sizes decode_schedule).
  const LaunchShape ls = launch_shape(B, Sq, H, prop, force_splits, opt, "decode");
  // The warp-specialized kernel keeps 32-bit cache offsets: caches with larger strides take the all-warps
  // kernel instead. The schedule shape (num_parts, num_items) stays the one launch_shape chose, so a schedule
  // from decode_schedule() fits either kernel (any complete schedule is correct for any of them).
  const bool strides32 = std::max({ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1)}) <= INT32_MAX;
  const bool ws = ls.ws && strides32;
  const int stages = ws ? ls.ws_stages : ls.stages;
  MLA_CHECK(stages >= mds::kMinStages, "decode: not enough shared memory per block (",
              prop.smem_optin, " B) for the m_tile ", ls.m_tile, " kernel");
  const int64_t rows = ls.rows, num_items = ls.num_items;
  const int m_tile = ls.m_tile, num_mblocks = ls.num_mblocks;
  if (schedule.has_value()) check_schedule_size(*schedule, ls.sched_numel(), B, Sq, H, force_splits);

  // Workspace (sized from shapes only), one allocation: without a caller's schedule first the int32 schedule
  // that the metadata kernel (or the inline scheduler) fills below, padded to 256 bytes; then the float32
  // split partials, O (num_items, rows, 512) and LSE (num_items, rows). Every part starts 256-byte aligned.
  const int64_t ws_o_numel = num_items * rows * mds::kDimCkv, ws_lse_numel = num_items * rows;
  const int64_t own_sched_numel = schedule.has_value() ? 0 : (ls.sched_numel() + 63) / 64 * 64;
  static_assert(sizeof(float) == sizeof(int), "the schedule shares the float32 workspace");
  at::Tensor workspace = at::empty({own_sched_numel + ws_o_numel + ws_lse_numel}, q_nope.options().dtype(at::kFloat));
  float* const ws_base = workspace.data_ptr<float>() + own_sched_numel;
  int* const sched_ptr = schedule.has_value() ? schedule->data_ptr<int>()
                                              : reinterpret_cast<int*>(workspace.data_ptr<float>());

  mds::DecodeParams p{};
  p.q_nope = q_nope.data_ptr(); p.q_pe = q_pe.data_ptr();
  p.qn_batch_stride = q_nope.stride(0); p.qn_row_stride = q_nope.stride(1); p.qn_head_stride = q_nope.stride(2);
  p.qp_batch_stride = q_pe.stride(0); p.qp_row_stride = q_pe.stride(1); p.qp_head_stride = q_pe.stride(2);
  p.ckv = ckv_cache.data_ptr(); p.kpe = kpe_cache.data_ptr();
  p.ckv_page_stride = ckv_cache.stride(0); p.ckv_row_stride = ckv_cache.stride(1);
  p.kpe_page_stride = kpe_cache.stride(0); p.kpe_row_stride = kpe_cache.stride(1);
  p.block_table = block_table.data_ptr<int>(); p.bt_batch_stride = block_table.stride(0);
  p.max_pages = int(block_table.size(1));
  p.num_pages = int(std::min<int64_t>(P, INT32_MAX));  // block_table entries are int32: no id reaches past that
  p.kv_capacity = int(std::min<int64_t>(int64_t(p.max_pages) * page_size, INT32_MAX));
  p.seqlens = cache_seqlens.data_ptr<int>();
  p.out = out.data_ptr(); p.o_batch_stride = out.stride(0); p.o_row_stride = out.stride(1); p.o_head_stride = out.stride(2);
  p.lse = lse.data_ptr<float>(); p.lse_batch_stride = lse.stride(0); p.lse_head_stride = lse.stride(1);
  p.ws_o = ws_base; p.ws_lse = ws_base + ws_o_numel;
  p.sched_items = sched_ptr; p.sched_reqs = p.sched_items + num_items * 4;
  p.num_items = int(num_items); p.num_parts = ls.num_parts;
  p.min_tiles = ls.min_tiles;
  p.force_splits = int(force_splits);
  p.batch = int(B); p.seqlen_q = int(Sq); p.hq = int(H);
  p.page_size = int(page_size);
  int lg = 0; while ((int64_t(1) << lg) < page_size) ++lg;
  p.log2_page = lg;
  p.num_mblocks = num_mblocks; p.stages = stages; p.ws = ws ? 1 : 0;
  p.groups = ls.groups ? 1 : 0;
  // The wgmma kernel reads the caches by TMA: 16-byte aligned bases and strides, pages of at least 8 rows (a box of
  // min(page, 32) rows per 64-column group).
  auto tma_ok = [](const at::Tensor& t) {
    return aligned16(t) && (t.stride(0) * 2) % 16 == 0 && (t.stride(1) * 2) % 16 == 0 &&
           t.stride(0) < (int64_t(1) << 38) && t.stride(1) < (int64_t(1) << 38);
  };
  p.wgmma = ls.wgmma && page_size >= mla_decode_sm90::DecodeSm90Config::kMinPageSize && P >= 1 &&
            tma_ok(ckv_cache) && tma_ok(kpe_cache) ? 1 : 0;
  // Programmatic dependent launch (sm_90+): main and merge kernels start while their predecessor finishes.
  p.pdl = (prop.major >= 9 && opt.pdl) ? 1 : 0;
  p.scale_log2 = float(softmax_scale * 1.4426950408889634);
  p.causal = causal;

  const bool bf16 = dt == at::kBFloat16;
  // No schedule given: small batches schedule inline (each main-kernel CTA finds its own item, the same one the
  // metadata kernel would write); larger ones run the metadata kernel first.
  p.sched_inline = !schedule.has_value() && B <= mds::kInlineScheduleMaxBatch ? 1 : 0;
  // Per-CTA timer stamps of the main kernel's (m-block, item) grid: null unless built with -DMLA_DECODE_STAMPS.
  MLA_CUDA_CHECK(mds::stamps_for_launch(int64_t(num_mblocks) * num_items, stream, &p.stamps),
                 "mla_decode_sm80: stamp buffer");
  if (!schedule.has_value() && !p.sched_inline) {
    MLA_CUDA_CHECK(mds::launch_metadata(p, stream), "mla_decode_sm80: metadata kernel launch");
  }
  // With a precomputed schedule the main kernel is still a programmatic dependent (p.pdl) of whatever
  // kernel precedes it on the stream (another layer's merge kernel, an unrelated op, or the metadata kernel
  // of decode_schedule). Its griddepcontrol.wait (work_item, kernel.cuh) waits until that prerequisite grid
  // has completed and its writes are visible, and returns at once when there is none (no kernel before it,
  // or a predecessor that already finished); a predecessor that never calls launch_dependents only lets it
  // launch at completion. The schedule was written by a metadata kernel earlier on this stream (the stream
  // orders it, or the caller's event does when it came from another stream), so it is complete when read.
  MLA_CUDA_CHECK(mds::launch_decode(p, m_tile, bf16, stream), "mla_decode_sm80: main kernel launch (m_tile ", m_tile,
                 ws ? ", warp-specialized" : "", ")");
  MLA_CUDA_CHECK(mds::launch_combine(p, bf16, prop.sm_count, stream), "mla_decode_sm80: merge kernel launch");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> decode(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& ckv_cache,
                                          const at::Tensor& kpe_cache, const at::Tensor& block_table,
                                          const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& out,
                                          const c10::optional<at::Tensor>& lse, double softmax_scale, bool causal,
                                          const c10::optional<at::Tensor>& schedule) {
  return decode_impl(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, out, lse, softmax_scale, causal, 0, schedule,
              kAutoLaunch);
}

// Same as decode(), with every non-empty request split into `num_splits` KV ranges (tests of the merge path).
void decode_splits(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& ckv_cache,
                   const at::Tensor& kpe_cache, const at::Tensor& block_table, const at::Tensor& cache_seqlens,
                   at::Tensor out, at::Tensor lse, double softmax_scale, bool causal, int64_t num_splits,
                   const c10::optional<at::Tensor>& schedule) {
  MLA_CHECK(num_splits >= 1, "decode_splits: num_splits must be >= 1");
  decode_impl(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, out, lse, softmax_scale, causal, num_splits,
              schedule, kAutoLaunch);
}

// decode() (num_splits = 0) or decode_splits() launched with `options` instead of the automatic choices (tests,
// benchmarks); a schedule must come from decode_schedule_with_options() with the same options and num_splits.
void decode_with_options(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& ckv_cache,
                         const at::Tensor& kpe_cache, const at::Tensor& block_table, const at::Tensor& cache_seqlens,
                         at::Tensor out, at::Tensor lse, double softmax_scale, bool causal, const LaunchOptions& options,
                         int64_t num_splits, const c10::optional<at::Tensor>& schedule) {
  decode_impl(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, out, lse, softmax_scale, causal, num_splits,
              schedule, options);
}

// Arguments of decode_schedule() / schedule_numel() that fix the schedule's shape; fn names the caller.
void check_schedule_args(const char* fn, int64_t batch, int64_t seqlen_q, int64_t num_heads, int64_t num_splits) {
  MLA_CHECK(batch >= 0 && batch <= 60000, fn, ": batch (", batch, ") must be in [0, 60000] for one launch");
  MLA_CHECK(seqlen_q >= 1 && seqlen_q <= 65536, fn, ": seqlen_q must be in [1, 65536], got ", seqlen_q);
  MLA_CHECK(num_heads >= 1 && num_heads <= 65536, fn, ": num_heads must be in [1, 65536], got ", num_heads);
  MLA_CHECK(num_splits >= 0 && num_splits <= 4096, fn, ": num_splits must be in [0, 4096], got ", num_splits);
}

// The split-KV schedule of decode(..., schedule=) for calls with these lengths, Sq new tokens and H heads
// (num_splits > 0: of decode_splits with that num_splits), computed by the metadata kernel on the current
// stream into a new int32 tensor of launch_shape(...).sched_numel() elements. One schedule serves every
// call with the same cache_seqlens values and (B, Sq, H) on this device (all layers of a decode step); it
// must be recomputed whenever the lengths change. B == 0: an empty tensor (decode does nothing then).
at::Tensor schedule_impl(const at::Tensor& cache_seqlens, int64_t seqlen_q, int64_t num_heads, int64_t num_splits,
                         const LaunchOptions& opt) {
  MLA_CHECK(cache_seqlens.is_cuda(), "decode_schedule: cache_seqlens must be a CUDA tensor, got ",
              cache_seqlens.device().str());
  MLA_CHECK(cache_seqlens.scalar_type() == at::kInt, "decode_schedule: cache_seqlens must be int32, got ",
              cache_seqlens.scalar_type());
  MLA_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.stride(0) == 1,
              "decode_schedule: cache_seqlens must be a contiguous int32 (B,) tensor, got ", shape_str(cache_seqlens));
  const int64_t B = cache_seqlens.size(0);
  check_schedule_args("decode_schedule", B, seqlen_q, num_heads, num_splits);
  check_options(opt, "decode_schedule");
  const auto dev = cache_seqlens.device();
  const auto opts = cache_seqlens.options().dtype(at::kInt);
  if (B == 0) return at::empty({0}, opts);

  c10::cuda::CUDAGuard guard(dev);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  const mla::DeviceInfo& prop = mla::device_info(dev.index());
  MLA_CHECK(prop.major >= 8, "decode_schedule: mla_decode_sm80 needs compute capability >= 8.0, got major ", prop.major);
  const LaunchShape ls = launch_shape(B, seqlen_q, num_heads, prop, num_splits, opt, "decode_schedule");
  at::Tensor sched = at::empty({ls.sched_numel()}, opts);

  // Only what the metadata kernel reads: lengths, B, the part count and split sizes, the two outputs.
  mds::DecodeParams p{};
  p.seqlens = cache_seqlens.data_ptr<int>();
  p.kv_capacity = INT32_MAX;  // no block_table here: decode clamps the schedule's ranges to its own capacity
  p.batch = int(B); p.seqlen_q = int(seqlen_q); p.hq = int(num_heads);
  p.sched_items = sched.data_ptr<int>(); p.sched_reqs = p.sched_items + ls.num_items * 4;
  p.num_items = int(ls.num_items); p.num_parts = ls.num_parts; p.min_tiles = ls.min_tiles;
  p.force_splits = int(num_splits);
  p.pdl = (prop.major >= 9 && opt.pdl) ? 1 : 0;
  MLA_CUDA_CHECK(mds::launch_metadata(p, stream), "mla_decode_sm80: decode_schedule: metadata kernel launch");
  return sched;
}

at::Tensor decode_schedule(const at::Tensor& cache_seqlens, int64_t seqlen_q, int64_t num_heads, int64_t num_splits) {
  return schedule_impl(cache_seqlens, seqlen_q, num_heads, num_splits, kAutoLaunch);
}

// The schedule of decode_with_options(..., options, num_splits) (tests, benchmarks).
at::Tensor decode_schedule_with_options(const at::Tensor& cache_seqlens, int64_t seqlen_q, int64_t num_heads,
                                        const LaunchOptions& options, int64_t num_splits) {
  return schedule_impl(cache_seqlens, seqlen_q, num_heads, num_splits, options);
}

// Elements of decode_schedule()'s result for these shapes on CUDA device `device` (no launch): the size the
// fake of mla_autograd::mla_decode_schedule reports, from the same launch_shape().
int64_t schedule_numel(int64_t batch, int64_t seqlen_q, int64_t num_heads, int64_t device, int64_t num_splits) {
  check_schedule_args("schedule_numel", batch, seqlen_q, num_heads, num_splits);
  if (batch == 0) return 0;
  return launch_shape(batch, seqlen_q, num_heads, mla::device_info(int(device)), num_splits, kAutoLaunch, "schedule_numel")
      .sched_numel();
}

// Which main kernel a decode call of these shapes launches on `device` (with these options; default: the
// automatic launch of decode()), with the launch shape (for tests and benchmarks). "warp_specialized" falls back
// to "all_warps" at decode time when a cache stride exceeds 32 bits. 64-row tiles: "all_warps_wide_groups" (the
// row-group kernel) or "all_warps_narrow" (the all-warps kernel with four QK warps); on 9.0 "wgmma_sm90" (the Hopper
// kernel, which falls back to the row-group kernel at decode time for caches TMA cannot read).
py::dict launch_info(int64_t batch, int64_t seqlen_q, int64_t num_heads, int64_t device, const LaunchOptions& options) {
  MLA_CHECK(batch >= 1 && seqlen_q >= 1 && num_heads >= 1, "launch_info: batch, seqlen_q and num_heads must be >= 1");
  check_options(options, "launch_info");
  const LaunchShape ls = launch_shape(batch, seqlen_q, num_heads, mla::device_info(int(device)), 0, options, "launch_info");
  const char* kernel = ls.ws ? "warp_specialized"
                     : ls.m_tile < 64 ? "all_warps"
                     : ls.wgmma ? "wgmma_sm90"
                     : ls.groups ? "all_warps_wide_groups" : "all_warps_narrow";
  py::dict d;
  d["kernel"] = kernel;
  d["m_tile"] = ls.m_tile;
  d["num_mblocks"] = ls.num_mblocks;
  d["stages"] = ls.ws ? ls.ws_stages : ls.stages;
  d["tokens_per_step"] = ls.wgmma ? mla_decode_sm90::DecodeSm90Config::kBlockN
                        : ls.groups ? mds::GroupsConfig::kBN : mds::kBlockN;
  d["ctas_per_sm"] = ls.ctas;
  d["num_parts"] = ls.num_parts;
  return d;
}

at::Tensor read_stamps() {
  long long ctas = 0;
  unsigned long long* ptr = mds::stamps_last(&ctas);
  if (ptr == nullptr || ctas == 0) return at::empty({0, mds::kStampSlots}, at::TensorOptions().dtype(at::kLong));
  std::vector<int64_t> host(size_t(ctas) * mds::kStampSlots);
  MLA_CUDA_CHECK(cudaDeviceSynchronize(), "mla_decode_sm80: read_stamps: synchronising");
  MLA_CUDA_CHECK(cudaMemcpy(host.data(), ptr, host.size() * sizeof(int64_t), cudaMemcpyDeviceToHost),
                 "mla_decode_sm80: read_stamps: copying the stamps");
  return at::tensor(host, at::TensorOptions().dtype(at::kLong)).view({ctas, mds::kStampSlots});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Weight-absorbed MLA decode (mma.sync / cp.async / ldmatrix; sm_80 and sm_90)";
  py::class_<LaunchOptions>(m, "LaunchOptions",
                            "launch options of decode_with_options / decode_schedule_with_options / launch_info "
                            "(tests, benchmarks); the defaults are decode()'s automatic launch")
      .def(py::init([](int stages, int ctas_per_sm, bool warp_specialized, bool groups, bool pdl, bool wgmma) {
             return LaunchOptions{stages, ctas_per_sm, warp_specialized, groups, pdl, wgmma};
           }),
           py::arg("stages") = 0, py::arg("ctas_per_sm") = 0, py::arg("warp_specialized") = true,
           py::arg("groups") = true, py::arg("pdl") = true, py::arg("wgmma") = true)
      .def_readwrite("stages", &LaunchOptions::stages)
      .def_readwrite("ctas_per_sm", &LaunchOptions::ctas_per_sm)
      .def_readwrite("warp_specialized", &LaunchOptions::warp_specialized)
      .def_readwrite("groups", &LaunchOptions::groups)
      .def_readwrite("pdl", &LaunchOptions::pdl)
      .def_readwrite("wgmma", &LaunchOptions::wgmma)
      .def("__repr__", [](const LaunchOptions& o) {
        return "LaunchOptions(stages=" + std::to_string(o.stages) + ", ctas_per_sm=" + std::to_string(o.ctas_per_sm) +
               ", warp_specialized=" + (o.warp_specialized ? "True" : "False") + ", groups=" +
               (o.groups ? "True" : "False") + ", pdl=" + (o.pdl ? "True" : "False") +
               ", wgmma=" + (o.wgmma ? "True" : "False") + ")";
      });
  m.def("decode", &decode,
        "decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, out, lse, softmax_scale, causal, "
        "schedule=None) -> (out, lse); out and lse may be None (then allocated here); schedule: from "
        "decode_schedule(cache_seqlens, seqlen_q, num_heads) (skips the metadata kernel)",
        py::arg("q_nope"), py::arg("q_pe"), py::arg("ckv_cache"), py::arg("kpe_cache"), py::arg("block_table"),
        py::arg("cache_seqlens"), py::arg("out"), py::arg("lse"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("schedule") = py::none());
  m.def("decode_splits", &decode_splits, "decode() with a forced number of KV splits per request (tests)",
        py::arg("q_nope"), py::arg("q_pe"), py::arg("ckv_cache"), py::arg("kpe_cache"), py::arg("block_table"),
        py::arg("cache_seqlens"), py::arg("out"), py::arg("lse"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("num_splits"), py::arg("schedule") = py::none());
  m.def("decode_with_options", &decode_with_options,
        "decode() (num_splits=0) or decode_splits() launched with these LaunchOptions (tests, benchmarks); schedule: "
        "from decode_schedule_with_options with the same options and num_splits",
        py::arg("q_nope"), py::arg("q_pe"), py::arg("ckv_cache"), py::arg("kpe_cache"), py::arg("block_table"),
        py::arg("cache_seqlens"), py::arg("out"), py::arg("lse"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("options"), py::arg("num_splits") = 0, py::arg("schedule") = py::none());
  m.def("decode_schedule", &decode_schedule,
        "decode_schedule(cache_seqlens, seqlen_q, num_heads, num_splits=0) -> int32 schedule for decode(..., schedule=) "
        "(num_splits > 0: for decode_splits with that num_splits); recompute whenever cache_seqlens changes",
        py::arg("cache_seqlens"), py::arg("seqlen_q"), py::arg("num_heads"), py::arg("num_splits") = 0);
  m.def("decode_schedule_with_options", &decode_schedule_with_options,
        "the schedule of decode_with_options(..., options, num_splits) (tests, benchmarks)",
        py::arg("cache_seqlens"), py::arg("seqlen_q"), py::arg("num_heads"), py::arg("options"),
        py::arg("num_splits") = 0);
  m.def("schedule_numel", &schedule_numel, "int32 elements of decode_schedule()'s result on CUDA device `device`",
        py::arg("batch"), py::arg("seqlen_q"), py::arg("num_heads"), py::arg("device"), py::arg("num_splits") = 0);
  m.def("launch_info", &launch_info,
        "launch_info(batch, seqlen_q, num_heads, device, options=LaunchOptions()) -> dict: the main kernel a decode "
        "call of these shapes runs (kernel, m_tile, num_mblocks, stages, tokens_per_step, ctas_per_sm, num_parts)",
        py::arg("batch"), py::arg("seqlen_q"), py::arg("num_heads"), py::arg("device"),
        py::arg("options") = LaunchOptions{});
  m.def("read_stamps", &read_stamps,
        "read_stamps() -> int64 (CTAs, 8) per-CTA timer stamps of the last decode call (mla_decode_sm80_stamps.h: "
        "StampSlot order), or an empty tensor unless the module was built with -DMLA_DECODE_STAMPS "
        "(tools/decode_stamps.py)");
  // True only in a module built with -DMLA_DECODE_QK_MBAR (tools/sanitize_small.py --qk-mbar): the warp-specialized
  // kernel's QK warps then sync on an mbarrier, which compute-sanitizer racecheck follows.
  m.attr("qk_mbar") = py::bool_(mds::qk_mbar_build());
}
