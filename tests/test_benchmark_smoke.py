"""Every benchmark script still runs (issue #24: benchmarks/ is a maintained suite): its --cpu-smoke on tiny shapes in
float32 on this CPU (Triton under its interpreter where it launches kernels), to the end and with its results file
written. Nothing is measured here; the recorded numbers come from the same scripts on a GPU (docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
# script -> the file its --cpu-smoke writes under --out (None: it prints only)
SCRIPTS = {
    "h200_rows.py": "h200_rows.json", "h200_engine.py": "h200_engine.json", "h200_bench.py": "h200_bench.json",
    "multi_gpu.py": "multi_gpu.json", "quantize_timing.py": "quantize_timing.json",
    "http_vs_offline.py": "http_vs_offline.json", "engine_host_profile.py": None, "host_phases.py": "host_phases.json",
    "kernels/decode_sweep.py": "decode_sweep.json", "kernels/fused_moe.py": "fused_moe.json",
    "kernels/mla_decode.py": "mla_decode.json", "kernels/triton_sass.py": "triton_sass.json",
    "kernels/w4a16.py": "w4a16.json", "kernels/w8a8.py": "w8a8.json", "step_broadcast.py": "step_broadcast.json",
    "grammar_fill.py": "grammar_fill.json",
}  # kernels/w4a16_tc.py: tests/test_w4a16_tc.py


def test_every_script_is_listed():
    scripts = {str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py")} - {"common.py", "kernels/timing.py",
                                                                          "kernels/w4a16_tc.py"}
    scripts = {s for s in scripts if not s.startswith("steptrace/")}  # a sitecustomize hook, not a script
    assert scripts == set(SCRIPTS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_cpu_smoke(script, tmp_path):
    args = ["--cpu-smoke"] if SCRIPTS[script] is None else ["--cpu-smoke", "--out", str(tmp_path)]
    res = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                         env={**os.environ, "VSERVE_NO_PROGRESS": "1"}, cwd=BENCH.parent, timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    if SCRIPTS[script] is not None:
        out = tmp_path / SCRIPTS[script]
        text = out.read_text() if out.suffix != ".json" else json.dumps(json.loads(out.read_text()))
        assert len(text) > 2, f"{out} is empty"
