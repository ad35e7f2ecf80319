"""mla_autograd.distributed: context-parallel attention against single-process attention on the full sequence.

Most cases run inside two spawned gloo groups (world sizes 2 and 4, CPU, float64 through the reference path):
every rank builds the same seeded full-sequence inputs, computes the full-sequence reference itself, and
compares its part of the outputs and gradients. Spawning costs seconds, so each group runs every case and
reports each one separately. The ring drivers are also run over a ring simulated with threads in one
process (CPU here; CUDA kernels in bf16 under the gpu marker).
"""
from __future__ import annotations

import collections
import datetime
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mla_autograd as M
from mla_autograd import distributed as D
from mla_autograd.testing import assert_error_within, naive_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _my_chunks(x, rank, world, layout, dim=1):
    """This rank's part, written independently of D.shard: global positions of the chunks it holds."""
    n = 2 * world if layout == "zigzag" else world
    c = x.shape[dim] // n
    idx = [rank, 2 * world - 1 - rank] if layout == "zigzag" else [rank]
    pos = torch.cat([torch.arange(i * c, (i + 1) * c) for i in idx])
    return x.index_select(dim, pos.to(x.device))


def _randn(g, *shape, dtype=F64, device="cpu"):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def _expand(c, k_pe, w, H, nope, dv):
    """MLA's expansion, as MultiHeadLatentAttention._attend makes it, for (B, S, r) latents and (B, S, 1, rope) keys."""
    kv = torch.nn.functional.linear(c, w).view(*c.shape[:-1], H, nope + dv)
    k_nope, v = kv.split([nope, dv], dim=-1)
    return torch.cat([k_nope, k_pe.expand(*k_pe.shape[:2], H, k_pe.shape[-1])], dim=-1), v


# ------------------------------------------------------------------------------------------- spawned cases

def _attention_case(group, layout, causal, hq=4, hkv=2, scale=None, B=2, chunk=3, dims=(8, 6), seed=0,
                    strided=False):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(seed)
    S = 2 * W * chunk
    q = _randn(g, B, S, hq, dims[0]).requires_grad_()
    k = _randn(g, B, S, hkv, dims[0]).requires_grad_()
    v = _randn(g, B, S, hkv, dims[1]).requires_grad_()
    dout = _randn(g, B, S, hq, dims[1])
    ref, ref_lse = M.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)

    leaves = [D.shard(t.detach(), group, layout=layout).requires_grad_() for t in (q, k, v)]
    # strided: views into wider rows (last stride 1, others not the dense ones), as a caller's split makes
    parts = [torch.cat([t, torch.zeros_like(t)], dim=-1)[..., :t.shape[-1]] for t in leaves] if strided else leaves
    if strided:
        assert not any(t.is_contiguous() for t in parts)
    # group=None (the default group) on even ranks when the group is the whole world: the same group
    as_given = None if rank % 2 == 0 and W == dist.get_world_size() else group
    out, lse = D.context_parallel_attention(*parts, group=as_given, layout=layout, causal=causal,
                                            softmax_scale=scale, return_lse=True)
    grads = torch.autograd.grad(out, leaves, _my_chunks(dout, rank, W, layout))
    torch.testing.assert_close(out, _my_chunks(ref.detach(), rank, W, layout), **TOL)
    torch.testing.assert_close(lse, _my_chunks(ref_lse, rank, W, layout, dim=2), **TOL)
    for name, a, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, _my_chunks(r, rank, W, layout), **TOL, msg=lambda m: f"d{name}: {m}")
    plain = D.context_parallel_attention(*(t.detach() for t in parts), group=group, layout=layout, causal=causal,
                                         softmax_scale=scale)
    torch.testing.assert_close(plain, out.detach(), atol=0, rtol=0)  # return_lse=False: out alone, the same


