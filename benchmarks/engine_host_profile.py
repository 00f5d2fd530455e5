"""The engine's host work a step: `EngineCore` in this process (no front end, no tokenizer), 256 requests of random
token ids (prompts U[100,1024]; U[10,40] on the CPU) decoding with temperature 1, timed over N steps once every
request decodes, then the same N steps under cProfile (by own time, then cumulative).

    python benchmarks/engine_host_profile.py qwen05b [PENALTY_FRACTION] [STEPS]   # a GPU: bf16, CUDA graphs
    python benchmarks/engine_host_profile.py tiny 0.5 30                         # the CPU: float32, a tiny model
    python benchmarks/engine_host_profile.py qwen05b 0 50 --torch-profile DIR     # + torch.profiler's op table
    python benchmarks/engine_host_profile.py 8b 0 50 --requests 1 --torch-profile DIR  # batch 1 (8B): its kernels
    python benchmarks/engine_host_profile.py --cpu-smoke                          # tiny 0.5 3 (CI: it runs)

--torch-profile DIR also runs the steps under torch.profiler (CPU and CUDA activity) and writes DIR/ops.txt (every
op's host time, by self CPU time: which torch ops, copies and kernel launches the host spends a step on) and
DIR/trace.json (a Chrome trace of the steps: where the host waits and where the device idles), and on a GPU
DIR/kernels.txt (the ops by device time: where a step's device time goes). --requests N decodes N requests instead
of 256 (--requests 1: the batch-1 decode step).

PENALTY_FRACTION of the requests also ask for repetition_penalty 1.1 and logprobs 5 (issue #24's penalties row).
Not a user path (it skips the tokenizer and the front end): it isolates the engine process's share of a step.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import common  # benchmarks/ is sys.path[0]
import torch

from vserve.core.config import EngineConfig
from vserve.core.engine_core import EngineCore

SHAPES = {"qwen05b": common.QWEN25_05B, "8b": common.LLAMA3_8B, "tiny": dict(common.TINY, vocab_size=1024)}


def main() -> None:
    args = sys.argv[1:]
    if args == ["--cpu-smoke"]:
        args = ["tiny", "0.5", "3"]
    torch_dir = None
    if "--torch-profile" in args:
        at = args.index("--torch-profile")
        torch_dir = args[at + 1]
        del args[at:at + 2]
    num_requests = 256
    if "--requests" in args:
        at = args.index("--requests")
        num_requests = int(args[at + 1])
        del args[at:at + 2]
    shape = SHAPES[args[0]]
    frac = float(args[1]) if len(args) > 1 else 0.0
    steps = int(args[2]) if len(args) > 2 else 150
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    core = EngineCore(EngineConfig(model=common.model_folder(dict(shape)), load_format="dummy",
                                   dtype="bfloat16" if cuda else "float32", device="cuda" if cuda else "cpu",
                                   max_num_seqs=256, async_scheduling=True))
    common.start_decoding(core, shape["vocab_size"], frac, (100, 1024) if cuda else (10, 40), 512,
                          shape.get("eos_token_id"), n=num_requests)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync()
    plain = (time.perf_counter() - t) / steps
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        core.step()
    sync()
    prof.disable()
    print(f"== {args[0]} penalty fraction {frac}: {plain * 1e3:.3f} ms a step, "
          f"{(time.perf_counter() - t) / steps * 1e3:.3f} ms profiled; running {len(core.scheduler.running)}")
    for key, n in (("tottime", 45), ("cumulative", 40)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(n)
        print(out.getvalue())
    if torch_dir is not None:
        torch_profile(core, steps, torch_dir, sync)


def torch_profile(core: EngineCore, steps: int, out_dir: str, sync) -> None:
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as p:
        for _ in range(steps):
            core.step()
        sync()
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
    with open(os.path.join(out_dir, "ops.txt"), "w") as fh:
        fh.write(f"{steps} steps\n{table}\n")
    if torch.cuda.is_available():
        kernels = p.key_averages().table(sort_by="self_device_time_total", row_limit=60)
        with open(os.path.join(out_dir, "kernels.txt"), "w") as fh:
            fh.write(f"{steps} steps\n{kernels}\n")
    p.export_chrome_trace(os.path.join(out_dir, "trace.json"))
    print(f"torch.profiler over {steps} steps -> {out_dir}/ops.txt, trace.json")


if __name__ == "__main__":
    main()
