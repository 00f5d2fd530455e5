"""LoRASlots (the engine's adapter slots) under random admissions, finishes and removals: a slot in use never
changes adapter, the maps agree, idle slots are exactly the loaded unused ones, and a request is refused a slot only
while every slot is in use."""

from hypothesis import given, settings
from hypothesis import strategies as st

from vserve.core.lora.manager import LoRASlots
from vserve.core.request import Request
from vserve.core.sampling_params import SamplingParams

OPS = st.lists(st.tuples(st.sampled_from(["admit", "finish", "forget"]), st.integers(0, 5), st.integers(0, 30)),
               max_size=80)


def _request(rid: int, lora_id: int) -> Request:
    return Request(request_id=str(rid), prompt_token_ids=[1], sampling_params=SamplingParams(), max_tokens=1,
                   lora_id=lora_id, lora_name=f"l{lora_id}" if lora_id else None, lora_path=f"/a/{lora_id}")


@settings(max_examples=200, deadline=None)
@given(num_slots=st.integers(1, 3), ops=OPS)
def test_slots_stay_consistent(num_slots, ops):
    slots = LoRASlots(num_slots)
    running: dict[str, Request] = {}
    for n, (op, lora_id, pick) in enumerate(ops):
        if op == "admit":
            req = _request(n, lora_id)
            slots.register(lora_id, req.lora_name, req.lora_path)
            busy = {slots.slot_of[r.lora_id] for r in running.values() if r.lora_id}
            before = {s: slots.slot_ids[s] for s in busy}
            if slots.can_admit(req):
                slots.acquire(req)
                running[req.request_id] = req
            else:
                assert len(busy) == num_slots and lora_id not in slots.slot_of  # every slot in use, by others
            assert all(slots.slot_ids[s] == lid for s, lid in before.items())  # slots in use keep their adapter
        elif op == "finish" and running:
            req = running.pop(sorted(running)[pick % len(running)])
            slots.release(req)
        elif op == "forget":
            slots.forget(lora_id)
        for r in running.values():
            if r.lora_id:
                assert slots.slot_ids[slots.slot_of[r.lora_id]] == r.lora_id
        assert all(slots.slot_ids[s] == lid for lid, s in slots.slot_of.items())
        used = {slots.slot_of[r.lora_id] for r in running.values() if r.lora_id}
        loaded = {s for s, lid in enumerate(slots.slot_ids) if lid is not None}
        assert set(slots.idle) == loaded - used
        assert sum(slots.users.values()) == sum(1 for r in running.values() if r.lora_id)
    for req in running.values():
        slots.release(req)
    assert not slots.holders and not slots.users