def _case_independent_reference(group):
    """The full-sequence reference itself against plain softmax(QK^T)V (testing.naive_attention)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = _randn(g, 1, 8, 2, 4), _randn(g, 1, 8, 1, 4), _randn(g, 1, 8, 1, 3)
    parts = [D.shard(t, group) for t in (q, k, v)]
    out = D.context_parallel_attention(*parts, group=group, causal=True)
    naive = naive_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, _my_chunks(naive, dist.get_rank(group), dist.get_world_size(group), "zigzag"),
                               **TOL)


def _mla_case(group, layout, causal):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    B, S, H, r, nope, rope, dv = 2, 2 * W * 2, 2, 12, 6, 4, 5
    g = torch.Generator().manual_seed(11)
    q = _randn(g, B, S, H, nope + rope).requires_grad_()
    c = _randn(g, B, S, r).requires_grad_()
    k_pe = _randn(g, B, S, 1, rope).requires_grad_()
    w = (_randn(g, H * (nope + dv), r) / r ** 0.5).requires_grad_()
    dout = _randn(g, B, S, H, dv)
    scale = 0.37
    k, v = _expand(c, k_pe, w, H, nope, dv)
    ref = M.attention(q, k, v, causal=causal, softmax_scale=scale)
    ref_grads = torch.autograd.grad(ref, (q, c, k_pe, w), dout)
    my_dout = _my_chunks(dout, rank, W, layout)

    def local_inputs():
        return [D.shard(t.detach(), group, layout=layout).requires_grad_() for t in (q, c, k_pe)] + \
            [w.detach().clone().requires_grad_()]

    lq, lc, lpe, lw = local_inputs()
    # k_pe (B, S, 1, rope) or (B, S, rope): both are taken
    out, lse = D.context_parallel_mla_attention(lq, lc, lpe if causal else lpe.squeeze(2), w_kv_b=lw, group=group,
                                                num_heads=H, qk_nope_head_dim=nope, v_head_dim=dv, layout=layout,
                                                causal=causal, softmax_scale=scale, return_lse=True)
    grads = list(torch.autograd.grad(out, (lq, lc, lpe, lw), my_dout))

    eq, ec, epe, ew = local_inputs()  # expand locally, then the K/V ring
    ek, ev = _expand(ec, epe, ew, H, nope, dv)
    e_out, e_lse = D.context_parallel_attention(eq, ek, ev, group=group, layout=layout, causal=causal,
                                                softmax_scale=scale, return_lse=True)
    e_grads = list(torch.autograd.grad(e_out, (eq, ec, epe, ew), my_dout))

    torch.testing.assert_close(out, e_out, **TOL)
    torch.testing.assert_close(lse, e_lse, **TOL)
    torch.testing.assert_close(out, _my_chunks(ref.detach(), rank, W, layout), **TOL)
    for name, a, e, rf in zip(("dq", "dkv_latent", "dk_pe"), grads[:3], e_grads[:3], ref_grads[:3]):
        torch.testing.assert_close(a, e, **TOL, msg=lambda m: f"{name} vs expand-first: {m}")
        torch.testing.assert_close(a, _my_chunks(rf, rank, W, layout), **TOL, msg=lambda m: f"{name}: {m}")
    # w_kv_b: each path gives every rank a share; the sums over the group equal the full-sequence gradient.
    for name, dw in (("latent ring", grads[3]), ("expand-first", e_grads[3])):
        total = dw.clone()
        dist.all_reduce(total, group=group)
        torch.testing.assert_close(total, ref_grads[3], **TOL, msg=lambda m: f"dw_kv_b ({name}): {m}")


def _case_shard_roundtrip(group):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    x = torch.arange(2 * 2 * W * 3 * 5, dtype=F64).view(2, 2 * W * 3, 5)
    for layout in D.LAYOUTS:
        part = D.shard(x, group, layout=layout)
        assert torch.equal(part, _my_chunks(x, rank, W, layout)), layout
        assert torch.equal(D.unshard(part, group, layout=layout), x), layout
    y = x.transpose(1, 2).contiguous()  # sequence in dim 2 (= -1)
    for dim in (2, -1):
        part = D.shard(y, group, layout="zigzag", dim=dim)
        assert torch.equal(part, _my_chunks(y, rank, W, "zigzag", dim=2))
        assert torch.equal(D.unshard(part, group, layout="zigzag", dim=dim), y)
    xg = x.clone().requires_grad_()
    D.shard(xg, group).sum().backward()  # shard is differentiable: ones on this rank's positions
    assert torch.equal(xg.grad, torch.zeros_like(x).index_fill(1, _my_chunks(torch.arange(x.shape[1]), rank, W,
                                                                           "zigzag", dim=0), 1.0))


def _case_bad_inputs(group):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    x = torch.zeros(1, 2 * W * 2 + 1, 3)
    with pytest.raises(ValueError, match=r"x.shape\[1\] = .* divisible by %d .*2 x world size" % (2 * W)):
        D.shard(x, group)
    with pytest.raises(ValueError, match=r"x.shape\[1\] = .* divisible by %d .*the world size" % W):
        D.shard(torch.zeros(1, W * 2 + 1, 3), group, layout="contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        D.shard(torch.zeros(1, 2 * W, 3), group, layout="ring")
    with pytest.raises(ValueError, match="dim = 3 is out of range for x"):
        D.shard(torch.zeros(1, 2 * W, 3), group, dim=3)
    with pytest.raises(TypeError, match="dim must be an int"):
        D.shard(torch.zeros(1, 2 * W, 3), group, dim=1.0)
    with pytest.raises(ValueError, match=r"x_local.shape\[1\] = 3 must be even"):
        D.unshard(torch.zeros(1, 3, 2), group)
    q, k, v = torch.zeros(1, 4, 2, 8, dtype=F64), torch.zeros(1, 4, 2, 8, dtype=F64), torch.zeros(1, 4, 2, 8, dtype=F64)
    with pytest.raises(ValueError, match="layout must be one of"):
        D.context_parallel_attention(q, k, v, group=group, layout="striped")
    with pytest.raises(ValueError, match="q has local sequence length 4 but k has 6"):
        D.context_parallel_attention(q, torch.zeros(1, 6, 2, 8, dtype=F64), torch.zeros(1, 6, 2, 8, dtype=F64),
                                     group=group)
    with pytest.raises(ValueError, match=r"q.shape\[1\] = 3 .* must be even for layout='zigzag'"):
        D.context_parallel_attention(q[:, :3], k[:, :3], v[:, :3], group=group)
    with pytest.raises(ValueError, match="causal_align must be"):
        D.context_parallel_attention(q, k, v, group=group, causal=True, causal_align="center")
    with pytest.raises(ValueError, match="number of query heads"):
        D.context_parallel_attention(q[:, :, :1], k, v, group=group)
    with pytest.raises(NotImplementedError, match="variable-length"):
        D.context_parallel_attention_varlen(q, k, v)
    with pytest.raises(TypeError, match="cu_seqlens"):
        D.context_parallel_attention(q, k, v, group=group, cu_seqlens=torch.zeros(2, dtype=torch.int32))
    c, pe, w = torch.zeros(1, 4, 12, dtype=F64), torch.zeros(1, 4, 1, 4, dtype=F64), torch.zeros(2 * 11, 12, dtype=F64)
    mla = dict(group=group, num_heads=2, qk_nope_head_dim=4, v_head_dim=5)
    with pytest.raises(ValueError, match=r"w_kv_b must be .* = \(18, 12\)"):
        D.context_parallel_mla_attention(q, c, pe, w_kv_b=w, **mla)
    with pytest.raises(ValueError, match="q has 2 heads .* num_heads = 3"):
        D.context_parallel_mla_attention(q, c, pe, w_kv_b=w, **dict(mla, num_heads=3))
    with pytest.raises(ValueError, match="k_pe must be"):
        D.context_parallel_mla_attention(q, c, pe[..., :3], w_kv_b=w[:18], **mla)
    with pytest.raises(ValueError, match="q has local sequence length 4 but kv_latent has 2"):
        D.context_parallel_mla_attention(q, c[:, :2], pe, w_kv_b=w[:18], **mla)
    # shapes that differ across ranks: found by the first call's metadata all_gather, on every rank
    B = 2 if rank == W - 1 else 1
    qb = torch.zeros(B, 4, 2, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"ranks disagree on q.shape\[0\] \(batch\): rank 0 has 1, rank %d has 2"
                                         % (W - 1)):
        D.context_parallel_attention(qb, qb, qb, group=group)
    scale = 0.5 if rank == 0 else 0.25
    with pytest.raises(ValueError, match="ranks disagree on softmax_scale: rank 0 has 0.5, rank 1 has 0.25"):
        D.context_parallel_attention(q, k, v, group=group, softmax_scale=scale)


def _case_size_one_groups(group):
    """Groups of one rank: plain attention on the whole (unsharded) input, no ring."""
    rank, W = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(W)]  # every rank creates every group, in the same order
    mine = singles[rank]
    g = torch.Generator().manual_seed(3)
    q, k, v = (_randn(g, 2, 7, 2, 4).requires_grad_() for _ in range(3))  # odd S: no chunking with one rank
    assert torch.equal(D.shard(q, mine), q)
    out, lse = D.context_parallel_attention(q, k, v, group=mine, causal=True, return_lse=True)
    ref, ref_lse = M.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(torch.autograd.grad(out.sum(), q)[0], torch.autograd.grad(ref.sum(), q)[0])
    c, pe, w = _randn(g, 2, 7, 6), _randn(g, 2, 7, 1, 4 - 3), _randn(g, 2 * (3 + 2), 6)
    o1 = D.context_parallel_mla_attention(q, c, pe, w_kv_b=w, group=mine, num_heads=2, qk_nope_head_dim=3,
                                          v_head_dim=2, causal=True)
    k1, v1 = _expand(c, pe, w, 2, 3, 2)
    assert torch.equal(o1, M.attention(q, k1, v1, causal=True))


def _case_example(group):
    """examples/context_parallel.py's main() on this group (its launch by torchrun is not run here)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import context_parallel
    context_parallel.main(["--tiny", "--device", "cpu"])


