// Host-side check (no GPU needed) of the address formulas that the kernel (fmha_bwd_sm90_common.cuh) uses to
// keep its smem store addresses out of registers: the dQ block stores (store_dq_block: two bases +
// compile-time offsets) and the swapped schedule's dS^T pair stores (one base, XOR of the 16-byte
// unit index, + 1024 for row + 8). For every consumer thread it compares the formula with CuTe's own
// partition (&tdSsdS0(i), &tdSsdS1(i)) and with dq_store_pos of each chunk, and the postprocess's inverse
// (dq_vec_col) against dq_store_pos.
// Built and run by tests/test_fmha_bwd_sm90_host.py (CI has nvcc but no GPU). By hand, from the repo root:
//   SP=<site-packages>; nvcc -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -Icsrc -I$SP/cutlass_library/source/include tests/sm90/fmha_bwd_sm90_addr_check.cu -o /tmp/addr_check
//   /tmp/addr_check   # prints "ALL OK"
#include "sm90/fmha_bwd/fmha_bwd_sm90_kernel.cuh"
#include <cstdio>
using namespace fmha_bwd_sm90;
using namespace cute;

template <class Tr>
int check_dq() {
  constexpr int BM = Tr::BM, D = Tr::D;
  int bad = 0;
  typename Tr::TiledMmadQ mma_dq;
  for (int tidx = 0; tidx < 256; ++tidx) {
    auto thr_dq = mma_dq.get_thread_slice(tidx);
    Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<BM>, Int<D>>{});
    constexpr int kChunks = decltype(size<0, 2>(tdQrdQ))::value;
    auto cd00 = tdQcdQ(make_coord(make_coord(0, 0, 0), 0, 0));
    const int r0 = get<0>(cd00), c0 = get<1>(cd00);
    const int even = dq_base_even<D>(0, r0, c0), odd = dq_base_odd<D>(0, r0, c0);  // the kernel's own expressions
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < kChunks; j += 2) {
        auto cc = make_coord(make_coord(0, h, j), 0, 0);
        const int row = get<0>(tdQcdQ(cc)), col = get<1>(tdQcdQ(cc));
        const int dr = row - r0, dc = col - c0;
        const int ref = row * D + dq_store_pos(row, col);
        const int got = dq_chunk_addr<D>(even, odd, dr, dc);
        // the 4 values of the float4 are columns col, col+1, col+8, col+9: their dq_store_pos are ref..ref+3
        const int c4[4] = {col, col + 1, col + 8, col + 9};
        for (int e = 0; e < 4; ++e) if (row * D + dq_store_pos(row, c4[e]) != ref + e) ++bad;
        if (ref != got || (dr & 1) || (dc & 15)) { if (bad < 5) printf("dq mismatch t=%d h=%d j=%d ref=%d got=%d\n", tidx, h, j, ref, got); ++bad; }
      }
  }
  // the postprocess's inverse: vector c4 of stored row r holds columns dq_vec_col(r, c4) + {0, 1, 8, 9}
  for (int r = 0; r < BM; ++r)
    for (int c4 = 0; c4 < D / 4; ++c4) {
      const int col = dq_vec_col(r, c4), cols[4] = {col, col + 1, col + 8, col + 9};
      for (int e = 0; e < 4; ++e)
        if (dq_store_pos(r, cols[e]) != 4 * c4 + e) { if (bad < 5) printf("dq_vec_col mismatch r=%d c4=%d e=%d\n", r, c4, e); ++bad; }
    }
  printf("dQ D=%d: %d bad\n", D, bad);
  return bad;
}

template <class Tr>
int check_ds() {
  using Element = typename Tr::Element;
  using SS = typename Tr::SharedStorage;
  int bad = 0;
  const uintptr_t smem0 = 0x400;  // 1024-aligned smem window start, like the kernel's extern array
  Element* dst = reinterpret_cast<Element*>(smem0 + offsetof(SS, dst));
  Element* pt = reinterpret_cast<Element*>(smem0 + offsetof(SS, pt));
  Tensor sdSt0 = make_tensor(make_smem_ptr(dst), typename Tr::SmemLayoutPt{});
  Tensor sdSt1 = make_tensor(make_smem_ptr(pt), typename Tr::SmemLayoutPt{});
  typename Tr::TiledMmaSdPt mma_sdp;
  for (int tidx = 0; tidx < 256; ++tidx) {
    auto thr_sdp = mma_sdp.get_thread_slice(tidx);
    Tensor t0 = thr_sdp.partition_C(sdSt0);
    Tensor t1 = thr_sdp.partition_C(sdSt1);
    Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<typename Tr::BNt, typename Tr::BMt>{});
    if (size(t0) != size(tdPrdP) || size(t0) != 32) { printf("size\n"); return 1; }
    for (int buf = 0; buf < 2; ++buf) {
      auto& t = buf ? t1 : t0;
      const uint32_t base = uint32_t(reinterpret_cast<uintptr_t>(&t(0)));
      for (int i = 0; i < 32; i += 2) {
        const int q = i / 2;
        const uint32_t ref = uint32_t(reinterpret_cast<uintptr_t>(&t(i)));
        const uint32_t ref1 = uint32_t(reinterpret_cast<uintptr_t>(&t(i + 1)));
        const uint32_t got = ds_pair_addr(base, q);
        if (ref != got || ref1 != ref + 2) { if (bad < 5) printf("ds mismatch t=%d buf=%d i=%d ref=%x got=%x\n", tidx, buf, i, ref, got); ++bad; }
      }
    }
  }
  printf("dS D=%d sizeof=%d: %d bad\n", Tr::D, int(sizeof(Element)), bad);
  return bad;
}

int main() {
  int bad = 0;
  bad += check_dq<Traits<cutlass::bfloat16_t, 192, 128>>();
  bad += check_dq<Traits<cutlass::bfloat16_t, 128, 128>>();
  bad += check_dq<Traits<cutlass::bfloat16_t, 64, 64>>();
  bad += check_ds<Traits<cutlass::bfloat16_t, 128, 128>>();
  bad += check_ds<Traits<cutlass::half_t, 128, 128>>();
  bad += check_ds<Traits<cutlass::bfloat16_t, 64, 64>>();
  bad += check_ds<Traits<cutlass::half_t, 64, 64>>();
  printf(bad ? "FAIL\n" : "ALL OK\n");
  return bad != 0;
}
