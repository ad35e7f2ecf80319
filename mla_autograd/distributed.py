"""Context parallelism: attention over a sequence sharded across the ranks of a torch.distributed group.

Each of the W ranks of ``group`` holds a part of the sequence dimension of q, k and v. The K/V blocks
travel around a ring (rank r sends to r + 1 and receives from r - 1): at step s rank r holds the block
of rank (r - s) mod W, attends its local queries to it with the package's attention op, and merges the
partial outputs by log-sum-exp. The backward runs the ring again with the final output and LSE;
dK/dV accumulate as they travel and arrive back at their owner after the last step. See
docs/distributed.md for the design.

Public API:
    shard(x, group, *, layout, dim) / unshard(x_local, group, *, layout, dim)
    context_parallel_attention(q, k, v, *, group, layout, causal, causal_align, softmax_scale, ...)
    context_parallel_mla_attention(q, kv_latent, k_pe, *, w_kv_b, group, num_heads, qk_nope_head_dim,
                                   v_head_dim, ...): the ring carries MLA's latent instead of K/V
    context_parallel_attention_varlen(...): not supported (raises NotImplementedError)

Layouts (the sequence of length S split over W ranks):
    "zigzag": S in 2W equal chunks; rank r holds chunks r and 2W - 1 - r, in that order. Under a causal
        mask every rank then does the same work (an early chunk, cheap, paired with a late one).
    "contiguous": S in W equal chunks; rank r holds chunk r. Under a causal mask rank W - 1 does W
        times the work of rank 0.

Eager only: the attention functions are excluded from torch.compile graphs (as by torch.compiler.disable),
so a compiled model breaks its graph around them.
"""
from __future__ import annotations

import struct

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import _ops, _validate as V

__all__ = ["LAYOUTS", "shard", "unshard", "context_parallel_attention", "context_parallel_mla_attention",
           "context_parallel_attention_varlen"]

LAYOUTS = ("zigzag", "contiguous")


# ---------------------------------------------------------------------------------------------- layouts

def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _num_chunks(layout: str, world: int) -> int:
    return 2 * world if layout == "zigzag" else world