def _cases():
    cases = collections.OrderedDict()
    for layout in D.LAYOUTS:
        for causal in (False, True):
            cases[f"{layout}-{'causal' if causal else 'full'}"] = \
                lambda grp, layout=layout, causal=causal: _attention_case(grp, layout, causal)
    cases["mha-zigzag-causal"] = lambda grp: _attention_case(grp, "zigzag", True, hq=2, hkv=2)
    cases["mqa-contiguous-causal-strided"] = lambda grp: _attention_case(grp, "contiguous", True, hq=3, hkv=1,
                                                                         strided=True)
    cases["scale-batch1-zigzag"] = lambda grp: _attention_case(grp, "zigzag", True, scale=0.3, B=1, chunk=1,
                                                               dims=(4, 4))
    cases["independent-reference"] = _case_independent_reference
    for layout, causal in (("zigzag", True), ("contiguous", False), ("contiguous", True)):
        cases[f"mla-{layout}-{'causal' if causal else 'full'}"] = \
            lambda grp, layout=layout, causal=causal: _mla_case(grp, layout, causal)
    cases["shard-roundtrip"] = _case_shard_roundtrip
    cases["bad-inputs"] = _case_bad_inputs
    cases["size-one-groups"] = _case_size_one_groups
    cases["example"] = _case_example
    return cases


