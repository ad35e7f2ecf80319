#!/usr/bin/env python
"""Quick diagnostics of one kernel family on small cases, with a line per case (for a first look after a change,
or under compute-sanitizer): a wrong or hanging kernel shows here in seconds, before its test file runs.

    python tools/kernel_smoke.py fwd      # fmha_fwd_sm90: one small call per head-dim pair and mask
    python tools/kernel_smoke.py bwd      # fmha_bwd_sm90: small cases, simplest first, a per-gradient error report
    python tools/kernel_smoke.py decode   # mla_decode_sm80: a few paged cases, errors against the reference

The checks are the GPU tests' own helpers (tests/gpu/test_fmha_fwd_sm90.py, test_fmha_bwd_sm90.py,
test_mla_decode_sm80.py); exit status 1 if any case is wrong.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from mla_autograd import reference  # noqa: E402
from mla_autograd._build import load_family  # noqa: E402


def smoke_fwd() -> bool:
    """One small call per head-dim pair and mask (catches hangs/launch errors fast)."""
    import test_fmha_fwd_sm90 as t
    ext = t._load()
    ok = True
    for d, dv in t.DIMS:
        for causal, br in t.MASKS:
            g = torch.Generator(device=t.DEV).manual_seed(0)
            q = t._rand((2, 300, 4, d), torch.bfloat16, g)
            k = t._rand((2, 260, 2, d), torch.bfloat16, g)
            v = t._rand((2, 260, 2, dv), torch.bfloat16, g)
            try:
                t._check(ext, q, k, v, scale=1.0 / math.sqrt(d), causal=causal, bottom_right=br, name="smoke")
                print(f"smoke {d}/{dv} causal={causal} br={br}: OK", flush=True)
            except AssertionError as exc:
                ok = False
                print(f"smoke {d}/{dv} causal={causal} br={br}: FAIL {exc}", flush=True)
    return ok


def _diagnose(t, ext_, q, k, v, *, scale, causal, bottom_right):
    """Per-gradient error report: max error vs the plain-PyTorch baseline, NaN count, worst index, and
    the share of elements off by more than 5x the baseline (a pattern there points at a layout bug)."""
    ok = True
    for name, a, r, b in t._kernel_vs_reference(ext_, q, k, v, scale=scale, causal=causal, bottom_right=bottom_right):
        a, r, b = a.double(), r.double(), b.double()
        nan = int((~torch.isfinite(a)).sum())
        diff = (a - r).abs().nan_to_num(float("inf"))
        base = (b - r).abs().max().item()
        err = diff.max().item()
        worst = tuple(int(x) for x in torch.unravel_index(diff.argmax(), diff.shape))
        bad = (diff > 5 * base + t.EPS).double().mean().item()
        good = nan == 0 and err <= 2 * base + t.EPS
        ok &= good
        print(f"    {name}: {'ok ' if good else 'BAD'} err {err:.3e} base {base:.3e} |ref|max {r.abs().max().item():.3e} "
              f"nan {nan} worst {worst} (got {a[worst].item():.4g}, ref {r[worst].item():.4g}) bad-share {bad:.3f}",
              flush=True)
    return ok


def smoke_bwd() -> bool:
    """Small cases, simplest first, each with a per-gradient error report."""
    import test_fmha_bwd_sm90 as t
    ext_ = load_family("fmha_bwd_sm90")
    cases = [((1, 64, 1), (1, 128, 1), (False, False)),   # one M-block, one or two K/V blocks
             ((1, 70, 2), (1, 133, 1), (False, False)),   # ragged, GQA 2:1
             ((1, 70, 2), (1, 133, 1), (True, False)),
             ((1, 70, 2), (1, 133, 1), (True, True)),
             ((2, 300, 4), (2, 200, 2), (True, True))]
    all_ok = True
    for d, dv_ in t.DIMS:
        for (b, sq, hq), (_, sk, hkv), (causal, br) in cases:
            q, k, v = t._inputs((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv_), torch.bfloat16, seed=5)
            print(f"smoke d={d}/{dv_} B={b} Sq={sq} Sk={sk} Hq={hq} Hkv={hkv} causal={causal} br={br}:", flush=True)
            all_ok &= _diagnose(t, ext_, q, k, v, scale=1.0 / math.sqrt(d), causal=causal, bottom_right=br)
    print("smoke:", "all ok" if all_ok else "FAILURES", flush=True)
    return all_ok


def smoke_decode() -> bool:
    """A few paged cases through the kernel entry (split-KV forced in the last), errors against the reference and
    beside plain PyTorch's."""
    import test_mla_decode_sm80 as t
    e = load_family("mla_decode_sm80")
    dev, ok = t.DEV, True
    for (lens, H, Sq, page, causal, splits) in [([64], 16, 1, 64, False, 0), ([17], 16, 1, 16, False, 0),
                                                ([1000, 0, 5], 16, 1, 16, False, 0), ([1000, 3], 128, 1, 64, False, 0),
                                                ([1000, 3], 16, 2, 1, True, 0), ([1000, 64], 16, 1, 64, False, 3),
                                                # 64-row tiles (on 9.0 the wgmma kernel): pages below, at and above
                                                # its 32-row TMA boxes, padding rows, splits
                                                ([64], 64, 1, 64, False, 0), ([4097, 65, 0], 128, 2, 16, True, 0),
                                                ([33, 1000], 24, 3, 256, True, 0), ([1000, 64], 128, 1, 64, True, 3)]:
        torch.manual_seed(0)
        B = len(lens)
        ckv, kpe, table = t._paged_cache(lens, page, torch.bfloat16, True, 0)
        qn = torch.randn(B, Sq, H, 512, dtype=torch.bfloat16, device=dev)
        qp = torch.randn(B, Sq, H, 64, dtype=torch.bfloat16, device=dev)
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        out = torch.full((B, Sq, H, 512), float("nan"), dtype=torch.bfloat16, device=dev)
        lse = torch.full((B, H, Sq), float("nan"), dtype=torch.float32, device=dev)
        if splits:
            e.decode_splits(qn, qp, ckv, kpe, table, sl, out, lse, t.SCALE, causal, splits)
        else:
            e.decode(qn, qp, ckv, kpe, table, sl, out, lse, t.SCALE, causal)
        torch.cuda.synchronize()
        ro, rl = reference.decode_forward(qn.float(), qp.float(), ckv.float(), kpe.float(), table, sl,
                                          softmax_scale=t.SCALE, causal=causal)
        bo, bl = t._baseline(qn, qp, ckv, kpe, table, lens, t.SCALE, causal)
        d = (out.float() - ro.float()).abs()
        print(f"lens={lens} H={H} Sq={Sq} page={page} causal={causal} splits={splits}: out nan={int(out.isnan().sum())} "
              f"err={d.nan_to_num(9e9).max().item():.3e} base_err={(bo.float() - ro.float()).abs().max().item():.3e} "
              f"lse err={(lse - rl.float()).abs().nan_to_num(9e9).max().item():.3e} lse[0,0]={lse[0,0].tolist()} ref={rl[0,0].tolist()}")
        if d.nan_to_num(9e9).max() > 0.1:
            ok = False
            bad = (d.nan_to_num(9e9) > 0.1).nonzero()
            print("  first bad (b,s,h,d):", bad[:8].tolist(), " count", bad.shape[0])
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=("fwd", "bwd", "decode"))
    a = ap.parse_args(argv)
    need = (8, 0) if a.family == "decode" else (9, 0)
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if cap is None or (cap < need if a.family == "decode" else cap != need):
        sys.exit(f"kernel_smoke {a.family}: needs a GPU of compute capability {'>= ' if a.family == 'decode' else ''}"
                 f"{need[0]}.{need[1]} (found {cap})")
    ok = {"fwd": smoke_fwd, "bwd": smoke_bwd, "decode": smoke_decode}[a.family]()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
