"""The scheduler's tail with workers of unequal speed: a free worker taking the unit a slower one holds, or not.

Two real Ray actors (a local Ray, 2 CPUs) of ``worker_actor``, each sleeping its own seconds per unit (no model: the
scheduler alone), run the same units through ``Scheduler`` (depth 2, as the embedding workers) twice per case,
alternating: as built, and with ``Scheduler._hand_over_held`` swapped out for this script's runs (a held unit stays
with its holder, as before session 37). Prints each case's walls, the ideal wall (the work shared out at the two
workers' rates) and the ratio of the walls.

    .venv/bin/python scripts/bench_scheduler_tail.py
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Iterator

import ray

from embedpipe.cluster.scheduler import Liveness, Scheduler, worker_actor
from embedpipe.units import Unit

CASES = {  # name: (seconds per unit of slot 0, of slot 1), units
    "one worker 20x slower, 4 units": ((4.0, 0.2), 4),
    "one worker 2x slower, 12 units": ((1.0, 0.5), 12),
    "equal workers, 12 units": ((0.5, 0.5), 12),
}
ROUNDS = 2


class SleepingWorker:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def process(self, unit: Unit, ahead: Unit | None = None) -> str:
        time.sleep(self.seconds)
        return unit.id


@contextmanager
def held_units_kept() -> Iterator[None]:
    """The scheduler as it was: no hand-over of held units."""
    original = Scheduler._hand_over_held
    Scheduler._hand_over_held = lambda self: None
    try:
        yield
    finally:
        Scheduler._hand_over_held = original


def run_once(seconds: tuple[float, float], units: int) -> float:
    actor = worker_actor(SleepingWorker).options(num_cpus=0, max_restarts=0)
    scheduler = Scheduler(make_actor=lambda slot: actor.remote(seconds[slot]), workers=2, max_attempts=3, depth=2,
                          liveness=Liveness(unit_timeout_s=60, startup_timeout_s=60, placement_timeout_s=30))
    work = [Unit(id=f"00000-{i:05d}", file="corpus.parquet", row_groups=(i,), num_rows=10) for i in range(units)]
    scheduler.start()  # the actors' start is not timed: only the units, from the first handed out to the last done
    list(scheduler.share([None, None], lambda a, _: a.started.remote()))
    started = time.monotonic()
    assert sorted(scheduler.run(work)) == [u.id for u in work]
    return time.monotonic() - started


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print("| case | with the hand-over (median) | held units kept (median) | ideal | kept / hand-over |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (seconds, units) in CASES.items():
        walls: dict[str, list[float]] = {"hand-over": [], "kept": []}
        for _ in range(ROUNDS):
            walls["hand-over"].append(run_once(seconds, units))
            with held_units_kept():
                walls["kept"].append(run_once(seconds, units))
        ideal = units / sum(1 / s for s in seconds)
        new, old = (statistics.median(walls[k]) for k in ("hand-over", "kept"))
        print(f"| {name} | {new:.2f} s | {old:.2f} s | {ideal:.2f} s | {old / new:.2f} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