CASES = list(_cases())
WORLD = 4
ONLY_WHOLE_WORLD = {"size-one-groups", "example"}  # they create groups, or use the default group, themselves


def _worker(rank, world, port, outdir):
    """One spawned world of four ranks: the world-size-2 cases run on two groups of two ranks at once
    ([0, 1] and [2, 3]: a ring whose peers are not global ranks 0 and 1), then the world-size-4 cases."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    results = {}
    try:
        for W, group in ((2, pairs[rank // 2]), (world, dist.group.WORLD)):
            for name, fn in _cases().items():
                if name in ONLY_WHOLE_WORLD and W != world:
                    continue
                try:
                    fn(group)
                    results[f"{W}-{name}"] = None
                except Exception:  # noqa: BLE001  (reported per case by the parent)
                    results[f"{W}-{name}"] = traceback.format_exc()
                dist.barrier()  # keep the ranks in step between cases
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Per-rank {"<world size>-<case>": None or the traceback}, from one spawn of WORLD processes."""
    outdir = str(tmp_path_factory.mktemp("cp"))
    # A fork server with torch imported: the children are forked from a fresh process that has run no autograd
    # and initialised no CUDA (a child forked from this test process would inherit autograd's worker threads
    # once any earlier test ran a backward, and torch refuses that), and they skip importing torch again
    # (seconds per process on a small machine). Spawn where there is no fork server.
    if "forkserver" in mp.get_all_start_methods():
        method = "forkserver"
        mp.get_context(method).set_forkserver_preload(["torch", "mla_autograd"])
    else:
        method = "spawn"
    mp.start_processes(_worker, args=(WORLD, _free_port(), outdir), nprocs=WORLD, join=True, start_method=method)
    per_rank = []
    for r in range(WORLD):
        with open(os.path.join(outdir, f"rank{r}.json")) as f:
            per_rank.append(json.load(f))
    return per_rank


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", [2, WORLD])
def test_spawned(world, case, spawned):
    if case in ONLY_WHOLE_WORLD and world != WORLD:
        pytest.skip(f"runs on the whole world of {WORLD} ranks only")
    key = f"{world}-{case}"
    failures = [f"rank {r}:\n{res.get(key, 'not run')}" for r, res in enumerate(spawned) if res.get(key, "x")]
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------- in one process

