"""The engine's adapter slots: which adapter each of the --max-loras slots holds, as an LRU over the slots no running
request uses. The scheduler admits a request only when its adapter has a slot or can get one (else it waits, and
requests behind it wait too: first come, first served, so none starves); a slot changes adapter only when no running
request uses it, and the runner loads the new adapter into it before the step that first needs it."""

from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np

from vserve.core.request import Request


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self.slot_ids: list[int | None] = [None] * num_slots  # the adapter (lora id) each slot holds
        self.slot_of: dict[int, int] = {}  # lora id -> slot
        self.idle: OrderedDict[int, None] = OrderedDict()  # loaded slots no request uses, least recently used first
        self.users: Counter[int] = Counter()  # lora id -> running requests using it
        self.holders: dict[str, int] = {}  # request id -> its lora id, while it holds a slot
        self.paths: dict[int, str] = {}  # every adapter the engine has been given
        self.names: dict[int, str] = {}
        self.loads: list[tuple[int, int, str]] = []  # (slot, lora id, path) to load before the next step
        self.num_loads = 0

    def register(self, lora_id: int, name: str, path: str) -> None:
        self.paths[lora_id], self.names[lora_id] = path, name

    def forget(self, lora_id: int) -> None:
        """An adapter removed by its front end: its slot frees once no request uses it."""
        self.paths.pop(lora_id, None)
        self.names.pop(lora_id, None)
        slot = self.slot_of.get(lora_id)
        if slot is not None and not self.users[lora_id]:
            self._vacate(slot)

    def _vacate(self, slot: int) -> None:
        old = self.slot_ids[slot]
        if old is not None:
            del self.slot_of[old]
        self.slot_ids[slot] = None
        self.idle.pop(slot, None)

    def can_admit(self, req: Request) -> bool:
        return (not req.lora_id or req.lora_id in self.slot_of or None in self.slot_ids or bool(self.idle))

    def acquire(self, req: Request) -> None:
        """Give the request its adapter's slot (loading it into a free or the least recently used idle slot)."""
        lid = req.lora_id
        if not lid or req.request_id in self.holders:
            return
        if lid not in self.slot_of:
            slot = self.slot_ids.index(None) if None in self.slot_ids else next(iter(self.idle))
            self._vacate(slot)
            self.slot_ids[slot], self.slot_of[lid] = lid, slot
            self.loads.append((slot, lid, req.lora_path))  # the request's own: the adapter may be removed since
            self.num_loads += 1
        self.idle.pop(self.slot_of[lid], None)
        self.users[lid] += 1
        self.holders[req.request_id] = lid

    def release(self, req: Request) -> None:
        lid = self.holders.pop(req.request_id, None)
        if lid is None:
            return
        self.users[lid] -= 1
        if not self.users[lid]:
            del self.users[lid]
            slot = self.slot_of[lid]
            if lid in self.paths:
                self.idle[slot] = None  # most recently used last
            else:  # forgotten while in use
                self._vacate(slot)

    def row_slots(self, reqs: list[Request]) -> np.ndarray:
        return np.fromiter((self.slot_of.get(r.lora_id, -1) if r.lora_id else -1 for r in reqs), np.int64, len(reqs))

    def take_loads(self) -> list[tuple[int, int, str]]:
        loads, self.loads = self.loads, []
        return loads
