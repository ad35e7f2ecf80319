#!/usr/bin/env python
"""Context-parallel attention with mla_autograd.distributed, checked against the unsharded computation.

Every rank builds the same seeded full-sequence tensors, keeps its zigzag part (`shard`), runs causal
ring attention forward and backward on its part, and the parts are gathered (`unshard`) and compared
on rank 0 with `mla_autograd.attention` on the whole sequence. Then the same for MLA with the latent
ring (`context_parallel_mla_attention`), against expanding the latent to per-head K/V first.

    torchrun --nproc-per-node 2 examples/context_parallel.py          # GPUs: NCCL, bf16, DeepSeek head dims
    torchrun --nproc-per-node 2 examples/context_parallel.py --tiny   # CPU: gloo, float32, small sizes

On GPUs the results must be within 2x the error of the unsharded kernel call (both against a float32
reference computation, FlashAttention's rule); on the CPU they must match to float32 rounding. Prints
"context_parallel: OK" on rank 0 when every check passes.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import mla_autograd as M  # noqa: E402
from mla_autograd.distributed import (context_parallel_attention, context_parallel_mla_attention,  # noqa: E402
                                      shard, unshard)
from mla_autograd.testing import assert_error_within  # noqa: E402


def _check(name, got, ref, low, exact):
    """got and low (the unsharded result in the same dtype) against ref (float32 or better)."""
    if exact:
        torch.testing.assert_close(got.float(), ref.float(), atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    else:
        assert_error_within(got, ref, low, name=name, eps=1e-4)
    err = (got.double() - ref.double()).abs().max().item()
    if exact:  # the reference is the unsharded computation itself
        print(f"  {name:>12}: max |cp - unsharded| {err:.2e}")
    else:
        print(f"  {name:>12}: max |cp - float32 reference| {err:.2e} "
              f"(unsharded kernel: {(low.double() - ref.double()).abs().max():.2e})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small sizes (CPU)")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--seqlen", type=int, default=None, help="global sequence length")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"],
                   help="cuda: NCCL, bf16; cpu: gloo, float32 (default: cuda when there is a GPU)")
    args = p.parse_args(argv)

    cuda = args.device == "cuda" if args.device else torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    owner = not dist.is_initialized()  # main() may also run inside a caller's process group (the tests)
    if owner:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:  # the reference path serves the CPU: expected, no need to say so on every rank
        warnings.filterwarnings("ignore", message="mla_autograd.*reference path")
    if args.tiny or not cuda:
        B, S, H, Hkv, nope, rope, dv, r = 1, 16 * world, 4, 2, 16, 8, 16, 32
    else:
        B, S, H, Hkv, nope, rope, dv, r = 1, 4096 * world, 16, 16, 128, 64, 128, 512
    S = args.seqlen or S
    dqk = nope + rope
    exact = dtype == torch.float32
    g = torch.Generator(device=dev).manual_seed(0)  # the same full tensors on every rank

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    if rank == 0:
        print(f"world {world}, backend {dist.get_backend()}, {dtype}, layout {args.layout}: B={B} S={S} "
              f"(S/rank={S // world}) H={H} Hkv={Hkv} dims {dqk}/{dv}")

    # ---- attention on K/V: the ring carries K and V
    q, k, v, dout = randn(B, S, H, dqk), randn(B, S, Hkv, dqk), randn(B, S, Hkv, dv), randn(B, S, H, dv)
    parts = [shard(t, layout=args.layout).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*parts, layout=args.layout, causal=True)
    out.backward(shard(dout, layout=args.layout))
    got = [unshard(t, layout=args.layout) for t in (out, *(x.grad for x in parts))]
    if rank == 0:
        print("context_parallel_attention (causal):")
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        low = M.attention(*full, causal=True)
        low_grads = torch.autograd.grad(low, full, dout)
        hi = [t.float().requires_grad_() for t in (q, k, v)]
        ref = M.attention(*hi, causal=True)
        ref_grads = torch.autograd.grad(ref, hi, dout.float())
        for name, a, rf, lo in zip(("out", "dq", "dk", "dv"), got, (ref, *ref_grads), (low, *low_grads)):
            _check(name, a, rf.detach(), lo.detach(), exact)

    # ---- MLA: the ring carries the latent (r) and the shared rope key, K/V are expanded on arrival
    q = randn(B, S, H, dqk)
    c, k_pe = randn(B, S, r), randn(B, S, 1, rope)
    w = randn(H * (nope + dv), r, scale=r ** -0.5)
    dout = randn(B, S, H, dv)
    mla = dict(num_heads=H, qk_nope_head_dim=nope, v_head_dim=dv, layout=args.layout, causal=True)
    parts = [shard(t, layout=args.layout).requires_grad_() for t in (q, c, k_pe)]
    w_local = w.clone().requires_grad_()
    out = context_parallel_mla_attention(*parts, w_kv_b=w_local, **mla)
    out.backward(shard(dout, layout=args.layout))
    got = [unshard(t, layout=args.layout) for t in (out, *(x.grad for x in parts))]
    dw = w_local.grad.float()
    dist.all_reduce(dw)  # each rank holds its share of the replicated weight's gradient: sum over the group
    got.append(dw.to(dtype))
    if rank == 0:
        print("context_parallel_mla_attention (causal, latent ring):")

        def expand_attend(qq, cc, pe, ww):
            kv = torch.nn.functional.linear(cc, ww).view(B, S, H, nope + dv)
            kn, vv = kv.split([nope, dv], dim=-1)
            return M.attention(qq, torch.cat([kn, pe.expand(B, S, H, rope)], dim=-1), vv, causal=True)
        full = [t.clone().requires_grad_() for t in (q, c, k_pe, w)]
        low = expand_attend(*full)
        low_grads = torch.autograd.grad(low, full, dout)
        hi = [t.float().requires_grad_() for t in (q, c, k_pe, w)]
        ref = expand_attend(*hi)
        ref_grads = torch.autograd.grad(ref, hi, dout.float())
        for name, a, rf, lo in zip(("out", "dq", "dkv_latent", "dk_pe", "dw_kv_b"), got, (ref, *ref_grads),
                                   (low, *low_grads)):
            _check(name, a, rf.detach(), lo.detach(), exact)
        print("context_parallel: OK")
    dist.barrier()
    if owner:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