def test_lazy_export_and_no_dynamo_import():
    """mla_autograd.distributed is the module, and importing it does not import torch._dynamo (seconds)."""
    code = ("import sys, mla_autograd as M, mla_autograd.distributed as D; assert M.distributed is D; "
            "assert 'distributed' in M.__all__; assert 'torch._dynamo' not in sys.modules, 'dynamo imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert res.returncode == 0, res.stderr


def test_block_plan_matches_global_causal_mask():
    """Every (rank, visiting block) pair: the calls of the plan cover exactly the visible (query, key)
    positions of the global causal mask, each once; non-causal calls hold no hidden pair (hidden pairs
    occur only inside a causal call, whose kernel skips masked tiles), and a hidden block has no call."""
    for W in range(1, 6):
        for layout in D.LAYOUTS:
            c = 3
            n = 2 * W if layout == "zigzag" else W
            pos = torch.arange(n * c)
            for r in range(W):
                qpos = _my_chunks(pos, r, W, layout, dim=0)
                for s in range(W):
                    kpos = _my_chunks(pos, s, W, layout, dim=0)
                    want = kpos[None, :] <= qpos[:, None]
                    got = torch.zeros_like(want)
                    seen = 0
                    plan = D._block_plan(D._chunks_of(layout, r, W), D._chunks_of(layout, s, W), c, True)
                    for a, b, e, cz in plan:
                        i = torch.arange(b - a)[:, None]
                        j = torch.arange(e)[None, :]
                        vis = (j <= i + e - (b - a)) if cz else torch.ones(b - a, e, dtype=torch.bool)
                        got[a:b, :e] |= vis
                        seen += int(vis.sum())
                    assert torch.equal(got, want), (W, layout, r, s, plan)
                    assert seen == int(want.sum()), (W, layout, r, s, plan)  # no pair computed twice
                    if not want.any():
                        assert plan == [], (W, layout, r, s, plan)  # a hidden block: no call at all
                    full = D._block_plan(D._chunks_of(layout, r, W), D._chunks_of(layout, s, W), c, False)
                    assert full == [(0, len(qpos), len(kpos), False)]


@pytest.mark.parametrize("causal", [False, True])
def test_lse_merge_of_two_key_blocks_equals_one_call(causal):
    """Top-left causal with Sk > Sq: the first query rows see no key of the second block (lse -inf there)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = _randn(g, 2, 5, 4, 6), _randn(g, 2, 9, 2, 6), _randn(g, 2, 9, 2, 3)
    out, lse = M.attention(q, k, v, causal=causal, causal_align="top_left", return_lse=True)
    o1, l1 = M.attention(q, k[:, :4], v[:, :4], causal=causal, causal_align="top_left", return_lse=True)
    # keys 4:9 seen by query i iff 4 + j <= i: top-left alignment of the second block shifted by 4 keys
    scale = 6 ** -0.5
    s = torch.einsum("bihd,bjhd->bhij", q, k[:, 4:].repeat_interleave(2, dim=2)) * scale
    if causal:
        s = s.masked_fill(4 + torch.arange(5)[None, :] > torch.arange(5)[:, None], float("-inf"))
    l2 = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.exp(s - l2[..., None]), nan=0.0)
    o2 = torch.einsum("bhij,bjhd->bihd", p, v[:, 4:].repeat_interleave(2, dim=2))
    if causal:
        assert torch.isinf(l2).any()
    acc_o, acc_l = o1.clone(), l1.clone()
    D._merge_(acc_o, acc_l, o2, l2)
    torch.testing.assert_close(acc_o, out, **TOL)
    torch.testing.assert_close(acc_l, lse, **TOL)


class _ThreadRing:
    """A ring of `world` threads in one process, with the interface of distributed._Ring."""

    def __init__(self, rank, world, boxes, log=None):
        self.rank, self.world, self.boxes, self.log = rank, world, boxes, log

    def exchange(self, tensors, tag):
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        if self.log is not None:
            self.log.append(("exchange", tag))
        for i, t in enumerate(tensors):
            self.boxes[(self.rank, nxt, tag + i)].put(t.clone())
        boxes, rank, n = self.boxes, self.rank, len(tensors)

        class Pending:
            def wait(self_):
                return [boxes[(prv, rank, tag + i)].get(timeout=60) for i in range(n)]
        return Pending()


def _simulate(world, fn):
    boxes = collections.defaultdict(queue.Queue)
    res, errs = [None] * world, [None] * world

    def run(r):
        try:
            res[r] = fn(r, _ThreadRing(r, world, boxes))
        except BaseException as e:  # noqa: BLE001  (re-raised below)
            errs[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errs:
        if e is not None:
            raise e
    return res


def _drivers(rank, ring, full, layout, causal, scale):
    """The forward and backward ring drivers on this rank's parts of full = (q, k, v, dout)."""
    q, k, v, dout = (_my_chunks(t, rank, ring.world, layout).contiguous() for t in full)
    geo = D._Geometry(ring, layout, q.shape[1], causal, scale, False)
    out, lse = D._ring_forward(q, [k, v], geo, D._kv_expand)
    dq, (dk, dv) = D._ring_backward(dout, q, out, lse, [k, v], geo, D._kv_expand, D._kv_block_grads)
    return out, lse, dq, dk.to(k.dtype), dv.to(v.dtype)


@pytest.mark.parametrize("world", [3, 5])
@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_threaded_ring_odd_world_sizes(world, layout):
    g = torch.Generator().manual_seed(world)
    S = 2 * world * 2
    full = (_randn(g, 1, S, 2, 4), _randn(g, 1, S, 1, 4), _randn(g, 1, S, 1, 3), _randn(g, 1, S, 2, 3))
    qf, kf, vf = (t.clone().requires_grad_() for t in full[:3])
    ref, ref_lse = M.attention(qf, kf, vf, causal=True, return_lse=True)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), full[3])
    res = _simulate(world, lambda r, ring: _drivers(r, ring, full, layout, True, 0.5))
    for r, (out, lse, *grads) in enumerate(res):
        torch.testing.assert_close(out, _my_chunks(ref.detach(), r, world, layout), **TOL)
        torch.testing.assert_close(lse, _my_chunks(ref_lse, r, world, layout, dim=2), **TOL)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, _my_chunks(b, r, world, layout), **TOL)


