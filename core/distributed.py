"""Tensor and pipeline parallelism: one process per rank; rank 0 schedules and broadcasts each step.

Global rank r is TP rank r % tp of pipeline stage r // tp. Each stage's TP group (NCCL on GPUs, gloo on CPU)
carries all-reduce and all-gather; activations go from stage to stage with send/recv. Each step's inputs go from
rank 0 to the others through a ring in shared memory where every rank runs on one node (core/shm_ring.py), else
(and for start-up's one-off messages) through a gloo control group over all ranks. A single process (TP=PP=1)
initialises none of them, and every helper here is then a no-op.
"""

from __future__ import annotations

import os
import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vserve.core.shm_ring import ShmRing, dumps

# How long a collective may wait for a peer before the rank gives up (a dead or hung rank).
TIMEOUT_S = float(os.environ.get("VSERVE_DIST_TIMEOUT", "120"))
# How long a worker waits for rank 0's next step (the engine may be idle between requests).
IDLE_TIMEOUT_S = float(os.environ.get("VSERVE_DIST_IDLE_TIMEOUT", str(24 * 3600)))


@dataclass
class ParallelState:
    rank: int = 0  # global
    world_size: int = 1
    tp_size: int = 1
    device_group: object = None  # this stage's TP group
    cpu_group: object = None  # the control group (gloo, all ranks)
    ring: ShmRing | None = None  # the steps' channel where all ranks share a node


_STATE = ParallelState()


def get_rank() -> int:
    return _STATE.rank


def get_tp_rank() -> int:
    return _STATE.rank % _STATE.tp_size


def get_tp_size() -> int:
    return _STATE.tp_size


def get_pp_rank() -> int:
    return _STATE.rank // _STATE.tp_size


def get_pp_size() -> int:
    return _STATE.world_size // _STATE.tp_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, init_method: str, backend: str, tp_size: int | None = None) -> None:
    """Join the rendezvous (every rank calls this; it returns when all have, or raises after TIMEOUT_S)."""
    if dist.is_initialized():
        raise RuntimeError("this process already runs a tensor-parallel engine; shut it down first "
                           "(LLMEngine.shutdown)")
    timeout = float(os.environ.get("VSERVE_DIST_TIMEOUT", TIMEOUT_S))
    idle = float(os.environ.get("VSERVE_DIST_IDLE_TIMEOUT", IDLE_TIMEOUT_S))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    _STATE.cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=idle))
    tp = tp_size or world_size
    _STATE.rank, _STATE.world_size, _STATE.tp_size = rank, world_size, tp
    _STATE.device_group = dist.group.WORLD
    if tp < world_size:
        for stage in range(world_size // tp):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timedelta(seconds=timeout))
            if stage == rank // tp:
                _STATE.device_group = group


def destroy_distributed() -> None:
    if _STATE.ring is not None:
        _STATE.ring.close()
        _STATE.ring = None
    if _STATE.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.rank, _STATE.world_size, _STATE.tp_size, _STATE.device_group, _STATE.cpu_group = 0, 1, 1, None, None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size > 1:
        dist.all_reduce(x, group=_STATE.device_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on each rank -> [..., world * n], rank order."""
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.device_group)
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: object = None) -> object:
    """Rank 0's obj on every rank, through the gloo control group (pickled as shm_ring.dumps does: tensors as
    arrays)."""
    if _STATE.rank == 0:
        _send_pickled(dumps(obj))
        return obj
    box = [None]
    dist.broadcast_object_list(box, src=0, group=_STATE.cpu_group)
    return pickle.loads(box[0])


def _send_pickled(payload: memoryview) -> None:
    """Rank 0's half of broadcast_object for bytes already pickled by dumps."""
    dist.broadcast_object_list([bytes(payload)], src=0, group=_STATE.cpu_group)


def open_step_ring() -> str:
    """Rank 0, where every rank runs on its node: the shared-memory ring the steps take from now on; its name for
    the other ranks' attach_step_ring."""
    _STATE.ring = ShmRing.create(_STATE.world_size - 1)
    return _STATE.ring.name


def attach_step_ring(name: str) -> None:
    _STATE.ring = ShmRing.attach(name, _STATE.world_size - 1)


def broadcast_step(step: object) -> None:
    """Rank 0: one step's inputs (None: stop) to every other rank."""
    ring = _STATE.ring
    if ring is None:
        broadcast_object(step)
        return
    timeout = float(os.environ.get("VSERVE_DIST_TIMEOUT", TIMEOUT_S))
    ring.write(step, _send_pickled, timeout)  # a step too large for a slot: over gloo


def receive_step() -> object:
    """Ranks other than 0: the next step rank 0 sends (waits while the engine is idle)."""
    ring = _STATE.ring
    if ring is None:
        return broadcast_object()
    return ring.read(_STATE.rank - 1, broadcast_object)  # a step too large for a slot: over gloo


def isend(tensors: list[torch.Tensor], dst: int) -> list:
    """Asynchronous sends: (work, tensor) pairs the caller keeps, and waits on, until they complete."""
    ts = [t.contiguous() for t in tensors]
    return [(dist.isend(t, dst), t) for t in ts]


def recv(like: list[tuple[tuple[int, ...], torch.dtype]], src: int, device: torch.device) -> list[torch.Tensor]:
    out = []
    for shape, dtype in like:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        out.append(t)
    return out


def pp_layer_range(num_layers: int) -> tuple[int, int]:
    """This stage's decoder layers [start, end): an even split, earlier stages taking the remainder."""
    pp, stage = get_pp_size(), get_pp_rank()
    if num_layers < pp:
        raise ValueError(f"--pipeline-parallel-size {pp} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


def shard(size: int, what: str) -> int:
    """This rank's share of `size` (heads, rows, columns); it must divide evenly."""
    tp = _STATE.tp_size
    if size % tp:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {what} ({size})")
    return size // tp
