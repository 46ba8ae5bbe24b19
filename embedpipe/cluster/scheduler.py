"""First-come first-served units over a pool of worker actors, surviving worker deaths.

A free worker takes the next unit, so a slow worker never holds the rest back. When a worker
dies (killed, out of memory, its node lost) its unit goes back to the queue and a new actor
takes its slot; a unit that has killed ``max_attempts`` workers fails the run, or is set aside
when ``on_error`` is ``skip_unit``. Bad input (``InputError``) is never retried: it would fail
the same way again.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import ray
import ray.exceptions as rex

from embedpipe.units import InputError, Unit

log = logging.getLogger(__name__)

# A worker process or its node went away: the unit is fine, the worker is not.
WORKER_DEATH = (rex.RayActorError, rex.WorkerCrashedError, rex.OutOfMemoryError, rex.NodeDiedError,
                rex.ObjectLostError, rex.LocalRayletDiedError)


class UnitFailed(RuntimeError):
    """A unit failed ``max_attempts`` times with ``on_error: fail``."""


@dataclass
class UnitFailure:
    unit: Unit
    attempts: int
    error: str

    def to_dict(self) -> dict:
        return {"unit": self.unit.id, "file": self.unit.file, "row_groups": list(self.unit.row_groups),
                "attempts": self.attempts, "error": self.error}


@dataclass
class Scheduler:
    make_actor: Callable[[int], "ray.actor.ActorHandle"]  # slot -> a new worker actor
    workers: int
    max_attempts: int = 3
    on_error: str = "fail"  # or "skip_unit"
    retried: int = 0  # unit attempts lost to a worker death or error
    failed: list[UnitFailure] = field(default_factory=list)
    replaced: int = 0  # actors started to replace dead ones

    def run(self, units: list[Unit]) -> Iterator:
        """Yield each unit's result as it finishes (completion order)."""
        actors = [self.make_actor(slot) for slot in range(self.workers)]
        queue, attempts, inflight = deque(units), {u.id: 0 for u in units}, {}

        def submit(slot: int) -> None:
            if queue:
                unit = queue.popleft()
                inflight[actors[slot].process.remote(unit)] = (slot, unit)

        for slot in range(len(actors)):
            submit(slot)
        try:
            while inflight:
                [ready], _ = ray.wait(list(inflight), num_returns=1)
                slot, unit = inflight.pop(ready)
                try:
                    result = ray.get(ready)
                except InputError as exc:  # RayTaskError subclasses the worker's exception type
                    raise InputError(_first_line(exc)) from None
                except Exception as exc:  # noqa: BLE001 - a worker death or an unexpected error
                    attempts[unit.id] += 1
                    self.retried += 1
                    died = isinstance(exc, WORKER_DEATH)
                    log.warning("%s: attempt %d/%d failed (%s): %s", unit.label, attempts[unit.id],
                                self.max_attempts, "worker died" if died else "error", _first_line(exc))
                    if died:
                        actors[slot] = self._replace(actors[slot], slot)
                    if attempts[unit.id] < self.max_attempts:
                        queue.append(unit)
                    elif self.on_error == "skip_unit":
                        self.failed.append(UnitFailure(unit, attempts[unit.id], _first_line(exc)))
                    else:
                        raise UnitFailed(
                            f"{unit.label} failed {attempts[unit.id]} times, last: {_first_line(exc)}; fix or "
                            f"remove that file, or set cluster.on_error: skip_unit to finish without it") from None
                    submit(slot)
                    continue
                submit(slot)
                yield result
        finally:
            for actor in actors:
                ray.kill(actor, no_restart=True)

    def _replace(self, actor, slot: int):
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.replaced += 1
        return self.make_actor(slot)


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]  # Ray puts a traceback before the message
    return lines[-1].strip() if lines else type(exc).__name__
