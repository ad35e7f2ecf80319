"""Driver for Nsight Compute on one decode call (bench_decode's random case): a few warm-up calls, then the ones
ncu captures (select them with --launch-skip / --launch-count on mla_decode_kernel or mla_decode_ws_kernel).

    ncu --kernel-name regex:mla_decode --launch-skip 2 --launch-count 1 --set full --import-source yes -o rep \\
        python3 tools/ncu_decode.py B S H [LaunchOptions field=value ...]

With launch options (e.g. groups=0) the calls go through decode_with_options (bench_decode.parse_options).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_decode import SCALE, make_case, parse_options  # noqa: E402

from mla_autograd._build import load_family  # noqa: E402


def main() -> None:
    B, S, H = (int(x) for x in sys.argv[1:4])
    options = parse_options(",".join(sys.argv[4:]), "launch options")
    ext = load_family("mla_decode_sm80")
    opts = ext.LaunchOptions(**options)
    buf, table, qn, qp, seqlens = make_case(B, S, H, 1, 64, torch.bfloat16)
    ckv, kpe = buf[..., :512], buf[..., 512:]
    out = torch.empty(B, 1, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B, H, 1, dtype=torch.float32, device="cuda")
    print(ext.launch_info(B, 1, H, torch.cuda.current_device(), opts), flush=True)
    for _ in range(4):
        if options:
            ext.decode_with_options(qn, qp, ckv, kpe, table, seqlens, out, lse, SCALE, False, opts)
        else:
            ext.decode(qn, qp, ckv, kpe, table, seqlens, out, lse, SCALE, False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
