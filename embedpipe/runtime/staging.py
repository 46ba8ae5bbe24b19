"""Pinned host buffers, events, and results that are materialised only when asked for.

    slot = ring.next_slot()                  # the oldest slot; waits only for a result still parked in it
    fill slot.inputs_np (int32, pinned)      # host work, while the GPU runs earlier batches
    device_buf[:n].copy_(slot.inputs[:n], non_blocking=True)
    ... launch the model ...
    slot.output(B, D).copy_(out[:B], non_blocking=True)
    result = slot.finish(B, computed_tokens=...)   # records the slot's event; returns at once
    result.get()                             # [B, D] float32 on the host; waits for this batch only

One stream does everything, so the event recorded after the device-to-host copy also covers
the host-to-device copy that read the slot's inputs: once it has fired, the slot can be reused.
On CPU the same code runs with plain memory and `HostEvent`, an event that is always complete.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import Tensor


class Event(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class HostEvent:
    """Stand-in for torch.cuda.Event where work is synchronous: always complete."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class LazyResult:
    """One batch's vectors [B, D] float32, possibly still on their way to a pinned host buffer."""

    def __init__(self, view: Tensor | None, event: Event | None, *, computed_tokens: int):
        self._view, self._event, self._value = view, event, None
        self.computed_tokens = computed_tokens  # tokens the device computed, padding included

    @classmethod
    def ready(cls, value: Tensor, *, computed_tokens: int) -> "LazyResult":
        result = cls(None, None, computed_tokens=computed_tokens)
        result._value = value
        return result

    def done(self) -> bool:
        """True when get() would not wait."""
        return self._value is not None or self._event.query()

    def detach(self) -> None:
        """Wait for this batch, then copy it out of the staging slot so the slot can be reused."""
        if self._value is None:
            self._event.synchronize()
            with torch.inference_mode(False):  # a normal tensor, even when detached inside a runner
                self._value = self._view.clone()  # [B, D]
            self._view = self._event = None

    def get(self) -> Tensor:
        self.detach()
        return self._value


class Slot:
    """Pinned input [n] int32 and output [rows, D] float32 buffers plus the event that guards them."""

    def __init__(self, *, input_size: int, pin: bool, event: Event):
        self.pin = pin
        self.inputs = torch.empty(input_size, dtype=torch.int32, pin_memory=pin)  # [n]
        self.inputs_np = self.inputs.numpy()  # the same memory, for numpy writes
        self.outputs = torch.empty(0, 0, dtype=torch.float32)  # [rows, D], grown on demand
        self.event = event
        self.owner: LazyResult | None = None  # the result still reading self.outputs

    def output(self, rows: int, dim: int) -> Tensor:
        """A [rows, dim] float32 view of the output buffer (grown to the next power of two rows)."""
        if rows > self.outputs.shape[0] or dim != self.outputs.shape[1]:
            cap = 1 << max(rows - 1, 0).bit_length()
            self.outputs = torch.empty(cap, dim, dtype=torch.float32, pin_memory=self.pin)
        return self.outputs[:rows]

    def finish(self, rows: int, *, computed_tokens: int) -> LazyResult:
        """Call after enqueueing the copy into output(rows, D); records the event, returns at once."""
        self.event.record()
        self.owner = LazyResult(self.outputs[:rows], self.event, computed_tokens=computed_tokens)
        return self.owner


class StagingRing:
    """`slots` staging slots used round robin: the host runs at most `slots` batches ahead of the device."""

    def __init__(self, *, slots: int, input_size: int, pin: bool, event_factory: Callable[[], Event] = HostEvent):
        if slots < 1:
            raise ValueError(f"a staging ring needs at least one slot, got {slots}")
        self.slots = [Slot(input_size=input_size, pin=pin, event=event_factory()) for _ in range(slots)]
        self._next = 0

    def next_slot(self) -> Slot:
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        if slot.owner is not None:
            slot.owner.detach()  # no-op when already consumed; else waits for that (oldest) batch
            slot.owner = None
        return slot
