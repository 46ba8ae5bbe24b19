"""The scheduler holds one unit per worker behind its current one (``depth=2``): the current unit's call names it,
so the worker knows its next unit before it finishes the current one, and a worker that dies costs only the unit
it was running an attempt (the held one goes back to the front untouched). Real Ray actors (the session's Ray,
not threaded, as the embedding worker) stand in for it: each call logs when it arrived, the unit it was told
comes next and when it finished to a file, and sleeps."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from embedpipe.cluster.scheduler import Liveness, Scheduler, worker_actor
from embedpipe.units import Unit

pytestmark = pytest.mark.slow
ray_pickle = pytest.importorskip("ray.cloudpickle")
ray_pickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import this test module
LIVENESS = Liveness(unit_timeout_s=60, startup_timeout_s=60, placement_timeout_s=30)


class LoggingWorker:
    """process(unit, ahead): log the arrival (and ``ahead``), sleep ``seconds``, log the end; die (os._exit) on the
    unit named ``die_on`` once (a marker file remembers it), after logging its arrival."""

    def __init__(self, log: str, die_on: str = "", seconds: float = 0.4):
        self.log, self.die_on, self.seconds = Path(log), die_on, seconds

    def _write(self, **event) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps({**event, "t": time.time(), "pid": os.getpid()}) + "\n")

    def process(self, unit: Unit, ahead: Unit | None = None) -> str:
        self._write(event="arrived", unit=unit.id, ahead=ahead.id if ahead is not None else None)
        time.sleep(self.seconds)
        marker = self.log.with_suffix(".died")
        if unit.id == self.die_on and not marker.exists():
            marker.write_text("1")
            os._exit(1)
        self._write(event="done", unit=unit.id)
        return unit.id


def _units(n: int) -> list[Unit]:
    return [Unit(id=f"00000-{i:05d}", file="corpus.parquet", row_groups=(i,), num_rows=10) for i in range(n)]


def _scheduler(log: Path, *, workers: int, die_on: str = "", depth: int = 2,
               seconds: tuple[float, ...] = (0.4,)) -> Scheduler:
    """``seconds``: each slot's time per unit (the last one for the slots after them)."""
    actor_cls = worker_actor(LoggingWorker).options(num_cpus=0, max_restarts=0)
    return Scheduler(make_actor=lambda slot: actor_cls.remote(str(log), die_on, seconds[min(slot, len(seconds) - 1)]),
                     workers=workers, max_attempts=3, liveness=LIVENESS, depth=depth)


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_each_worker_holds_its_next_unit_before_the_current_one_ends(tmp_path, ray_session):
    log = tmp_path / "events.jsonl"
    done = list(_scheduler(log, workers=1).run(_units(4)))
    assert done == [u.id for u in _units(4)]  # one worker: in order
    events = _events(log)
    arrived = {e["unit"]: e for e in events if e["event"] == "arrived"}
    finished = {e["unit"]: e["t"] for e in events if e["event"] == "done"}
    ids = [u.id for u in _units(4)]
    for current, following in zip(ids, ids[1:]):  # the current unit's call named the next one
        assert arrived[current]["ahead"] == following, (current, following)
        assert finished[current] <= arrived[following]["t"] < finished[current] + 0.5  # a round trip, not a poll (1 s)
    assert arrived[ids[-1]]["ahead"] is None
    assert [e["unit"] for e in events if e["event"] == "done"] == ids  # in order


def test_few_units_go_to_every_worker_first(tmp_path, ray_session):
    log = tmp_path / "events.jsonl"
    list(_scheduler(log, workers=2).run(_units(2)))
    pids = {e["unit"]: e["pid"] for e in _events(log) if e["event"] == "done"}
    assert len(set(pids.values())) == 2  # one unit each, not both queued on the first worker


def test_a_free_worker_takes_the_unit_a_slower_one_holds_once_the_queue_is_empty(tmp_path, ray_session):
    """Slot 0 takes 4 s a unit, slot 1 0.2 s: slot 0 holds unit 2 behind unit 0, and slot 1, done with units 1
    and 3 while unit 0 runs, takes unit 2 from it. Every unit is done once, none retried, and the run ends with
    slot 0's first unit (about 4 s), not after its second (about 8 s)."""
    log = tmp_path / "events.jsonl"
    units = _units(4)
    scheduler = _scheduler(log, workers=2, seconds=(4.0, 0.2))
    done = list(scheduler.run(units))
    events = _events(log)
    slow = next(e for e in events if e["event"] == "arrived" and e["unit"] == units[0].id)
    assert slow["ahead"] == units[2].id  # it held unit 2, and was reading it ahead
    doers = {e["unit"]: e["pid"] for e in events if e["event"] == "done"}
    assert sorted(done) == [u.id for u in units] and len(doers) == 4
    assert [e["unit"] for e in events if e["event"] == "arrived"].count(units[2].id) == 1
    assert doers[units[2].id] != slow["pid"] and doers[units[2].id] == doers[units[1].id]
    assert not scheduler.retries and not scheduler.failed
    last = max(e["t"] for e in events if e["event"] == "done")
    assert last - slow["t"] < 6.0, last - slow["t"]  # its first unit's 4 s, not two units' 8 s (actor starts aside)


def test_a_dead_worker_costs_its_running_unit_an_attempt_and_its_queued_unit_none(tmp_path, ray_session):
    log = tmp_path / "events.jsonl"
    units = _units(3)
    scheduler = _scheduler(log, workers=1, die_on=units[0].id)
    done = list(scheduler.run(units))
    assert sorted(done) == [u.id for u in units]
    assert [(r.unit.id, r.attempt, r.cause) for r in scheduler.retries] == [(units[0].id, 1, "died")]
    assert scheduler.retried == 1 and scheduler.replaced == 1 and not scheduler.failed
    first = _events(log)[0]
    assert (first["unit"], first["ahead"]) == (units[0].id, units[1].id)  # the dead worker held unit 1
    replacement = [e for e in _events(log) if e["pid"] != first["pid"]]
    # the held unit went back to the front of the queue: the replacement's first call, which names the next
    assert [(e["unit"], e["ahead"]) for e in replacement if e["event"] == "arrived"][:2] == [
        (units[1].id, units[2].id), (units[2].id, units[0].id)]
