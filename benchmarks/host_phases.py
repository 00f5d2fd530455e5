"""The engine's host work a decode step, by phase, on this CPU: `EngineCore` in this process with 256 decoding
requests (async scheduling on, as on a GPU), the model's forward replaced by fixed logits and the sampler's draw by an
argmax, so what is timed is the Python and numpy work around the device (scheduler, block table, step inputs, the
sampler's host side, token processing) and not a CPU forward. Best of 7 runs of 100 steps, gc tuned as the engine
process tunes it.

    python benchmarks/host_phases.py [--penalty-fraction 0.5] [--out DIR] [--cpu-smoke]

Not a user path: it isolates the host share of a GPU step (docs/performance.md, issue #24).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types
from collections import defaultdict

import common  # benchmarks/ is sys.path[0]
import torch

import vserve.core.sampler as sampler_mod
from vserve.core.config import EngineConfig
from vserve.core.core_client import tune_gc
from vserve.core.engine_core import EngineCore

PHASES = (("scheduler", "schedule"), ("kv", "block_table"), ("runner", "build_step"), ("sampler", "sample"),
          ("core", "_process"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--penalty-fraction", type=float, default=0.0, help="requests with repetition_penalty+logprobs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    runs, steps = (1, 5) if args.cpu_smoke else (7, 100)
    torch.set_num_threads(1)
    vocab = 1024
    core = EngineCore(EngineConfig(model=common.model_folder(dict(common.TINY, vocab_size=vocab)),
                                   load_format="dummy", dtype="float32", device="cpu", max_num_seqs=256,
                                   async_scheduling=True))
    logits = torch.randn(256, vocab)

    def run_step(step):
        core.runner.prompt_scores = None
        n = step.sample_rows.numel()
        return logits[:n] if n else None

    core.runner.run_step = run_step
    real = sampler_mod.for_device

    def for_device(t):  # the draw is a kernel on a GPU, CPU compute here: an argmax instead
        return types.SimpleNamespace(**{**vars(real(t)), "sample_from_logits": lambda scaled, u: scaled.argmax(-1)})

    sampler_mod.for_device = for_device
    seconds: dict[str, float] = defaultdict(float)
    owners = {"scheduler": core.scheduler, "kv": core.kv, "runner": core.runner, "sampler": core.runner.sampler,
              "core": core}
    for owner, name in PHASES:
        fn = getattr(owners[owner], name)

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                seconds[_name] += time.perf_counter() - t0
        setattr(owners[owner], name, timed)
    common.start_decoding(core, vocab, args.penalty_fraction, (10, 40), 5000)  # no request ends while timed
    tune_gc()
    results = []
    for _ in range(runs):
        seconds.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        row = {name: seconds[name] / steps * 1e6 for _, name in PHASES}
        row["step"] = (time.perf_counter() - t0) / steps * 1e6
        results.append(row)
    best = min(results, key=lambda r: r["step"])
    print(f"256 decoding rows, penalty fraction {args.penalty_fraction}: us a step, best of {runs} x {steps} steps "
          f"(median step {statistics.median(r['step'] for r in results):.0f})")
    for name, us in best.items():
        print(f"  {name:<12} {us:8.0f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_phases.json"), "w") as f:
            json.dump({"penalty_fraction": args.penalty_fraction, "best_us": best, "runs_us": results}, f, indent=1)


if __name__ == "__main__":
    main()
