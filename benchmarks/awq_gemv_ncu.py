"""Launch the AWQ batch-1 GEMV twice per Llama-3-8B shape at its default launch, for Nsight Compute:

    cd benchmarks && ncu --clock-control none --kernel-name regex:awq --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats \\
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" python3 awq_gemv_ncu.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_quant import SHAPES, w4_weight  # noqa: E402

from vserve.kernels import triton_w4a16  # noqa: E402

for K, N in SHAPES:
    qw, s, z, _, _, gs = w4_weight("awq", K, N, "cuda")
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        triton_w4a16.w4a16_gemm(x, qw, s, z, None, "awq", 4, gs)
    torch.cuda.synchronize()
