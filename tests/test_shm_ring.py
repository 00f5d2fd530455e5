"""The shared-memory ring that carries rank 0's steps to the other ranks of its node (core/shm_ring.py)."""

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from vserve.core.model_runner import StepInputs
from vserve.core.shm_ring import SLOTS, ShmRing, dumps

pytestmark = pytest.mark.timeout(120)


def _step(rows: int, seed: int) -> StepInputs:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randint(0, 1 << 20, s, generator=g)  # noqa: E731
    return StepInputs(r(rows), r(rows), r(rows), r(rows, 7).to(torch.int32), r(rows), rows, r(1), r(rows),
                      pending_rows=r(3), lora_loads=[("a", torch.randn(4, 3, generator=g).to(torch.bfloat16))])


def _same(a: StepInputs, b: StepInputs) -> bool:
    for f in ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "cu_seqlens_q",
              "sample_rows", "pending_rows"):
        x, y = getattr(a, f), getattr(b, f)
        if x.dtype != y.dtype or not torch.equal(x, y):
            return False
    return a.num_decodes == b.num_decodes and a.pending_src is None and b.pending_src is None \
        and torch.equal(a.lora_loads[0][1], b.lora_loads[0][1]) and b.lora_loads[0][1].dtype == torch.bfloat16


def test_dumps_sends_tensors_as_arrays_and_reads_back_equal():
    step = _step(256, 1)
    payload = bytes(dumps(step))
    # the 9 integer tensors as arrays; the bf16 one (numpy has no bf16) the way torch pickles it, through torch.save
    assert payload.count(b"from_numpy") == 1 and payload.count(b"_load_from_bytes") == 1
    back = pickle.loads(payload)
    assert _same(step, back)
    back.input_ids += 1  # an ordinary writable tensor, not a view of the payload


def test_one_reader_gets_every_message_in_order_across_slot_reuse_and_overflow():
    ring = ShmRing.create(1, slot_bytes=64 << 10)
    reader = ShmRing.attach(ring.name, 1, slot_bytes=64 << 10)
    sent_over: list[bytes] = []
    try:
        steps = [_step(8 if i % 3 else 4096, i) for i in range(3 * SLOTS)]  # every third too big for a slot
        got = []
        for s in steps:
            ring.write(s, lambda p: sent_over.append(bytes(p)), timeout_s=5)
            got.append(reader.read(0, lambda: pickle.loads(sent_over.pop(0)), timeout_s=5))
        assert all(_same(a, b) for a, b in zip(steps, got))
        assert ring.seq == reader.seq == len(steps)
    finally:
        reader.close()
        ring.close()


def test_writer_waits_for_a_reader_slots_behind_then_times_out():
    ring = ShmRing.create(2, slot_bytes=1 << 16)
    try:
        for i in range(SLOTS):  # the readers read nothing: every slot is taken once
            ring.write(i, lambda p: None, timeout_s=1)
        with pytest.raises(TimeoutError, match="a rank has not read the step"):
            ring.write("one too many", lambda p: None, timeout_s=0.2)
    finally:
        ring.close()


def test_other_processes_read_every_step_and_the_segment_is_removed(tmp_path):
    ring = ShmRing.create(2)
    script = textwrap.dedent(f"""
        import sys, torch
        from vserve.core.shm_ring import ShmRing
        ring = ShmRing.attach({ring.name!r}, 2)
        total = 0
        while (msg := ring.read(int(sys.argv[1]), lambda: None, timeout_s=60)) is not None:
            total += int(msg.sum())
        ring.close()
        print(total)
    """)
    readers = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE, text=True)
               for r in (0, 1)]
    msgs = [torch.arange(n) for n in range(1, 40)]
    try:
        for m in msgs + [None]:
            ring.write(m, lambda p: None, timeout_s=60)
        outs = [p.communicate(timeout=60)[0] for p in readers]
    finally:
        for p in readers:
            p.kill()
        ring.close()
    assert [int(o) for o in outs] == [sum(int(m.sum()) for m in msgs)] * 2
    assert all(p.returncode == 0 for p in readers)
    assert not os.path.exists(f"/dev/shm/{ring.name.lstrip('/')}")
