"""The driver: plan units, start worker actors, hand out units first-come first-served, report."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import ray
from tqdm.auto import tqdm

from embedpipe.cluster.connect import connect, plan_workers
from embedpipe.cluster.worker import EmbedWorker, UnitResult
from embedpipe.config import JobSpec
from embedpipe.io.reader import check_columns
from embedpipe.report.counters import Counters
from embedpipe.report.report import build_report, write_report
from embedpipe.units import list_files, plan_units

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    output_path: Path
    report: dict

    @property
    def vectors_path(self) -> Path:
        return self.output_path / "vectors"


def run_job(job: JobSpec, *, progress: bool = True) -> RunResult:
    started = time.perf_counter()
    files = list_files(job.input.path)
    for file in files:  # a bad file fails here, before any model is loaded
        check_columns(file, text_column=job.input.text_column, id_column=job.input.id_column)
    units = plan_units(files, unit_rows=job.input.unit_rows)
    output = Path(job.output.path)
    output.mkdir(parents=True, exist_ok=True)

    started_ray = connect(job.cluster)
    try:
        plan = plan_workers(job.cluster)
        actor_cls = ray.remote(EmbedWorker)
        actors = [actor_cls.options(num_cpus=plan.cpus_per_worker, num_gpus=plan.gpus_per_worker)
                  .remote(job, index=i, threads=plan.cpus_per_worker) for i in range(plan.workers)]
        total = Counters()
        per_worker = [Counters() for _ in actors]
        with tqdm(total=sum(u.num_rows for u in units), unit="rows", disable=not progress,
                  desc=job.name, dynamic_ncols=True) as bar:
            for result in _first_come_first_served(actors, deque(units)):
                counters = Counters.from_dict(result.counters)
                total.merge(counters)
                per_worker[result.worker].merge(counters)
                bar.update(counters.rows)
                elapsed = max(time.perf_counter() - started, 1e-9)
                bar.set_postfix(tokens_per_s=f"{total.tokens / elapsed:,.0f}", refresh=False)
        for actor in actors:
            ray.kill(actor)
    finally:
        if started_ray:
            ray.shutdown()
    report = build_report(total, wall_seconds=time.perf_counter() - started, workers=len(per_worker),
                          units=len(units))
    write_report(output, report)
    return RunResult(output_path=output, report=report)


def _first_come_first_served(actors: list, queue: deque):
    """Yield unit results as they finish; a worker that finishes takes the next unit."""
    inflight: dict = {}
    for actor in actors:
        if queue:
            inflight[actor.process.remote(queue.popleft())] = actor
    while inflight:
        [ready], _ = ray.wait(list(inflight), num_returns=1)
        actor = inflight.pop(ready)
        result: UnitResult = ray.get(ready)
        if queue:
            inflight[actor.process.remote(queue.popleft())] = actor
        yield result
