"""The night's incremental diff as Ray tasks (the tasks themselves: ``embedpipe/io/diff.py``).

Map tasks (``MAP_UNITS`` units, or unclaimed previous parts, each) return their stats and one piece per
bucket as separate objects (``num_returns``); join task ``b`` takes piece ``b`` of every map task. The
driver then holds the stats and the matches only: O(units) small records plus about 50 bytes per row
that moved between units (none on a night whose files kept their rows), never the ids themselves.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import ray

from embedpipe.cluster.codeid import CodeId, check_same_code, own_words
from embedpipe.config import JobSpec
from embedpipe.io.diff import (MAP_UNITS, NightDiff, bucket_count, join_bucket, map_parts, map_units, night_diff,
                               unclaimed_parts, unit_tasks)
from embedpipe.units import Unit


def diff_on_ray(job: JobSpec, units: list[Unit], *, parts: tuple[str, ...],
                previous: dict[tuple[str, str], int], code: CodeId | None, beside_workers: bool = False) -> NightDiff:
    """Where each of ``units``' ids was in the previous version (its ``parts``; ``previous``: unit key -> part).
    ``code``: the driver's (cluster/codeid.py), checked by every task first (None: not checked): the diff decides
    which rows are reused. ``beside_workers``: the run's workers were asked for beside the id scan and hold their
    CPUs (every CPU on the embedded default), idle until their first unit, which comes after the diff. The tasks
    then ask for no CPU, spread over the nodes, and at most one per CPU of the cluster runs at a time (the next is
    submitted as one ends): they run on the CPUs the workers hold, which would otherwise place none of them."""
    started = time.perf_counter()
    tasks = unit_tasks(units, previous)
    buckets = bucket_count(sum(u.num_rows for u in units))
    cpus, limit = ({"num_cpus": 0, "scheduling_strategy": "SPREAD"}, _cluster_cpus()) if beside_workers \
        else ({"num_cpus": 1}, None)  # None: Ray's own placement bounds them, by the free CPUs
    map_u = ray.remote(_map_units).options(num_returns=buckets + 1, **cpus)
    map_p = ray.remote(_map_parts).options(num_returns=buckets + 1, **cpus)
    rest = unclaimed_parts(tasks, parts)
    maps = _bounded([lambda i=i: map_u.remote(job, tasks[i:i + MAP_UNITS], parts=parts, buckets=buckets, code=code)
                     for i in range(0, len(tasks), MAP_UNITS)]
                    + [lambda i=i: map_p.remote(job, rest[i:i + MAP_UNITS], parts=parts, buckets=buckets, code=code)
                       for i in range(0, len(rest), MAP_UNITS)], limit=limit, done=lambda refs: refs[0])
    join = ray.remote(_join).options(**cpus)
    joins = _bounded([lambda b=b: join.remote(*(m[b + 1] for m in maps), code=code) for b in range(buckets)],
                     limit=limit, done=lambda ref: ref)
    with own_words():
        stats, matches = ray.get([m[0] for m in maps]), ray.get(joins)
    diff = night_diff(units, tasks, parts=parts, stats=stats, matches=matches, buckets=buckets)
    diff.moved = {unit_id: ray.put(table) for unit_id, table in diff.moved.items()}  # each worker gets its own
    diff.stats.seconds = time.perf_counter() - started
    return diff


def _cluster_cpus() -> int:
    return max(int(ray.cluster_resources().get("CPU", 1)), 1)


def _bounded(submits: list[Callable[[], Any]], *, limit: int | None, done: Callable[[Any], Any]) -> list:
    """Each of ``submits`` called in order (a task's submission -> its reference(s)); with ``limit``, a call waits
    until fewer than ``limit`` of the tasks before it are unfinished (``done``: its answer -> the reference that
    says so). An error is not waited on here: ``ray.get`` raises it."""
    answers, running = [], []
    for submit in submits:
        if limit is not None and len(running) >= limit:
            _, running = ray.wait(running, num_returns=1)
        answers.append(submit())
        running.append(done(answers[-1]))
    return answers


def _map_units(job: JobSpec, tasks, *, parts, buckets, code: CodeId | None):
    check_same_code(code, who="an incremental diff task")
    from embedpipe.io.formats import UnitReader
    from embedpipe.io.fs import use_job_storage

    use_job_storage(job)
    reader = UnitReader(text_column=job.input.text_column, id_column=job.input.id_column)
    stats, pieces = map_units(tasks, parts=parts, id_column=job.input.id_column, reader=reader, buckets=buckets)
    return (stats, *pieces)


def _map_parts(job: JobSpec, indexes, *, parts, buckets, code: CodeId | None):
    check_same_code(code, who="an incremental diff task")
    from embedpipe.io.fs import use_job_storage

    use_job_storage(job)
    stats, pieces = map_parts(indexes, parts=parts, buckets=buckets)
    return (stats, *pieces)


def _join(*pieces, code: CodeId | None):
    check_same_code(code, who="an incremental diff task")
    return join_bucket(*pieces)
