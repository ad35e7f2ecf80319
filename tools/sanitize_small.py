"""Small cases of every kernel that runs on this GPU, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python tools/sanitize_small.py
    compute-sanitizer --tool racecheck python tools/sanitize_small.py
    compute-sanitizer --tool racecheck python tools/sanitize_small.py --decode-only [--qk-mbar]
    python tools/sanitize_small.py --qk-mbar --build-only   # build the --qk-mbar module first, outside the tool
    compute-sanitizer --tool memcheck python tools/sanitize_small.py --attention-only   # no decode (nor its build)

Through the public API: SM90 forward and backward (dense GQA with ragged lengths and bottom-right
causal mask, and varlen with an empty sequence) and the SM80-style decode over a NaN-poisoned paged
cache, each checked loosely against the reference so a silent failure under the tool shows. Then the
values that break the rules, with no value checks (the default): every case of
mla_autograd.testing.BAD_VARLEN_CASES (negative, decreasing, past the end, longer than max_seqlen, int32
extremes, a max_seqlen past int32, overlapping) forward and backward, and testing.bad_decode_case (negative,
oversized and INT32_MAX lengths, page ids -1, past num_pages and INT32_MIN) with and without a schedule, for 1
and 2 new tokens and 16 and 128 heads; under memcheck they must show no error. Prints the backend of each
call; exits non-zero if any result is wrong. --attention-only: the attention cases alone (no decode build).

--qk-mbar: the decode calls run a mla_decode_sm80 module built with -DMLA_DECODE_QK_MBAR, in a cache of its own
beside the normal one (the build fingerprint does not see NVCC_APPEND_FLAGS; the normal cache is never touched):
the warp-specialized kernel's QK warps then sync on an mbarrier (same results bit for bit, 3% slower); with the
normal build's named barrier racecheck loses track of the QK -> PV hand-offs and reports 2-3 false hazards
(tools/racecheck_probe.cu, modes 5 and 6).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mla_autograd as M  # noqa: E402
from mla_autograd import reference  # noqa: E402
from mla_autograd import testing as T  # noqa: E402
from mla_autograd.testing import random_paged_cache  # noqa: E402


def _close(name, a, r, tol=5e-2):
    err = (a.float() - r.float()).abs().max().item()
    ok = err <= tol * max(1.0, r.float().abs().max().item())
    print(f"{name}: max err {err:.3e} {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def _reference(q, k, v, dout, scale, **kw):
    """float32 reference out and (dq, dk, dv) on the same 16-bit inputs."""
    qf, kf, vf = (t.detach().float() for t in (q, k, v))
    out, lse = reference.attention_forward(qf, kf, vf, softmax_scale=scale, **kw)
    return out, reference.attention_backward(dout.float(), qf, kf, vf, out, lse, softmax_scale=scale, **kw)


def _attention_cases(dev, dt, g) -> bool:
    ok = True
    for d, dv in ((192, 128), (64, 64)):
        q = torch.randn(1, 70, 2, d, device=dev, dtype=dt, generator=g).requires_grad_()
        k = torch.randn(1, 133, 1, d, device=dev, dtype=dt, generator=g).requires_grad_()
        v = torch.randn(1, 133, 1, dv, device=dev, dtype=dt, generator=g).requires_grad_()
        e = M.explain(q, k, v, causal=True)
        print(f"d={d}/{dv}: forward {e.forward.backend}, backward {e.backward.backend}", flush=True)
        out = M.attention(q, k, v, causal=True, causal_align="bottom_right")
        dout = torch.randn(out.shape, device=dev, dtype=dt, generator=g)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref, refs = _reference(q, k, v, dout, d ** -0.5, causal=True, bottom_right=True)
        ok &= _close("  out", out, ref)
        for n, a, r in zip(("dq", "dk", "dv"), grads, refs):
            ok &= _close(f"  {n}", a, r)
    # varlen with an empty sequence
    lens = [5, 0, 77]
    cu = torch.tensor([0, 5, 5, 82], dtype=torch.int32, device=dev)
    q = torch.randn(82, 4, 128, device=dev, dtype=dt, generator=g).requires_grad_()
    k = torch.randn(82, 2, 128, device=dev, dtype=dt, generator=g).requires_grad_()
    v = torch.randn(82, 2, 128, device=dev, dtype=dt, generator=g).requires_grad_()
    out = M.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref, refs = _reference(q, k, v, torch.ones_like(out), 128 ** -0.5, causal=True, bottom_right=False,
                           cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    ok &= _close("varlen out", out, ref)
    for n, a, r in zip(("dq", "dk", "dv"), grads, refs):
        ok &= _close(f"varlen {n}", a, r)
    return ok


def _bad_varlen_cases(dev, dt) -> bool:
    """The rule-breaking cu_seqlens / max_seqlen (testing.BAD_VARLEN_CASES): no fault; results against the
    repaired problems."""
    ok = True
    tq, tk = T.BAD_VARLEN_ROWS
    g = torch.Generator(device=dev).manual_seed(2)
    for case in T.BAD_VARLEN_CASES:
        q = torch.randn(tq, 4, 192, device=dev, dtype=dt, generator=g).requires_grad_()
        k = torch.randn(tk, 2, 192, device=dev, dtype=dt, generator=g).requires_grad_()
        v = torch.randn(tk, 2, 128, device=dev, dtype=dt, generator=g).requires_grad_()
        dout = torch.randn(tq, 4, 128, device=dev, dtype=dt, generator=g)
        cq, ck = (torch.tensor(c, dtype=torch.int32, device=dev) for c in (case.cu_q, case.cu_k))
        out = M.attention_varlen(q, k, v, cq, ck, case.max_q, case.max_k, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        if case.overlapping:
            print(f"bad varlen '{case.name}': ran (overlapping: results race)", flush=True)
            continue
        want = T.varlen_expected(q, k, v, dout, case.ranges_q, case.ranges_k, softmax_scale=192 ** -0.5,
                                 causal=True, bottom_right=True)
        covered = ~torch.isnan(want[0][:, 0, 0])
        ok &= _close(f"bad varlen '{case.name}' out", out[covered], want[0][covered])
        for n, a, r in zip(("dq", "dk", "dv"), grads, want[2:]):
            ok &= _close(f"bad varlen '{case.name}' {n}", a, r)
    return ok


def _bad_decode_cases(dev, dt) -> bool:
    """The rule-breaking decode lengths and page ids (testing.bad_decode_case): no fault; results against the
    repaired problems."""
    ok = True
    for Sq, H in ((1, 16), (2, 16), (1, 128), (2, 64)):
        bad, valid = T.bad_decode_case(seqlen_q=Sq, num_heads=H, dtype=dt, device=dev,
                                       generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            want = M.decode(**valid, softmax_scale=0.1)
            for planned in (False, True):
                kw = dict(schedule=M.decode_schedule(bad["cache_seqlens"], seqlen_q=Sq, num_heads=H)) if planned else {}
                got = M.decode(**bad, softmax_scale=0.1, **kw)
                torch.cuda.synchronize()
                ok &= _close(f"bad decode Sq={Sq} H={H}{' planned' if planned else ''}", got, want)
    return ok


def _load_qk_mbar_decode():
    """mla_decode_sm80 built with -DMLA_DECODE_QK_MBAR into its own cache, loaded before anything else loads the
    family, so that every decode call of this process (M.decode included) runs it."""
    from mla_autograd import _build
    cache = _build.cache_root()
    saved = {k: os.environ.get(k) for k in ("MLA_AUTOGRAD_CACHE", "NVCC_APPEND_FLAGS")}
    os.environ["MLA_AUTOGRAD_CACHE"] = str(cache.with_name(cache.name + "-qk-mbar"))
    os.environ["NVCC_APPEND_FLAGS"] = f"{saved['NVCC_APPEND_FLAGS'] or ''} -DMLA_DECODE_QK_MBAR".strip()
    try:
        ext = _build.load_family("mla_decode_sm80")
    finally:  # the other families build and load from the normal cache, with the normal flags
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if not ext.qk_mbar:
        raise SystemExit("sanitize_small: the --qk-mbar module was built without -DMLA_DECODE_QK_MBAR")
    return ext


def _decode_cases(dev, dt, g) -> bool:
    """decode over a NaN-poisoned paged cache (with --qk-mbar: the module main loaded) against the reference."""
    ok = True
    seqlens = torch.tensor([0, 1, 17, 100], dtype=torch.int32)
    ckv, kpe, table = random_paged_cache(seqlens, page_size=16, dtype=dt, device=dev,
                                         generator=torch.Generator().manual_seed(1))  # CPU generator
    # H=16: the warp-specialized kernel; H=64: one 64-row m-block per request (the wgmma kernel on sm_90, the row-group
    # kernel elsewhere); H=128: two m-blocks per request. 100 tokens = one whole 64-token step and one that ends
    # inside its first half
    for H, Sq in ((16, 1), (64, 1), (128, 1)):
        qn = torch.randn(4, Sq, H, 512, device=dev, dtype=dt, generator=g)
        qp = torch.randn(4, Sq, H, 64, device=dev, dtype=dt, generator=g)
        with torch.inference_mode():
            o, lse = M.decode(qn, qp, ckv, kpe, table, seqlens.to(dev), softmax_scale=0.07, return_lse=True)
            ro, rlse = reference.decode_forward(qn.float(), qp.float(), ckv.float(), kpe.float(), table,
                                                seqlens.to(dev), softmax_scale=0.07, causal=True)
        print(f"decode H={H} Sq={Sq} backend: {M.explain_decode(qn, qp, ckv).decode.backend}", flush=True)
        ok &= _close(f"decode out H={H} Sq={Sq}", o, ro)
    torch.cuda.synchronize()
    return ok


def main() -> int:
    if "--qk-mbar" in sys.argv:
        _load_qk_mbar_decode()
        if "--build-only" in sys.argv:
            print("sanitize_small: qk-mbar module built", flush=True)
            return 0
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    ok = True
    attention, decode = "--decode-only" not in sys.argv, "--attention-only" not in sys.argv
    if attention:
        ok &= _attention_cases(dev, dt, g)
    if decode:
        ok &= _decode_cases(dev, dt, g)
    if attention:
        ok &= _bad_varlen_cases(dev, dt)
        if decode:
            ok &= _bad_decode_cases(dev, dt)
    print("sanitize_small:", "all ok" if ok else "WRONG RESULTS", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