def test_exchange_is_posted_before_the_compute(monkeypatch):
    """The transfer of the next block is posted before each step's attention (so it can overlap it), and
    hidden blocks are skipped: contiguous causal rank 0 computes only its own block."""
    world = 3
    log = {r: [] for r in range(world)}
    fwd, bwd = D._fwd_op, D._bwd_op
    ident = {}

    def logged(kind, op):
        def wrap(*args):
            log[ident[threading.get_ident()]].append((kind,))
            return op(*args)
        return wrap
    monkeypatch.setattr(D, "_fwd_op", lambda *t: logged("fwd", fwd(*t)))
    monkeypatch.setattr(D, "_bwd_op", lambda *t: logged("bwd", bwd(*t)))
    g = torch.Generator().manual_seed(0)
    full = tuple(_randn(g, 1, 6, 1, 4) for _ in range(4))

    def run(r, ring):
        ident[threading.get_ident()] = r
        ring.log = log[r]
        return _drivers(r, ring, full, "contiguous", True, 0.5)
    _simulate(world, run)
    kv, grad = ("exchange", D._TAG_KV), ("exchange", D._TAG_GRAD)
    # rank 0 sees only its own block (the others are hidden: skipped, but still forwarded)
    assert log[0] == [kv, ("fwd",), kv] + [kv, ("bwd",), grad, kv, grad, grad]
    # the last rank computes every block: exchange, then compute, at every step that has a next block
    assert log[2] == [kv, ("fwd",), kv, ("fwd",), ("fwd",)] + [kv, ("bwd",), grad, kv, ("bwd",), grad, ("bwd",),
                                                               grad]


