"""TP ranks other than 0: spawned by the engine (or by `--node-rank R` on another node), they load their
shard of the model and cache, then run every step rank 0 broadcasts until it sends None."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import fields

import torch

from vserve.core import distributed
from vserve.core.config import EngineConfig
from vserve.core.loader import load_model, needs_activation_profile, pick_device
from vserve.core.lora import attach_lora


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device(device_type)
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


@torch.inference_mode()
def worker_main(config: EngineConfig, rank: int, local_rank: int, device_type: str, init_method: str) -> None:
    from vserve.core.model_runner import ModelRunner, profile_peak_activation
    from vserve.core.processor import max_model_len_for

    world = config.tensor_parallel_size * config.pipeline_parallel_size
    device = rank_device(device_type, local_rank)
    if device.type == "cpu":  # the ranks share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) * config.nnodes // world))
    distributed.init_distributed(rank, world, init_method, backend_for(device), config.tensor_parallel_size)
    try:
        mc, _, _, dtype, model = load_model(config, device)
        if needs_activation_profile(config, device):  # rank 0 profiles too: the forward is collective
            profile_peak_activation(model, mc, config.max_num_batched_tokens, max_model_len_for(config, mc),
                                    config.max_num_seqs, config.block_size, dtype, device)
        info = distributed.broadcast_object()
        if info is None:  # rank 0 failed while starting
            return
        if info["step_ring"] is not None:
            distributed.attach_step_ring(info["step_ring"])
        runner = ModelRunner(model, mc, config.block_size, info["num_blocks"], dtype, device, config.seed,
                             max_num_seqs=config.max_num_seqs, max_model_len=info["max_model_len"],
                             kv_cache_dtype=config.kv_cache_dtype, lora=attach_lora(model, config, dtype, device))
        while (step := distributed.receive_step()) is not None:
            runner.run_step(step)
    finally:
        distributed.destroy_distributed()


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that spawned this rank is gone (it cannot tell us through a collective then)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="vserve-parent-watch").start()


class Workers:
    """Rank 0's handle on the ranks it started on this node (`python -m vserve.core.worker` each)."""

    def __init__(self, config: EngineConfig, device_type: str, ranks: range, first_local: int,
                 init_method: str) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        cfg = json.dumps({f.name: getattr(config, f.name) for f in fields(config) if f.name != "sources"})
        for rank in ranks:
            cmd = [sys.executable, "-m", "vserve.core.worker", "--rank", str(rank), "--local-rank",
                   str(rank - first_local), "--device-type", device_type, "--init-method", init_method,
                   "--parent-pid", str(os.getpid()), "--config", cfg]
            self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def dead(self, wait_s: float = 2.0) -> dict[int, int]:
        """{rank: exit code} of the started ranks that have exited (waiting briefly for a dying one)."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = {r: p.poll() for r, p in self.procs.items() if p.poll() is not None}
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.05)

    def failure(self, cause: BaseException) -> RuntimeError:
        gone = self.dead()
        if gone:
            what = ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(gone.items()))
            return RuntimeError(f"tensor-parallel worker died: {what}; the engine cannot continue")
        return RuntimeError(f"a collective across the tensor-parallel ranks failed (a rank on another node died or "
                            f"hung?): {cause}")

    def join_rendezvous(self, rank: int, world: int, init_method: str, backend: str, tp_size: int) -> None:
        """init_distributed, but give up as soon as a started rank dies instead of waiting out the timeout."""
        errors: list[BaseException] = []

        def join() -> None:
            try:
                distributed.init_distributed(rank, world, init_method, backend, tp_size)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                errors.append(e)

        t = threading.Thread(target=join, daemon=True, name="vserve-rendezvous")
        t.start()
        while t.is_alive():
            t.join(0.1)
            if self.dead(0.0):
                raise self.failure(RuntimeError("a rank exited during the rendezvous"))
        if errors:
            raise self.failure(errors[0]) from errors[0]

    def shutdown(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)


def _init_method(config: EngineConfig) -> str:
    return f"tcp://{config.master_addr}:{config.master_port or distributed.free_port()}"


def start_tensor_parallel(config: EngineConfig, mc, device: torch.device) -> tuple[Workers, torch.device]:
    """Rank 0: check the sizes against the model and devices, start this node's other ranks, join the
    rendezvous (ranks on other nodes join it through --master-addr/--master-port)."""
    from vserve.core.memory import check_tensor_parallel

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    check_tensor_parallel(mc, tp)
    if pp > mc.num_hidden_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} exceeds the model's {mc.num_hidden_layers} layers")
    world = tp * pp
    per_node = world // config.nnodes
    if device.type == "cuda" and per_node > torch.cuda.device_count():
        raise ValueError(f"tensor x pipeline parallel size {world} over {config.nnodes} node(s) needs {per_node} "
                         f"GPUs per node; torch sees {torch.cuda.device_count()}")
    if device.type == "cuda" and os.environ.get("VSERVE_SKIP_PREFLIGHT") != "1":
        _preflight(tp)
    init_method = _init_method(config)
    workers = Workers(config, device.type, range(1, per_node), 0, init_method)
    try:
        workers.join_rendezvous(0, world, init_method, backend_for(device), tp)
    except BaseException:
        workers.shutdown(0.0)
        raise
    return workers, rank_device(device.type, 0)


def _preflight(tp: int) -> None:
    """vserve doctor's NCCL and /dev/shm checks before the ranks start (VSERVE_SKIP_PREFLIGHT=1 skips)."""
    from vserve.ops.doctor import preflight
    from vserve.ops.probe import probe_environment

    failed = preflight(probe_environment(run_triton=False), tp)
    if failed:
        raise ValueError("; ".join(f"{c.name}: {c.finding} (fix: {c.fix})" for c in failed) +
                         " [VSERVE_SKIP_PREFLIGHT=1 skips this check]")


def run_node(config: EngineConfig) -> int:
    """A node other than 0: start its ranks, wait for them (they end when rank 0 shuts down); the worst exit
    code."""
    from vserve.core.hub import resolve_model_files

    config = resolve_model_files(config)  # each node finds (or downloads) the model in its own cache
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    per_node = world // config.nnodes
    first = config.node_rank * per_node
    workers = Workers(config, pick_device(config.device).type, range(first, first + per_node), first,
                      _init_method(config))
    codes = [p.wait() for p in workers.procs.values()]
    return max(codes, key=abs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one vserve tensor-parallel rank (started by the engine)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--device-type", required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--parent-pid", type=int)
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    a = p.parse_args(argv)
    if a.parent_pid is not None:
        _watch_parent(a.parent_pid)
    worker_main(EngineConfig(**json.loads(a.config)), a.rank, a.local_rank, a.device_type, a.init_method)
    return 0


if __name__ == "__main__":
    sys.exit(main())