def _chunks_of(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """Global chunk indices held by `rank`, in local order (ascending, which the block planner relies on)."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def _group_or_default(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                           "before using mla_autograd.distributed (group=None means the default group)")
    return dist.group.WORLD if group is None else group


def _check_dim(name: str, x: Tensor, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim = {dim} is out of range for {name} of shape {tuple(x.shape)} "
                         f"(expected -{x.dim()} <= dim < {x.dim()})")
    return dim % x.dim()


def shard(x: Tensor, group=None, *, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """This rank's part of a full-sequence tensor.

    Args:
        x: the full tensor, the same on every rank, e.g. (B, S, H, D) with the sequence in `dim`; any dtype
            and device.
        group: a torch.distributed process group (None: the default group); W = its size.
        layout: "zigzag" (S in 2W chunks, rank r keeps chunks r and 2W-1-r, concatenated in that order) or
            "contiguous" (S in W chunks, rank r keeps chunk r).
        dim: the sequence dimension (1 for (B, S, ...) tensors; negative values count from the end).

    Returns:
        A new tensor, x's shape with S / W in `dim` (with one rank: a copy of x, any S). Differentiable
        (narrow + cat).

    Raises ValueError when S is not divisible by 2W (zigzag) or W (contiguous), or for an unknown layout
    or an out-of-range dim.
    """
    dim, group, rank, world = _shard_args("x", x, group, layout, dim)
    if world == 1:
        return x.clone()
    n, S = _num_chunks(layout, world), x.shape[dim]
    if S % n:
        raise ValueError(f"x.shape[{dim}] = {S} (the sequence length) must be divisible by {n} "
                         f"({_divisor_words(layout)} for layout={layout!r} with world size {world})")
    c = S // n
    return torch.cat([x.narrow(dim, i * c, c) for i in _chunks_of(layout, rank, world)], dim=dim)


def _shard_args(name: str, x, group, layout: str, dim: int):
    """shard's / unshard's argument checks: (dim normalised, the group, this rank, the world size)."""
    V._check_tensor(name, x)
    _check_layout(layout)
    dim = _check_dim(name, x, dim)
    group = _group_or_default(group)
    return dim, group, dist.get_rank(group), dist.get_world_size(group)


def _divisor_words(layout: str) -> str:
    return "2 x world size" if layout == "zigzag" else "the world size"


def unshard(x_local: Tensor, group=None, *, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """Gather the parts made by `shard` back into the full tensor, on every rank (one all_gather).

    Args:
        x_local: this rank's part, e.g. (B, S / W, H, D); every rank's part must have the same shape,
            dtype and device (a device the group's backend serves).
        group, layout, dim: as given to `shard`.

    Returns:
        The full tensor (S in `dim`), ordered by global position. Not differentiable: the result does
        not require grad (use it for results and checks, not inside a training graph).
    """
    dim, group, rank, world = _shard_args("x_local", x_local, group, layout, dim)
    if world == 1:
        return x_local.detach().clone()
    per_rank = _num_chunks(layout, world) // world
    if x_local.shape[dim] % per_rank:
        raise ValueError(f"x_local.shape[{dim}] = {x_local.shape[dim]} must be even for layout='zigzag' "
                         f"(each rank holds two equal chunks)")
    part = x_local.detach().contiguous()
    parts = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(parts, part, group=group)
    c = part.shape[dim] // per_rank
    chunks = [None] * _num_chunks(layout, world)
    for r, p in enumerate(parts):
        for j, idx in enumerate(_chunks_of(layout, r, world)):
            chunks[idx] = p.narrow(dim, j * c, c)
    return torch.cat(chunks, dim=dim)


# ---------------------------------------------------------------------------------------------- the ring

class _Pending:
    """Posted sends/receives of one exchange; wait() returns the received tensors."""

    __slots__ = ("works", "recv", "sent")

    def __init__(self, works, recv, sent):
        self.works, self.recv, self.sent = works, recv, sent  # sent: kept alive until the sends complete

    def wait(self) -> list[Tensor]:
        for w in self.works:
            w.wait()
        self.sent = None
        return self.recv


class _Ring:
    """The ring over a process group: exchange() sends to rank + 1 and receives from rank - 1.

    The forward and backward drivers see only rank, world and exchange(), so they can also run over a
    ring simulated in one process.
    """

    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # P2POp takes global ranks
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def exchange(self, tensors: list[Tensor], tag: int) -> _Pending:
        """Post (without waiting) the send of `tensors` (contiguous) to the next rank and the receive of
        as many like-shaped tensors from the previous one. Tags keep concurrent exchanges apart (gloo
        matches messages by tag; NCCL orders them per peer)."""
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag + i) for i, t in enumerate(recv)]
        return _Pending(dist.batch_isend_irecv(ops), recv, tensors)


_TAG_KV, _TAG_GRAD = 0, 8  # the K/V (or latent) exchange and the travelling-gradient exchange


# ---------------------------------------------------------------------------------------------- blocks

def _block_plan(q_chunks: tuple[int, ...], k_chunks: tuple[int, ...], chunk: int,
                causal: bool) -> list[tuple[int, int, int, bool]]:
    """The attention calls of local queries (chunks q_chunks, each `chunk` rows) against a K/V block
    (chunks k_chunks, ascending), as (q_start, q_end, k_end, causal) in local rows: rows q_start:q_end
    attend keys 0:k_end of the block, with a bottom-right causal mask when the flag is set.

    In global positions a (query chunk i, key chunk j) pair of equal-size chunks is fully visible when
    j < i, diagonal (causal within the pair) when j == i, and hidden when j > i. Since k_chunks ascend,
    the keys a query chunk sees are a prefix of the block: the fully visible chunks, then the diagonal
    one if present, which bottom-right alignment of the prefix places exactly. Query chunks with the
    same fully-visible prefix share one call; hidden keys are never computed.
    """
    nq, nk = len(q_chunks) * chunk, len(k_chunks) * chunk
    if not causal:
        return [(0, nq, nk, False)]
    if tuple(q_chunks) == tuple(k_chunks):
        # The rank's own block: local order is global order for both, so the mask is causal in local rows.
        return [(0, nq, nk, True)]
    plan: list[tuple[int, int, int, bool]] = []
    for i, qi in enumerate(q_chunks):
        full = sum(1 for kj in k_chunks if kj < qi)
        diag = qi in k_chunks
        k_end = (full + diag) * chunk
        if k_end == 0:
            continue
        a, b = i * chunk, (i + 1) * chunk
        if plan and not diag and not plan[-1][3] and plan[-1][1] == a and plan[-1][2] == k_end:
            plan[-1] = (plan[-1][0], b, k_end, False)
        else:
            plan.append((a, b, k_end, diag))
    return plan


def _fwd_op(*tensors):
    return _ops._attn_fwd if _ops.eager_direct(*tensors) else torch.ops.mla_autograd.attn_fwd


def _bwd_op(*tensors):
    # with create_graph=True the op runs (and raises on double backward), as in attn_fwd's own backward
    direct = _ops.eager_direct(*tensors) and not torch.is_grad_enabled()
    return _ops._attn_bwd if direct else torch.ops.mla_autograd.attn_bwd


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _merge_(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """In place: (out_acc, lse_acc) <- the attention over the union of two disjoint key sets, from the
    partial results of each. out_acc (B, m, H, Dv) and lse_acc (B, H, m) in the compute dtype; out in
    any float dtype, lse (B, H, m). A row that sees no key in either (lse -inf in both) stays 0 / -inf."""
    new = torch.logaddexp(lse_acc, lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # -inf - -inf would be NaN
    w_acc = torch.exp(lse_acc - safe).transpose(1, 2).unsqueeze(-1)  # (B, m, H, 1)
    w_new = torch.exp(lse.to(new.dtype) - safe).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(w_acc).add_(out.to(out_acc.dtype) * w_new)
    lse_acc.copy_(new)


class _Geometry:
    """What the drivers need besides tensors: ring, layout, chunk size and mask."""

    __slots__ = ("ring", "layout", "chunk", "causal", "scale", "deterministic")

    def __init__(self, ring, layout, seqlen_local, causal, scale, deterministic):
        self.ring, self.layout, self.causal = ring, layout, causal
        self.chunk = seqlen_local // (_num_chunks(layout, ring.world) // ring.world)
        self.scale, self.deterministic = scale, deterministic

    def plan(self, step: int):
        r, W = self.ring.rank, self.ring.world
        src = (r - step) % W
        return _block_plan(_chunks_of(self.layout, r, W), _chunks_of(self.layout, src, W), self.chunk,
                           self.causal)


def _attend_block(q, k, v, plan, geo: _Geometry, acc):
    """Attention of the local queries against one K/V block, merged into acc = [out, lse] (or
    initialising it: the first block, the rank's own, always covers every query row in one call)."""
    fwd = _fwd_op(q, k, v)
    for a, b, e, cz in plan:
        o, l = fwd(q[:, a:b], k[:, :e], v[:, :e], None, None, b - a, e, geo.scale, cz, True)
        if acc[0] is None:
            assert (a, b) == (0, q.shape[1])
            acc[0], acc[1] = o.to(_compute_dtype(q)), l.to(_compute_dtype(q))
        else:
            _merge_(acc[0][:, a:b], acc[1][:, :, a:b], o, l)


def _block_grads(dout, q, k, v, out, lse, plan, geo: _Geometry, dq_acc, dk, dv) -> None:
    """Adds one K/V block's share of dq into dq_acc and its dk, dv into dk, dv (compute dtype). The
    FlashAttention backward of a block given the final out and lse is exactly that block's contribution:
    P = exp(s - lse) is the global softmax restricted to the block, and delta = rowsum(dout * out)
    involves only the final output."""
    bwd = _bwd_op(dout, q, k, v)
    for a, b, e, cz in plan:
        gq, gk, gv = bwd(dout[:, a:b], q[:, a:b], k[:, :e], v[:, :e], out[:, a:b], lse[:, :, a:b], None, None,
                         b - a, e, geo.scale, cz, True, geo.deterministic)
        dq_acc[:, a:b] += gq
        dk[:, :e] += gk
        dv[:, :e] += gv


def _padded(t: Tensor, shape) -> Tensor:
    """t (a prefix of the sequence dim) as a contiguous tensor of the full shape, zeros after."""
    if tuple(t.shape) == tuple(shape):
        return t.contiguous()
    full = t.new_zeros(shape)
    full[:, :t.shape[1]] = t
    return full


def _ring_forward(q, kv_local, geo: _Geometry, expand):
    """The forward ring. kv_local: the tensors that travel (contiguous); expand(tensors, k_end) -> (k, v)
    for keys 0:k_end of a block. Each step posts the exchange of the block before computing on it, so
    the transfer of the next block overlaps the attention on this one. Returns out (q's dtype) and lse
    (compute dtype), both in local row order."""
    ring = geo.ring
    acc = [None, None]
    cur = kv_local
    for step in range(ring.world):
        pending = ring.exchange(cur, _TAG_KV) if step < ring.world - 1 else None
        plan = geo.plan(step)
        if plan:
            k, v = expand(cur, max(e for _, _, e, _ in plan))
            _attend_block(q, k, v, plan, geo, acc)
        if pending is not None:
            cur = pending.wait()
    return acc[0].to(q.dtype), acc[1]


def _ring_backward(dout, q, out, lse, kv_local, geo: _Geometry, expand, block_grads):
    """The backward ring. Each step: post the exchange of the block for the next step, compute this
    block's gradients, add them to the travelling accumulator received from the previous rank (whose
    transfer overlapped the compute), and post that accumulator onward. After the last step the
    accumulators that arrive are this rank's own block's, complete.

    block_grads(cur, k, v, dk, dv, k_end) turns the block's dk/dv (compute dtype, keys 0:k_end) into
    its travelling gradients, one per tensor of `cur`, for keys 0:k_end (for the K/V ring, dk and dv
    themselves). Returns (dq, the home accumulators, shaped as kv_local, in the compute dtype)."""
    ring = geo.ring
    cd = _compute_dtype(q)
    dq = torch.zeros(q.shape, dtype=cd, device=q.device)
    cur = kv_local
    grad_pending = None
    for step in range(ring.world):
        pending = ring.exchange(cur, _TAG_KV) if step < ring.world - 1 else None
        plan = geo.plan(step)
        mine = None
        if plan:
            e = max(x[2] for x in plan)
            k, v = expand(cur, e)
            dk = torch.zeros(k.shape, dtype=cd, device=k.device)
            dv = torch.zeros(v.shape, dtype=cd, device=v.device)
            _block_grads(dout, q, k, v, out, lse, plan, geo, dq, dk, dv)
            mine = block_grads(cur, k, v, dk, dv, e)
        if grad_pending is None:  # step 0: the rank's own block, which always has work
            acc = [_padded(m, c.shape) for m, c in zip(mine, cur)]
        else:
            acc = grad_pending.wait()
            if mine is not None:
                for a, m in zip(acc, mine):
                    a[:, :m.shape[1]] += m
        grad_pending = ring.exchange(acc, _TAG_GRAD)
        if pending is not None:
            cur = pending.wait()
    return dq.to(q.dtype), grad_pending.wait()


# ------------------------------------------------------------------------------------- K/V ring (dense)

def _kv_expand(cur, e):
    k, v = cur
    return k[:, :e], v[:, :e]


def _kv_block_grads(cur, k, v, dk, dv, e):
    """dK/dV of a block travel as they are, in the compute dtype (float32 for 16-bit inputs)."""
    return [dk, dv]


class _RingAttentionFunction(torch.autograd.Function):
    """Context-parallel attention over local parts: forward and backward rings (see the module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, geo):
        kv = [k.contiguous(), v.contiguous()]  # send/recv need contiguous buffers
        out, lse = _ring_forward(q, kv, geo, _kv_expand)
        ctx.save_for_backward(q, kv[0], kv[1], out, lse)
        ctx.geo = geo
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, (dk, dv) = _ring_backward(dout, q, out, lse, [k, v], ctx.geo, _kv_expand, _kv_block_grads)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None


# ------------------------------------------------------------------------------------- latent ring (MLA)

class _LatentExpand:
    """Per-head K/V from MLA's latent, as MultiHeadLatentAttention._attend expands it: kv = latent @ w_kv_b^T
    viewed (B, S, H, nope + v), K = [k_nope, k_pe broadcast to every head], V."""

    def __init__(self, w_kv_b, num_heads, nope, dv):
        self.w, self.h, self.nope, self.dv = w_kv_b, num_heads, nope, dv
        self.dw = None  # compute-dtype accumulator of w_kv_b's gradient (backward)

    def __call__(self, cur, e):
        c, k_pe = cur[0][:, :e], cur[1][:, :e]  # (B, e, r), (B, e, Dr)
        kv = F.linear(c, self.w).view(*c.shape[:-1], self.h, self.nope + self.dv)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)
        k_pe = k_pe.unsqueeze(-2).expand(*k_pe.shape[:-1], self.h, k_pe.shape[-1])
        return torch.cat([k_nope, k_pe], dim=-1), v

    def block_grads(self, cur, k, v, dk, dv, e):
        """Back through the expansion of keys 0:e: d latent = dkv @ w_kv_b, d k_pe = sum over heads of
        dK's rope part, and this block's share of d w_kv_b = dkv^T @ latent (accumulated locally)."""
        c = cur[0][:, :e]
        B = c.shape[0]
        dkv = torch.cat([dk[..., :self.nope], dv], dim=-1).reshape(B, e, self.h * (self.nope + self.dv))
        dkv_w = dkv.to(self.w.dtype)  # GEMMs in the weights' dtype, as the expand-first path's autograd
        d_c = (dkv_w @ self.w).to(dk.dtype)
        d_pe = dk[..., self.nope:].sum(dim=-2)
        dw = dkv_w.reshape(-1, dkv_w.shape[-1]).t() @ c.reshape(-1, c.shape[-1])
        self.dw = dw.to(dk.dtype) if self.dw is None else self.dw.add_(dw)
        return [d_c, d_pe]


class _LatentRingAttentionFunction(torch.autograd.Function):
    """Context-parallel MLA attention whose ring carries the latent and the shared rope key."""

    @staticmethod
    def forward(ctx, q, kv_latent, k_pe, w_kv_b, geo, num_heads, nope, dv):
        cur = [kv_latent.contiguous(), k_pe.contiguous()]
        out, lse = _ring_forward(q, cur, geo, _LatentExpand(w_kv_b, num_heads, nope, dv))
        ctx.save_for_backward(q, cur[0], cur[1], w_kv_b, out, lse)
        ctx.args = (geo, num_heads, nope, dv)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, c, k_pe, w, out, lse = ctx.saved_tensors
        geo, num_heads, nope, dv = ctx.args
        ex = _LatentExpand(w, num_heads, nope, dv)
        dq, (d_c, d_pe) = _ring_backward(dout, q, out, lse, [c, k_pe], geo, ex, ex.block_grads)
        dw = torch.zeros_like(w) if ex.dw is None else ex.dw.to(w.dtype)
        return dq, d_c.to(c.dtype), d_pe.to(k_pe.dtype), dw, None, None, None, None


# ---------------------------------------------------------------------------------------------- checks

_AGREED: set = set()  # (group id, signature) already checked against the other ranks


def _check_ranks_agree(group, device: torch.device, fields: list[tuple[str, object]]) -> None:
    """Compare this call's shape metadata with every rank's, once per (group, signature): one all_gather
    of a few int64s and a host read at the first call of each signature, nothing after. A call whose
    signature a rank has seen before is not checked again on that rank, so a rank that changes its
    shapes alone after a first consistent call is not detected (the ring then fails or hangs in the
    backend, as any mismatched collective does)."""
    values = []
    for _, val in fields:
        values.append(struct.unpack("<q", struct.pack("<d", val))[0] if isinstance(val, float) else int(val))
    key = (id(group), tuple(values))
    if key in _AGREED:
        return
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    for i, (name, _) in enumerate(fields):
        seen = [row[i] for row in rows]
        if any(x != seen[0] for x in seen):
            bad = next(r for r, x in enumerate(seen) if x != seen[0])
            show = (lambda x: struct.unpack("<d", struct.pack("<q", x))[0]) if isinstance(fields[i][1], float) \
                else (lambda x: x)
            raise ValueError(f"ranks disagree on {name}: rank 0 has {show(seen[0])}, rank {bad} has "
                             f"{show(seen[bad])}; every rank of the group must pass parts of the same "
                             f"shapes and the same options")
    _AGREED.add(key)


_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


def _check_local_lengths(q: Tensor, k: Tensor, kname: str, layout: str, world: int) -> None:
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q has local sequence length {q.shape[1]} but {kname} has {k.shape[1]}: q and "
                         f"{kname} must be parts of the same sharded sequence (equal global lengths; "
                         f"attention of a query suffix to a longer key sequence is not supported here)")
    if layout == "zigzag" and world > 1 and q.shape[1] % 2:
        raise ValueError(f"q.shape[1] = {q.shape[1]} (the local sequence length) must be even for "
                         f"layout='zigzag': each rank holds two equal chunks of the sequence")


# ---------------------------------------------------------------------------------------------- public

# torch.compiler.disable at the first call rather than at import: applying it imports torch._dynamo,
# seconds of import time that a process not using torch.compile would pay for nothing.
_eager_only = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


@_eager_only
def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, layout: str = "zigzag",
                               causal: bool = False, causal_align: str = "bottom_right",
                               softmax_scale: float | None = None, deterministic: bool = False,
                               return_lse: bool = False):
    """`mla_autograd.attention` over a sequence sharded across the ranks of `group` (ring attention).

    Every rank passes its own part (from `shard` with the same layout) of q, k and v of one sequence
    of global length S; the result is this rank's part of ``attention(q_full, k_full, v_full, ...)``,
    and so are the gradients (through autograd) of q, k and v.

    Args:
        q: (B, S_local, Hq, Dqk), this rank's part of the queries; dtypes and head dims as
            `mla_autograd.attention` takes them (kernels on GPU, the reference path elsewhere).
        k: (B, S_local, Hkv, Dqk), same sharding; Hq must be a multiple of Hkv (GQA/MQA).
        v: (B, S_local, Hkv, Dv).
            Last-dim stride 1. S_local = S / W (zigzag: even, two chunks of S / 2W).
        group: the process group (None: the default group); every rank of it must call this with the
            same shapes, dtype and options. A group of one rank runs plain `attention`. With NCCL, set
            each rank's device (torch.cuda.set_device) first, as batch_isend_irecv requires.
        layout: "zigzag" or "contiguous", as given to `shard`.
        causal: causal mask over global positions (query i sees keys j <= i).
        causal_align: "bottom_right" or "top_left", validated and otherwise without effect: q and k are
            parts of one sequence, so Sq == Sk globally and both alignments give the same mask. Local
            lengths of q and k must be equal (a ValueError otherwise), which with the same layout and
            group makes the global lengths equal.
        softmax_scale: default 1/sqrt(Dqk).
        deterministic: passed to every block's backward (the ring's summation order is fixed).
        return_lse: also return lse.

    Returns:
        out (B, S_local, Hq, Dv) in q's dtype; with return_lse also lse (B, Hq, S_local), float32
        (float64 for float64 inputs), of the global softmax, not differentiable.

    Cost per rank, forward: W - 1 transfers of its K/V part (Hkv * (Dqk + Dv) values per token) to the
    next rank, each overlapping one block of attention; backward: as many K/V transfers plus W of the
    travelling dK/dV (in float32 for 16-bit inputs, float64 for float64). Partial outputs are merged in
    float32 (float64). Blocks the causal mask hides are not computed.

    Packed variable-length batches are not supported (see `context_parallel_attention_varlen`).
    """
    V.check_attention(q, k, v)
    _check_layout(layout)
    scale = V.softmax_scale_or_default(softmax_scale, q.shape[-1])
    V.causal_bottom_right(causal_align)
    group = _group_or_default(group)
    world = dist.get_world_size(group)
    _check_local_lengths(q, k, "k", layout, world)
    if world == 1:
        from .functional import attention
        return attention(q, k, v, causal=causal, causal_align=causal_align, softmax_scale=scale,
                         deterministic=deterministic, return_lse=return_lse)
    _check_ranks_agree(group, q.device, [
        ("q.shape[0] (batch)", q.shape[0]), ("q.shape[1] (local sequence length)", q.shape[1]),
        ("q.shape[2] (query heads)", q.shape[2]), ("q.shape[3] (Dqk)", q.shape[3]),
        ("k.shape[2] (key/value heads)", k.shape[2]), ("v.shape[3] (Dv)", v.shape[3]),
        ("dtype code", _DTYPE_CODES[q.dtype]), ("layout", LAYOUTS.index(layout)), ("causal", bool(causal)),
        ("softmax_scale", scale), ("kind (0: attention, 1: mla)", 0)])
    geo = _Geometry(_Ring(group), layout, q.shape[1], bool(causal), scale, bool(deterministic))
    out, lse = _RingAttentionFunction.apply(q, k, v, geo)
    return (out, lse) if return_lse else out


@_eager_only
def context_parallel_mla_attention(q: Tensor, kv_latent: Tensor, k_pe: Tensor, *, w_kv_b: Tensor, group=None,
                                   num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                                   layout: str = "zigzag", causal: bool = False,
                                   softmax_scale: float | None = None, deterministic: bool = False,
                                   return_lse: bool = False):
    """Context-parallel MLA attention whose ring carries the latent instead of per-head K/V.

    Equals expanding the local latent to per-head keys and values (as
    ``MultiHeadLatentAttention._attend``: ``kv = kv_latent @ w_kv_b.T`` viewed (B, S, H, nope + v),
    ``K = [k_nope, k_pe broadcast to every head]``, ``V``) and calling `context_parallel_attention`
    on them; differentiable w.r.t. q, kv_latent, k_pe and w_kv_b.

    Args:
        q: (B, S_local, H, nope + rope), this rank's queries (the rope part already rotated).
        kv_latent: (B, S_local, r), this rank's normalized latent (kv_a_layernorm's output).
        k_pe: (B, S_local, 1, rope) or (B, S_local, rope), this rank's rotated shared rope key.
        w_kv_b: (H * (nope + v), r), kv_b_proj.weight.
            All four of one dtype and device; the sequence parts made by `shard` with `layout`.
        group: the process group (None: the default group); a group of one rank expands and runs plain
            `attention`.
        num_heads, qk_nope_head_dim, v_head_dim: H, nope, v.
        layout, causal, softmax_scale, deterministic, return_lse: as in `context_parallel_attention`
            (softmax_scale defaults to 1/sqrt(nope + rope); MultiHeadLatentAttention uses its
            `softmax_scale`, YaRN's mscale included).

    Returns:
        out (B, S_local, H, v) in q's dtype [, lse (B, H, S_local)].

    The gradient of w_kv_b on each rank is the share of the key blocks this rank attended to; the sum
    over the group equals the sum of the expand-first path's per-rank gradients (and the full-sequence
    gradient). Weights replicated over the context-parallel group need their gradients summed (or
    averaged) over it anyway, as DDP and FSDP do; per-rank values differ between the two paths.

    Bytes per token and ring step: the latent ring sends r + rope values (576 at DeepSeek's r = 512,
    rope = 64: 1152 bytes in bf16), the K/V ring H * (nope + rope + v) (40960 at H = 128, nope = 128,
    rope = 64, v = 128: 80 KiB in bf16), 71x more. The backward sends the gradients of what travels, in
    float32: 2304 bytes per token instead of 160 KiB. The price is recomputing the expansion of every
    visiting block (a GEMM of 2 * r * H * (nope + v) flops per key, about 409.6 / S_local of the block's
    attention flops at DeepSeek's dims, more under a causal mask) in the forward, and in the backward
    the expansion again plus the two GEMMs of its gradient. It pays when the K/V transfer would not hide
    behind a block's attention (short local parts, slow links between nodes); see docs/distributed.md.
    """
    for n, t, rank in (("q", q, 4), ("kv_latent", kv_latent, 3), ("w_kv_b", w_kv_b, 2)):
        V._check_tensor(n, t, rank)
    V._check_tensor("k_pe", k_pe)
    V._check_float("q", q)
    for n, t in (("kv_latent", kv_latent), ("k_pe", k_pe), ("w_kv_b", w_kv_b)):
        V._same(n, t, "q", q)
    for n, val in (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim)):
        if V._check_count(n, val) == 0:
            raise ValueError(f"{n} must be positive, got {val}")
    B, S, H, dqk = q.shape
    rope = dqk - qk_nope_head_dim
    if H != num_heads:
        raise ValueError(f"q has {H} heads (q.shape[2]) but num_heads = {num_heads}")
    if rope <= 0:
        raise ValueError(f"q head dim {dqk} must exceed qk_nope_head_dim = {qk_nope_head_dim} (q is [q_nope, q_pe])")
    if k_pe.dim() == 4 and k_pe.shape[2] == 1:
        k_pe = k_pe.squeeze(2)  # one rope key shared by all heads
    if k_pe.dim() != 3 or k_pe.shape[-1] != rope:
        raise ValueError(f"k_pe must be (B, S_local, 1, {rope}) or (B, S_local, {rope}) (rope dim = q head dim "
                         f"{dqk} - qk_nope_head_dim {qk_nope_head_dim}), got shape {tuple(k_pe.shape)}")
    r = kv_latent.shape[-1]
    if tuple(w_kv_b.shape) != (H * (qk_nope_head_dim + v_head_dim), r):
        raise ValueError(f"w_kv_b must be (num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank) = "
                         f"({H * (qk_nope_head_dim + v_head_dim)}, {r}), got {tuple(w_kv_b.shape)}")
    for n, t in (("kv_latent", kv_latent), ("k_pe", k_pe)):
        if t.shape[0] != B:
            raise ValueError(f"{n} batch size {t.shape[0]} must equal q batch size {B}")
    for n, t in (("q", q), ("kv_latent", kv_latent), ("k_pe", k_pe), ("w_kv_b", w_kv_b)):
        V._check_last_stride(n, t)
    _check_layout(layout)
    scale = V.softmax_scale_or_default(softmax_scale, dqk)
    group = _group_or_default(group)
    world = dist.get_world_size(group)
    _check_local_lengths(q, kv_latent, "kv_latent", layout, world)
    _check_local_lengths(q, k_pe, "k_pe", layout, world)
    if world == 1:
        from .functional import attention
        k, v = _LatentExpand(w_kv_b, H, qk_nope_head_dim, v_head_dim)([kv_latent, k_pe], S)
        return attention(q, k, v, causal=causal, softmax_scale=scale, deterministic=deterministic,
                         return_lse=return_lse)
    _check_ranks_agree(group, q.device, [
        ("q.shape[0] (batch)", B), ("q.shape[1] (local sequence length)", S), ("q.shape[2] (heads)", H),
        ("q.shape[3] (nope + rope)", dqk), ("kv_latent.shape[2] (kv_lora_rank)", r),
        ("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim),
        ("dtype code", _DTYPE_CODES[q.dtype]), ("layout", LAYOUTS.index(layout)), ("causal", bool(causal)),
        ("softmax_scale", scale), ("kind (0: attention, 1: mla)", 1)])
    geo = _Geometry(_Ring(group), layout, S, bool(causal), scale, bool(deterministic))
    out, lse = _LatentRingAttentionFunction.apply(q, kv_latent, k_pe, w_kv_b, geo, H, qk_nope_head_dim,
                                                  v_head_dim)
    return (out, lse) if return_lse else out


def context_parallel_attention_varlen(*args, **kwargs):
    """Not supported: context parallelism over packed variable-length batches (cu_seqlens) would need
    each document split across the ranks and per-block masks that follow document boundaries. Raises
    NotImplementedError; shard dense (B, S, ...) batches and use `context_parallel_attention`."""
    raise NotImplementedError("context parallelism over packed variable-length sequences (cu_seqlens) is not "
                              "supported; use context_parallel_attention on dense (B, S, H, D) parts")