# ------------------------------------------------------------------------------------------- GPU (kernels)

def _cuda_full(g, B, S, hq, hkv, dqk, dv):
    return (_randn(g, B, S, hq, dqk, dtype=torch.bfloat16, device="cuda"),
            _randn(g, B, S, hkv, dqk, dtype=torch.bfloat16, device="cuda"),
            _randn(g, B, S, hkv, dv, dtype=torch.bfloat16, device="cuda"),
            _randn(g, B, S, hq, dv, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_ring_through_kernels_bf16(world, layout, causal):
    """W ranks simulated by threads on one GPU, kernels in bf16: outputs and gradients within 2x the
    error of plain bf16 PyTorch on the full sequence, against float64."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    B, S, hq, hkv, dqk, dv = 1, 2 * world * 128, 8, 2, 192, 128
    full = _cuda_full(g, B, S, hq, hkv, dqk, dv)
    scale = dqk ** -0.5
    warm = [t.clone().requires_grad_() for t in full[:3]]
    M.attention(*warm, causal=causal).float().sum().backward()  # loads both kernel families before the threads
    res = _simulate(world, lambda r, ring: _drivers(r, ring, full, layout, causal, scale))
    # every rank's part in rank order (each in its local order); lse has the sequence in dim 2
    parts = [torch.cat([x[i] for x in res], dim=2 if i == 1 else 1) for i in range(5)]
    order = torch.cat([_my_chunks(torch.arange(S), r, world, layout, dim=0) for r in range(world)]).cuda()

    q64, k64, v64 = (t.double().requires_grad_() for t in full[:3])
    ref, ref_lse = M.attention(q64, k64, v64, causal=causal, return_lse=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), full[3].double())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in full[:3])
    low = naive_attention(ql, kl, vl, causal=causal)
    low_grads = torch.autograd.grad(low, (ql, kl, vl), full[3])

    def pick(t, dim=1):
        return t.index_select(dim, order)
    assert_error_within(parts[0], pick(ref), pick(low), name="out")
    torch.testing.assert_close(parts[1].double(), pick(ref_lse, 2), atol=1e-3, rtol=0)
    for name, a, r, b in zip(("dq", "dk", "dv"), parts[2:], ref_grads, low_grads):
        assert_error_within(a, pick(r), pick(b), name=name, eps=1e-4)


@pytest.mark.gpu
def test_lse_merge_of_two_key_blocks_equals_one_call_bf16():
    g = torch.Generator().manual_seed(1)
    q, k, v, _ = _cuda_full(g, 2, 384, 8, 8, 192, 128)
    h = 256
    o1, l1 = M.attention(q, k[:, :h], v[:, :h], return_lse=True)
    o2, l2 = M.attention(q, k[:, h:], v[:, h:], return_lse=True)
    acc_o, acc_l = o1.float(), l1.clone()
    D._merge_(acc_o, acc_l, o2, l2)
    one, one_lse = M.attention(q, k, v, return_lse=True)
    ref, ref_lse = M.attention(q.double(), k.double(), v.double(), return_lse=True)
    assert_error_within(acc_o, ref, naive_attention(q, k, v), name="merged out")
    assert_error_within(acc_o, ref, one, name="merged out vs one kernel call")
    torch.testing.assert_close(acc_l.double(), ref_lse, atol=1e-3, rtol=0)
    torch.testing.assert_close(acc_l, one_lse, atol=1e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_example_runs_on_two_gpus_with_nccl():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), os.path.join(ROOT, "examples", "context_parallel.py")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "context_parallel: OK" in res.stdout, res.stdout + res.stderr
