"""Staging ring and lazy results: nothing waits until a result is needed or its slot is reused."""

from __future__ import annotations

import pytest
import torch

from embedpipe.runtime.staging import HostEvent, LazyResult, StagingRing


class FakeEvent:
    """A device event under test control: incomplete until `fire()`; counts waits."""

    def __init__(self):
        self.recorded = self.fired = False
        self.waits = 0

    def record(self):
        self.recorded, self.fired = True, False

    def query(self):
        return self.fired

    def synchronize(self):
        self.waits += 1
        self.fired = True


def test_a_result_waits_only_when_read():
    ring = StagingRing(slots=2, input_size=8, pin=False, event_factory=FakeEvent)
    slot = ring.next_slot()
    slot.output(3, 4).copy_(torch.arange(12.0).view(3, 4))
    result = slot.finish(2, computed_tokens=64)
    assert not result.done() and slot.event.waits == 0
    value = result.get()
    assert slot.event.waits == 1 and result.done()
    assert value.tolist() == torch.arange(8.0).view(2, 4).tolist() and result.computed_tokens == 64
    slot.outputs.fill_(-1)  # the slot is free again: the result kept its own copy
    assert result.get().tolist() == torch.arange(8.0).view(2, 4).tolist() and slot.event.waits == 1


def test_reusing_a_slot_waits_for_the_oldest_result_only():
    ring = StagingRing(slots=3, input_size=8, pin=False, event_factory=FakeEvent)
    results = []
    for i in range(3):
        slot = ring.next_slot()
        slot.output(1, 2).fill_(i)
        results.append(slot.finish(1, computed_tokens=1))
    events = [s.event for s in ring.slots]
    assert [e.waits for e in events] == [0, 0, 0]
    slot = ring.next_slot()  # back to slot 0: its unread result is parked first
    assert slot is ring.slots[0] and [e.waits for e in events] == [1, 0, 0]
    slot.output(1, 2).fill_(99)
    assert results[0].get().tolist() == [[0.0, 0.0]]  # not overwritten by the new batch
    assert results[1].get().tolist() == [[1.0, 1.0]]


def test_results_parked_inside_inference_mode_are_editable_tensors():
    ring = StagingRing(slots=1, input_size=4, pin=False)
    with torch.inference_mode():  # runners submit under inference mode
        slot = ring.next_slot()
        slot.output(2, 2).fill_(3.0)
        result = slot.finish(2, computed_tokens=4)
        ring.next_slot()  # reuse parks (copies out) the result inside inference mode
    value = result.get()
    value[0] = 0.0  # would raise for an inference tensor
    assert value.tolist() == [[0.0, 0.0], [3.0, 3.0]]


def test_output_buffer_grows_on_demand():
    ring = StagingRing(slots=1, input_size=4, pin=False)
    slot = ring.next_slot()
    assert slot.output(5, 3).shape == (5, 3) and slot.outputs.shape == (8, 3)
    buf = slot.outputs
    assert slot.output(8, 3).data_ptr() == buf.data_ptr()  # fits: same memory
    assert slot.output(9, 3).shape == (9, 3) and slot.outputs.shape[0] == 16


def test_ready_results_and_host_events():
    value = torch.ones(2, 2)
    assert LazyResult.ready(value, computed_tokens=7).get() is value
    event = HostEvent()
    event.record()
    assert event.query()
    with pytest.raises(ValueError, match="at least one slot"):
        StagingRing(slots=0, input_size=4, pin=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_slots_with_cuda_events():
    ring = StagingRing(slots=2, input_size=16, pin=True, event_factory=torch.cuda.Event)
    slot = ring.next_slot()
    assert slot.inputs.is_pinned()
    slot.inputs_np[:] = range(16)
    device = torch.empty(16, dtype=torch.int32, device="cuda")
    device.copy_(slot.inputs, non_blocking=True)
    out = (device.float() * 2).view(4, 4)
    dst = slot.output(4, 4)
    assert dst.is_pinned()
    dst.copy_(out, non_blocking=True)
    result = slot.finish(4, computed_tokens=16)
    assert result.get().flatten().tolist() == [2.0 * i for i in range(16)]
