"""How long one step's inputs take from rank 0 to another rank: torch's pickle over the gloo control group (what TP
used through session 31) against the shared-memory ring (core/shm_ring.py), on this machine's CPU.

    python benchmarks/step_broadcast.py --out DIR [--rows 256] [--blocks 512] [--steps 2000]
    python benchmarks/step_broadcast.py --cpu-smoke --out DIR

Two processes (rank 0 and rank 1, gloo on loopback). Each message is a decode step of `rows` rows whose block
tables are `blocks` wide, as ModelRunner.build_step makes it, stamped with the time rank 0 began to send it; rank 1
notes when it has the object. Reported: the median and p99 of that latency and rank 0's time per send. No GPU is
involved: on a GPU host the step goes the same way (CPU tensors) before rank 1 copies it to its device.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _step(rows: int, blocks: int):
    from vserve.core.model_runner import StepInputs

    r = torch.arange(rows, dtype=torch.int64)
    return StepInputs(r, r + 100, r * 16, torch.zeros(rows, blocks, dtype=torch.int32), r + 101, rows,
                      torch.zeros(1, dtype=torch.int64), r, pending_all=True)


def _old_broadcast(obj=None):  # session 31's: torch's own pickling through broadcast_object_list
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=dist.group.WORLD)
    return box[0]


def _run(rank: int, port: int, args, results) -> None:
    from vserve.core import distributed

    distributed.init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "gloo", 2)
    step = _step(args.rows, args.blocks)
    out = {}
    try:
        for way in ("gloo_torch_pickle", "gloo_array_pickle", "shm_ring"):
            if way == "shm_ring":
                name = distributed.open_step_ring() if rank == 0 else None
                name = distributed.broadcast_object(name)
                if rank:
                    distributed.attach_step_ring(name)
            send = {"gloo_torch_pickle": _old_broadcast, "gloo_array_pickle": distributed.broadcast_object,
                    "shm_ring": distributed.broadcast_step}[way]
            recv = {"gloo_torch_pickle": _old_broadcast, "gloo_array_pickle": distributed.broadcast_object,
                    "shm_ring": distributed.receive_step}[way]
            lat, send_s = [], []
            for _ in range(args.steps):
                if rank == 0:
                    t0 = time.perf_counter()
                    send((t0, step))
                    send_s.append(time.perf_counter() - t0)
                    time.sleep(args.gap_us * 1e-6)  # the host's other work between two steps
                else:
                    t0, _ = recv()
                    lat.append(time.perf_counter() - t0)
            dist.barrier()
            if rank:
                results["latency_" + way] = lat
            else:
                results["send_" + way] = send_s
        out["ok"] = True
    finally:
        distributed.destroy_distributed()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--gap-us", type=float, default=500.0)
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args()
    if args.cpu_smoke:
        args.rows, args.blocks, args.steps, args.gap_us = 8, 4, 20, 100.0
    from vserve.core.distributed import free_port
    from vserve.core.shm_ring import dumps

    port = free_port()
    with mp.Manager() as m:
        results = m.dict()
        mp.spawn(_run, args=(port, args, results), nprocs=2)
        results = dict(results)
    step = _step(args.rows, args.blocks)
    rows = {}
    for way in ("gloo_torch_pickle", "gloo_array_pickle", "shm_ring"):
        lat, snd = np.array(results["latency_" + way]) * 1e6, np.array(results["send_" + way]) * 1e6
        rows[way] = {"latency_p50_us": float(np.median(lat)), "latency_p99_us": float(np.percentile(lat, 99)),
                     "send_p50_us": float(np.median(snd))}
    report = {"rows": args.rows, "blocks": args.blocks, "steps": args.steps, "gap_us": args.gap_us,
              "bytes_torch_pickle": len(pickle.dumps(step)), "bytes_array_pickle": len(dumps(step)),
              "cpu": os.cpu_count(), "results": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "step_broadcast.json").write_text(json.dumps(report, indent=1))
    print(f"{'way':<20} {'latency p50 us':>15} {'p99 us':>10} {'send p50 us':>12}")
    for way, r in rows.items():
        print(f"{way:<20} {r['latency_p50_us']:>15.1f} {r['latency_p99_us']:>10.1f} {r['send_p50_us']:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
