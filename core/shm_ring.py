"""Rank 0's steps to the other ranks of its node through a ring of shared-memory slots, not a pickle over gloo.

One writer (rank 0) and N readers (the ranks it started on this node). A message is pickled (CPU tensors as
numpy arrays) into the next slot; the slot's sequence number, written after the bytes, publishes it. A reader
waits for the number it expects, unpickles, and writes its acknowledgement into the slot; the writer reuses a slot
once every reader has acknowledged what it held. A message larger than a slot goes through the gloo control group
instead (the slot then says so), as does every step where ranks of other nodes take part (`distributed.py`).

Layout: a header of SLOTS x (seq, length, acks[N]) int64 words, then SLOTS data areas of `slot_bytes`. On x86 and
ARM64 an aligned 8-byte store is seen whole; the writer stores the data before the sequence number and a reader
loads the sequence number before the data, and CPython does not reorder the two statements.

Waiting: a spin that yields the CPU for the first milliseconds (the gap between two decode steps on the host),
then sleeps that grow to 1 ms, so an idle engine's ranks cost almost no CPU and the first step after a pause waits
at most about a millisecond more.
"""

from __future__ import annotations

import io
import pickle
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

SLOTS = 4
SLOT_BYTES = 4 << 20  # a 256-row step with 2,048-block tables is ~2.5 MiB; larger ones take the gloo path
_OVERFLOW = -1  # a slot's length: this message went through the fallback


# CPU tensors of these dtypes travel as numpy arrays: torch's own pickling of a tensor goes through torch.save,
# ~60 us a tensor each way (a 7-tensor decode step: 1.1 ms to pickle and unpickle, 0.12 ms as arrays)
_NUMPY_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float32,
                 torch.float64, torch.float16)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: object) -> object:
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.dtype in _NUMPY_DTYPES \
                and not obj.requires_grad:
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


def dumps(obj: object) -> memoryview:
    """obj pickled, its CPU tensors as numpy arrays; pickle.loads reads it back."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(obj)
    return buf.getbuffer()


def _wait(ready: Callable[[], bool], timeout_s: float | None, what: str) -> None:
    if ready():
        return
    start = time.monotonic()
    spins = 0
    while not ready():
        waited = time.monotonic() - start
        if timeout_s is not None and waited > timeout_s:
            raise TimeoutError(f"{what}: nothing after {timeout_s:.0f} s")
        spins += 1
        if waited < 0.005:
            time.sleep(0)  # yield: the next step is usually a fraction of a millisecond away
        else:
            time.sleep(min(1e-3, 5e-5 * spins ** 0.5))


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Open the creator's segment without registering it with this process's resource tracker, which would
    otherwise unlink it when this process exits (or, where the tracker is shared, forget the creator's claim)."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        register = resource_tracker.register
        resource_tracker.register = lambda *a, **k: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register


class ShmRing:
    """The ring. `create` (rank 0) makes it and `attach` (a reader) opens it by name; `close` detaches, and the
    creator's also removes it."""

    def __init__(self, shm: shared_memory.SharedMemory, num_readers: int, slot_bytes: int, creator: bool) -> None:
        self.shm, self.num_readers, self.slot_bytes, self.creator = shm, num_readers, slot_bytes, creator
        words = SLOTS * (2 + num_readers)
        self.header = np.ndarray((SLOTS, 2 + num_readers), dtype=np.int64, buffer=shm.buf[:words * 8])
        self.data_offset = words * 8
        self.seq = 0  # the last message written (writer) or read (reader)

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, num_readers: int, slot_bytes: int = SLOT_BYTES) -> ShmRing:
        size = SLOTS * (2 + num_readers) * 8 + SLOTS * slot_bytes
        ring = cls(shared_memory.SharedMemory(create=True, size=size), num_readers, slot_bytes, creator=True)
        ring.header[:] = 0
        return ring

    @classmethod
    def attach(cls, name: str, num_readers: int, slot_bytes: int = SLOT_BYTES) -> ShmRing:
        return cls(_attach_untracked(name), num_readers, slot_bytes, creator=False)

    def _data(self, slot: int) -> memoryview:
        start = self.data_offset + slot * self.slot_bytes
        return self.shm.buf[start:start + self.slot_bytes]

    def write(self, obj: object, overflow: Callable[[memoryview], None], timeout_s: float | None = None) -> None:
        """Publish obj. One larger than a slot is published as such and handed, pickled, to overflow() to send
        another way. Waits while the slot's previous message is unread (readers SLOTS messages behind)."""
        seq = self.seq + 1
        row = self.header[seq % SLOTS]
        _wait(lambda: bool((row[2:] >= seq - SLOTS).all()), timeout_s, "a rank has not read the step")
        payload = dumps(obj)
        fits = len(payload) <= self.slot_bytes
        if fits:
            self._data(seq % SLOTS)[:len(payload)] = payload
        row[1] = len(payload) if fits else _OVERFLOW
        row[0] = seq  # publish: after the bytes
        self.seq = seq
        if not fits:
            overflow(payload)

    def read(self, reader: int, overflow: Callable[[], object], timeout_s: float | None = None) -> object:
        """The next message, for reader index `reader` (0 .. num_readers - 1); overflow() receives one that did
        not fit a slot."""
        seq = self.seq + 1
        row = self.header[seq % SLOTS]
        _wait(lambda: int(row[0]) == seq, timeout_s, "no step from rank 0")
        length = int(row[1])
        obj = overflow() if length == _OVERFLOW else pickle.loads(self._data(seq % SLOTS)[:length])
        row[2 + reader] = seq  # acknowledged: the writer may reuse the slot
        self.seq = seq
        return obj

    def close(self) -> None:
        self.header = None  # release the view on the buffer before closing it
        try:
            self.shm.close()
        except BufferError:  # a view still alive (an unpickled tensor is a copy; this should not happen)
            return
        if self.creator:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
