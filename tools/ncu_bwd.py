"""Driver for Nsight Compute on one attention backward (profile_ops' --bwd workload: B=2 H=16 S=8192 bf16): ours
through the fmha_bwd_sm90 entry on the reference forward's out/lse (no forward kernel is built), or SDPA cuDNN's
backward for comparison. Four calls; skip the first two in ncu.

    ncu --clock-control none --kernel-name regex:fmha_bwd_sm90_main --launch-skip 2 --launch-count 1 \\
        --set full --import-source yes -o rep python3 tools/ncu_bwd.py 192 causal [ours|cudnn] [B H S]
    (cuDNN's main kernel: --kernel-name regex:flash_bprop)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_ops import attention_inputs, cudnn_backward, entry_backward, reference_out_lse  # noqa: E402

from mla_autograd._build import load_family  # noqa: E402


def main() -> None:
    dims, causal = int(sys.argv[1]), sys.argv[2] == "causal"
    impl = sys.argv[3] if len(sys.argv) > 3 else "ours"
    B, H, S = (int(x) for x in sys.argv[4:7]) if len(sys.argv) > 6 else (2, 16, 8192)
    q, k, v, do = attention_inputs(dims, B, H, S)
    scale = q.shape[-1] ** -0.5
    if impl == "cudnn":
        fn = cudnn_backward(q, k, v, do, causal, scale)
    else:
        fn = entry_backward(load_family("fmha_bwd_sm90"), q, k, v, do, *reference_out_lse(q, k, v, causal, scale),
                            causal, scale)
    for _ in range(4):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
