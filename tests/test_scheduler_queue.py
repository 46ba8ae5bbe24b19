"""The scheduler keeps one unit queued per worker (``depth=2``): the worker has its next unit before it finishes
the current one, and a worker that dies costs only the unit it was running an attempt (the queued one goes back
to the front untouched). Real Ray actors (the session's Ray) stand in for the embedding worker: each call logs
when it arrived and when it finished to a file, and sleeps."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from embedpipe.cluster.scheduler import Liveness, Scheduler
from embedpipe.cluster.worker import Turns
from embedpipe.units import Unit

pytestmark = pytest.mark.slow
ray_pickle = pytest.importorskip("ray.cloudpickle")
ray_pickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import this test module
LIVENESS = Liveness(unit_timeout_s=60, startup_timeout_s=60, placement_timeout_s=30)


class LoggingWorker:
    """process(unit, seq): log the arrival, sleep, log the end; die (os._exit) on the unit named ``die_on`` once
    (a marker file remembers it), after logging its arrival."""

    def __init__(self, log: str, die_on: str = ""):
        self.log, self.die_on, self.turns = Path(log), die_on, Turns()

    def _write(self, **event) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps({**event, "t": time.time(), "pid": os.getpid()}) + "\n")

    def process(self, unit: Unit, seq: int = 0) -> str:
        self._write(event="arrived", unit=unit.id, seq=seq)
        with self.turns.turn(seq):  # the embedding worker's order: one at a time, as submitted
            time.sleep(0.4)
            marker = self.log.with_suffix(".died")
            if unit.id == self.die_on and not marker.exists():
                marker.write_text("1")
                os._exit(1)
            self._write(event="done", unit=unit.id, seq=seq)
        return unit.id


def _units(n: int) -> list[Unit]:
    return [Unit(id=f"00000-{i:05d}", file="corpus.parquet", row_groups=(i,), num_rows=10) for i in range(n)]


def _scheduler(ray, log: Path, *, workers: int, die_on: str = "", depth: int = 2) -> Scheduler:
    actor_cls = ray.remote(LoggingWorker).options(num_cpus=0, max_restarts=0, max_concurrency=2)
    return Scheduler(make_actor=lambda slot: actor_cls.remote(str(log), die_on), workers=workers, max_attempts=3,
                     liveness=LIVENESS, depth=depth)


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_each_worker_holds_its_next_unit_before_the_current_one_ends(tmp_path, ray_session):
    log = tmp_path / "events.jsonl"
    done = list(_scheduler(ray_session, log, workers=1).run(_units(4)))
    assert done == [u.id for u in _units(4)]  # one worker: in order
    events = _events(log)
    arrived = {e["unit"]: e["t"] for e in events if e["event"] == "arrived"}
    finished = {e["unit"]: e["t"] for e in events if e["event"] == "done"}
    ids = [u.id for u in _units(4)]
    for current, following in zip(ids, ids[1:]):  # no round trip between units: the next one is already there
        assert arrived[following] < finished[current], (current, following)
    assert [e["unit"] for e in events if e["event"] == "done"] == ids  # encoded in submission order
    assert sorted(e["seq"] for e in events if e["event"] == "arrived") == [0, 1, 2, 3]


def test_few_units_go_to_every_worker_first(tmp_path, ray_session):
    log = tmp_path / "events.jsonl"
    list(_scheduler(ray_session, log, workers=2).run(_units(2)))
    pids = {e["unit"]: e["pid"] for e in _events(log) if e["event"] == "done"}
    assert len(set(pids.values())) == 2  # one unit each, not both queued on the first worker


def test_a_dead_worker_costs_its_running_unit_an_attempt_and_its_queued_unit_none(tmp_path, ray_session):
    log = tmp_path / "events.jsonl"
    units = _units(3)
    scheduler = _scheduler(ray_session, log, workers=1, die_on=units[0].id)
    done = list(scheduler.run(units))
    assert sorted(done) == [u.id for u in units]
    assert [(r.unit.id, r.attempt, r.cause) for r in scheduler.retries] == [(units[0].id, 1, "died")]
    assert scheduler.retried == 1 and scheduler.replaced == 1 and not scheduler.failed
    replacement = [e for e in _events(log) if e["pid"] != _events(log)[0]["pid"]]
    # the queued unit went back to the front of the queue: the replacement's first call (seq 0), encoded first
    # (its two calls arrive at once on the threaded actor, in either order: "done" follows the seq)
    assert [e["unit"] for e in replacement if e["event"] == "done"][0] == units[1].id
    assert {e["unit"]: e["seq"] for e in replacement if e["event"] == "arrived"}[units[1].id] == 0
