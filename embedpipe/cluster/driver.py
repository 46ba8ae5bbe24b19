"""The driver: check the job, resume from the manifest, run the remaining units on Ray, report.

The driver never holds the corpus or its vectors: workers read their units and write their
parts and manifest records themselves; the driver sees only counters (and, for int8/uint8, the
calibration's bounded sample: cluster/calibrate.py, cluster/sampled.py).
"""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from embedpipe.cluster.calibrate import prepare_quantization
from embedpipe.cluster.codeid import CodeId, this_code
from embedpipe.cluster.connect import (WorkerPlan, connect, disconnect, expected_workers, local_gpus,
                                       plan_workers, submitted_job_address)
from embedpipe.cluster.diff import diff_on_ray
from embedpipe.cluster.early import EarlyRay, scan_beside_ray
from embedpipe.cluster.modelship import ShippedModel, ship_model
from embedpipe.cluster.progress import progress_bar
from embedpipe.cluster.sampled import SampleVectors
from embedpipe.cluster.scheduler import Liveness, Scheduler, worker_actor
from embedpipe.cluster.shards import shard_runner
from embedpipe.cluster.signals import handled
from embedpipe import versions
from embedpipe.cluster.worker import READ_AHEAD, EmbedWorker, Incremental, UnitResult, WorkerSetup
from embedpipe.config import JobSpec, resolve_dtype
from embedpipe.errors import Interrupted
from embedpipe.index.build import IndexBuild, plan_index_build
from embedpipe.io.describe import OutputDescription, read_description, write_description
from embedpipe.io.fs import use_job_storage
from embedpipe.io.layout import OutputLayout, atomic_write_table
from embedpipe.io.lock import OutputLock
from embedpipe.io.manifest import Manifest, done_units, job_fingerprint, vector_salt
from embedpipe.io.quantize import Calibration, read_record
from embedpipe.io.ownership import check_output, claim_output, sweep_temporaries
from embedpipe.io.store import TreePath, tree_path
from embedpipe.preflight import RunPlan, check_job, scan_ids
from embedpipe.report.counters import Counters
from embedpipe.report.device import DeviceInfo, slower_than_float32
from embedpipe.report.history import record_run
from embedpipe.report.memory import peak_rss_mb
from embedpipe.report.metrics import UnitSpan, devices_by_slot, extend_report, fill_usd_saved, run_metrics
from embedpipe.report.outputs import write_renderings
from embedpipe.report.report import build_report, write_report
from embedpipe.units import UNITS_PER_WORKER, Unit

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    output_path: TreePath  # a Path, or a Url for an object-store output
    report: dict

    @property
    def vectors_path(self) -> TreePath:
        return OutputLayout(self.output_path).vectors


def run_job(job: JobSpec, *, progress: bool = True, overwrite: bool = False) -> RunResult:
    """Run a job to completion (resuming its own unfinished output); one live run per output path.

    SIGTERM (Airflow, Kubernetes) stops it as Ctrl-C does: the lock is released, Ray shut down, finished
    units kept; it raises `Interrupted` with how many of the plan's units are done.
    """
    clock = RunClock.now()  # the run's wall time and start-up count from here: its checks and Ray's start included
    job = settle_dtype(job)
    with _signals_interrupt():
        use_job_storage(job)  # the job's storage options, before the first look at its output's store
        check_output(job.output.path)  # a folder embedpipe did not create: refused before anything is written there
        checked = check_job(job, workers=expected_workers(job.cluster).workers)  # bad files or model: fail here
        if _expects_work(job, overwrite=overwrite):  # Ray's start and the model's shipping beside the id scan
            plan, early = scan_beside_ray(  # bad ids: fail here, Ray shut down first
                checked, start_workers=lambda model: _workers_asked(job, model=model, units=len(checked.units)))
        else:
            plan, early = scan_ids(checked), None
        try:
            with OutputLock(job.output.path, mode=job.output.lock) as lock:
                if job.output.versioned:
                    return _run_versioned(job, plan, progress=progress, overwrite=overwrite, lock=lock, clock=clock,
                                          early=early)
                return _run_once(job, plan, progress=progress, overwrite=overwrite, clock=clock, early=early)
        except KeyboardInterrupt as stop:  # the lock is released and Ray shut down by now
            raise Interrupted(signum=getattr(stop, "signum", signal.SIGINT), done=_units_done(job, plan),
                              total=len(plan.units)) from None
        finally:
            if early is not None:  # a run that ended before it got to Ray (a held lock, a mismatched output)
                early.close()  # its workers ended and Ray shut down: a no-op once the run did both itself


def _expects_work(job: JobSpec, *, overwrite: bool) -> bool:
    """Whether the run will want Ray (then it is started beside the id scan): every versioned run (each is a new
    version) and overwrite, else an output with no finished run's report.json (new, or a run to resume). A finished
    output run again finds nothing to do, and starts no Ray for it."""
    if overwrite or job.output.versioned:
        return True
    layout = OutputLayout(tree_path(job.output.path))
    return not layout.store.exists(layout.report_json)


def _workers_asked(job: JobSpec, *, model: ShippedModel, units: int) -> Scheduler:
    """The run's workers, asked for now (``Scheduler.start``): one per planned worker, at most one per unit."""
    workers = plan_workers(job.cluster)
    scheduler = _worker_pool(job, model=model, workers=workers, code=this_code(), count=min(workers.workers, units))
    scheduler.start()
    return scheduler


def _embed_on_workers(scheduler: Scheduler, texts: list[str], *, timed: dict | None = None,
                      sample: list | None = None) -> np.ndarray:
    """The int8/uint8 calibration's sample embedded by the run's workers before their ``configure``: cut in two
    pieces per worker, taken first come first served (``Scheduler.share``); float vectors [n, D] in its order.
    Batch invariance makes them the vectors one worker would give for the whole sample. ``timed``: given, it gets
    the sample's rows and the seconds from the ask to the last piece's vectors (the report's ``calibration``,
    with the workers' own start where they were not up yet). ``sample``: given, the sample's texts and its
    pieces (``SamplePiece``: what each text cost, the piece's span) are appended to it: ``_kept_sample``, and
    the pieces' spans for the report (``_noted``)."""
    began = time.perf_counter()
    count = min(len(texts), 2 * max(scheduler.workers, 1))
    bounds = np.linspace(0, len(texts), count + 1).astype(int)
    pieces = scheduler.share([texts[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
                             lambda actor, piece: actor.embed_sample.remote(piece))
    if timed is not None:
        # rows: the vectors the ranges are fitted on (a chunked run's: chunks), as quantization.json says
        timed.update(rows=sum(len(piece.vectors) for piece in pieces), seconds=round(time.perf_counter() - began, 2))
    if sample is not None:
        sample.append((texts, pieces))
    return np.concatenate([piece.vectors for piece in pieces])


def _kept_sample(sample: list, units: list[Unit]) -> SampleVectors | None:
    """The calibration sample this run fitted (``_embed_on_workers``'s ``sample``), kept for the units' rows it
    holds when worth it (cluster/sampled.py); None for a run that fitted none."""
    if not sample:
        return None
    texts, pieces = sample[0]
    return SampleVectors.kept(texts, pieces, input_rows=sum(u.num_rows for u in units))


def _noted(result: UnitResult, *, spans: list[UnitSpan], devices: dict[int, DeviceInfo], peaks: dict[int, float],
           calibration: bool = False) -> UnitSpan:
    """A worker's answer for a unit, or a calibration piece (``calibration``: its wall counts as the worker's, what
    it computed counts in the units that take its rows, cluster/sampled.py), in the run's records: its span on the
    worker's timeline, the device the worker measured, the worker's peak memory. Returns the span."""
    span = UnitSpan(result.worker, result.started, result.finished, Counters.from_dict(result.counters),
                    node=result.node, calibration=calibration)
    spans.append(span)
    devices[result.worker] = DeviceInfo.from_dict(result.device)
    peaks[result.worker] = max(peaks.get(result.worker, 0.0), result.peak_rss_mb)
    return span


def _worker_pool(job: JobSpec, *, model: ShippedModel, workers: WorkerPlan, code: CodeId, count: int) -> Scheduler:
    """The embedding workers' scheduler, ``count`` slots; each worker gets the run's settings by its ready call
    (``EmbedWorker.configure``, given to ``Scheduler.run``)."""
    actor_cls = worker_actor(EmbedWorker).options(num_cpus=workers.cpus_per_worker, num_gpus=workers.gpus_per_worker,
                                                  max_restarts=0)
    return Scheduler(
        make_actor=lambda slot: actor_cls.remote(job, model=model, index=slot, threads=workers.cpus_per_worker,
                                                 code=code),
        workers=count, max_attempts=job.cluster.max_attempts, on_error=job.cluster.on_error,
        liveness=Liveness.from_config(job.cluster),
        resources={"CPU": workers.cpus_per_worker, "GPU": workers.gpus_per_worker},
        depth=READ_AHEAD + 1)  # one unit held per worker: it reads that one while it encodes


@dataclass(frozen=True)
class RunClock:
    """When a run started, on both clocks: ``perf`` (time.perf_counter, for durations) and ``wall`` (time.time)."""

    perf: float
    wall: float

    @classmethod
    def now(cls) -> "RunClock":
        return cls(perf=time.perf_counter(), wall=time.time())


def settle_dtype(job: JobSpec) -> JobSpec:
    """``model.dtype: auto`` decided on the driver wherever the workers' device is known here: from an explicit
    ``runtime.device``, or on the embedded local Ray from this machine (its GPUs are the workers'). The job's
    fingerprint, every worker and the report then carry the real dtype: an output written in float32 on CPU
    resumes under ``auto`` (the default before ``auto`` was float32), and the same output continued on GPU
    workers is another job, never a mix of float32 and bfloat16 vectors. On a joined cluster with
    ``runtime.device: auto`` the workers decide; set model.dtype or runtime.device to pin it there."""
    if job.model.dtype != "auto":
        return job
    device = job.runtime.device
    if device == "auto":
        if job.cluster.address or submitted_job_address():
            return job
        device = "cuda" if local_gpus() else "cpu"
    return job.replace(model={"dtype": resolve_dtype("auto", device=device)})


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGINT raise `Interrupted` in the main thread, for the first signal only: a second one
    while the run cleans up (lock, Ray) is ignored so the cleanup finishes. Handlers restored on the way out;
    outside the main thread (where Python cannot set handlers) nothing changes."""
    stopping: list[int] = []

    def stop(signum: int, frame) -> None:
        if stopping:
            return
        stopping.append(signum)
        raise Interrupted(signum=signum)

    with handled(stop):
        yield


def _units_done(job: JobSpec, plan: RunPlan) -> int | None:
    """The plan's units with a finished record where the rerun will look (for versioned outputs: the
    unfinished version it resumes); None when that cannot be read."""
    try:
        output = tree_path(job.output.path)
        if job.output.versioned:
            fingerprint = job_fingerprint(job, files=plan.files, model_dir=plan.model_dir)
            output = OutputLayout(output).version(versions.choose_version(output, fingerprint)).root
        return len(done_units(Manifest(output).done(), plan.units))
    except (OSError, ValueError) as exc:
        log.warning("units done unknown: %s", exc)
        return None


def _run_versioned(job: JobSpec, plan: RunPlan, *, progress: bool, overwrite: bool, lock: OutputLock,
                   clock: RunClock | None = None, early: EarlyRay | None = None) -> RunResult:
    clock = clock or RunClock.now()
    root = tree_path(job.output.path)
    claim_output(root, kind="versioned")
    if overwrite:
        versions.remove_all(root)
    fingerprint = job_fingerprint(job, files=plan.files, model_dir=plan.model_dir,
                                  model_sha256=early.model.sha256 if early is not None else None)
    version = versions.choose_version(root, fingerprint, started_at=clock.wall)  # a new one: named as its run
    incremental, reencode_reason = None, None
    if job.output.incremental:
        parts, units = versions.previous_units(root)  # the current version's intact parts, from its manifest
        incremental = Incremental(salt=vector_salt(fingerprint), previous=versions.previous_vectors(root, job)
                                  if parts else None, previous_parts=parts, previous_units=units)
        reencode_reason = versions.reencode_reason(root, fingerprint, description=plan.describe(job))
        if reencode_reason:
            log.warning("incremental run re-encodes every row: %s", reencode_reason)
    version_job = job.replace(output={"path": str(OutputLayout(root).version(version).root)})
    result = _run_once(version_job, plan, progress=progress, overwrite=False, incremental=incremental,
                       previous_rows=versions.previous_rows(root) if incremental else 0, fingerprint=fingerprint,
                       clock=clock, early=early)
    versions.validate(result.output_path, result.report, expected_rows=sum(u.num_rows for u in plan.units))
    lock.confirm()  # a run whose lock was taken over never moves CURRENT
    versions.promote(root, version)
    write_description(root, read_description(result.output_path))  # the root says what CURRENT's vectors are
    result.report["version"] = {"run_id": version, "pruned": versions.prune(root, keep=job.output.keep_versions)}
    if reencode_reason:  # no row could be reused: say why in the report
        result.report["incremental"]["reencoded_all"] = reencode_reason
    sweep_temporaries(root)
    write_report(result.output_path, result.report)
    write_renderings(result.output_path, result.report)
    return result


def _run_once(job: JobSpec, plan: RunPlan, *, progress: bool, overwrite: bool, incremental: Incremental | None = None,
              previous_rows: int = 0, fingerprint: dict | None = None, clock: RunClock | None = None,
              early: EarlyRay | None = None) -> RunResult:
    """``fingerprint``: the job's, when the caller has it already (it leaves output.path out, so a version
    folder's is its root's): the model's files and the input stamps are then read once per run. ``clock``: when
    the run started (run_job's entry, before preflight); None: now. ``early``: the Ray, shipped model and workers
    run_job set up beside the id scan (this run shuts that Ray down, as one it started, and runs or ends those
    workers); None: they are set up here."""
    owned = early is not None and early.started  # Ray started beside the scan: this run's to shut down
    early_workers = early.workers if early is not None else None  # asked for beside the scan: this run's
    clock = clock or RunClock.now()
    started, started_at = clock.perf, clock.wall
    index_build = plan_index_build(job, plan.units, plan.index)  # None for parquet; checked by preflight
    output = tree_path(job.output.path)
    OutputLayout(output).store.mkdir(output)
    fingerprint = fingerprint or job_fingerprint(job, files=plan.files, model_dir=plan.model_dir,
                                                 model_sha256=early.model.sha256 if early is not None else None)
    manifest = Manifest.open(output, fingerprint, overwrite=overwrite)
    done = done_units(manifest.done(verify=True), plan.units)  # parts checked by sha256, rows by the plan's
    manifest.clean_partials(done)  # temporaries, unrecorded units' files, orphan parts of other attempts
    todo = [u for u in plan.units if u.id not in done]
    if done:
        log.warning("resuming %s: %d of %d units already done", output, len(done), len(plan.units))

    this_run, per_worker, peaks = Counters(), [], {}
    spans: list[UnitSpan] = []
    devices: dict[int, DeviceInfo] = {}  # slot -> the device its worker measured
    warned: set[str] = set()  # device warnings logged: each line once, not once per unit or worker
    scheduler = Scheduler(make_actor=lambda slot: None, workers=0)  # replaced below when there is work
    finished = done  # the units with a record once the scheduler is through (this run's added below)
    diff = None  # the incremental diff's report section, when there was a previous version to look in
    fitted: dict = {}  # the int8/uint8 calibration's report section, when this run fitted one: its rows, seconds
    sample: list = []  # and its sample: texts and pieces (their vectors, what each text cost, their spans)
    if todo:
        started_ray = connect(job.cluster) or owned
        try:
            workers = plan_workers(job.cluster)
            if workers.workers > plan.workers and len(plan.units) < workers.workers * UNITS_PER_WORKER:
                log.warning("%d units were cut for %d worker(s), the cluster runs %d: set cluster.workers: %d so "
                            "each worker gets its share", len(plan.units), plan.workers, workers.workers,
                            workers.workers)
            elif not done and len(todo) < workers.workers:  # a resume with a few units left is expected
                log.warning("%d of %d workers sit idle: %d unit(s) to encode", workers.workers - len(todo),
                            workers.workers, len(todo))
            code = this_code()  # every worker and task checks theirs against it before it reads or writes
            if incremental is not None and incremental.previous:  # before any worker takes a unit
                incremental, diff = _diff_night(job, todo, incremental, code=code,
                                                beside_workers=early_workers is not None)
            # read here once (or beside the id scan); each node's workers materialize it from Ray
            model = early.model if early is not None else ship_model(plan.model.dir)
            scheduler = (early_workers if early_workers is not None  # asked for beside the id scan, or now
                         else _worker_pool(job, model=model, workers=workers, code=code,
                                           count=min(workers.workers, len(todo))))
            try:
                scheduler.keep(min(workers.workers, len(todo)))  # early ones: a resumed run may have fewer left
                # int8/uint8: the sample embedded by the run's workers, as they start (before any configure)
                previous = tree_path(incremental.previous).parent if incremental and incremental.previous else None
                calibration = prepare_quantization(
                    job, plan.units, output, dim=plan.model.vector_dim, previous=previous,
                    embed=lambda texts: _embed_on_workers(scheduler, texts, timed=fitted, sample=sample))
                description = _describe(job, plan, output, calibration)  # before any part: they carry it
            except BaseException:  # its workers ended here: Ray may be a cluster this run joined, and stays up
                scheduler.stop()
                raise
            # in the object store once, for every worker's configure; with the calibration sample's vectors when
            # kept (up to KEEP_BYTES): the units do not embed its rows again
            setup = ray.put(WorkerSetup(output_path=str(output), incremental=incremental, calibration=calibration,
                                        description=description, sampled=_kept_sample(sample, plan.units)))
            for _, pieces in sample:  # a worker may end before any unit: its device is known from its pieces
                for piece in pieces:
                    _noted(piece.span, spans=spans, devices=devices, peaks=peaks, calibration=True)
            sample.clear()  # the driver's copy of the sample's vectors: the object store holds them now
            per_worker = [Counters() for _ in range(scheduler.workers)]
            with progress_bar(total=sum(u.num_rows for u in todo), desc=job.name, enabled=progress) as bar:
                for result in scheduler.run(todo, ready=lambda actor: actor.configure.remote(setup)):
                    counters = _noted(result, spans=spans, devices=devices, peaks=peaks).counters
                    this_run.merge(counters)
                    per_worker[result.worker].merge(counters)
                    _warn_once(slower_than_float32(devices[result.worker], job.model.dtype), warned)
                    bar.update(counters.rows + counters.skipped_rows)
                    elapsed = max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix(tokens_per_s=f"{this_run.tokens / elapsed:,.0f}", refresh=False)
            finished = _finish_parts(manifest, plan.units)
            # while Ray is up: sample, train, add (shards on this Ray's workers), merge, recall
            index_report = (index_build(run_shards=shard_runner(job.cluster, workers, code=code)) if index_build
                            else None)
        finally:
            disconnect(started_ray)
    else:
        record = read_record(output) or {}  # the calibration of the finished run, for its record
        calibration = Calibration(**record["calibration"]) if "calibration" in record else None
        _describe(job, plan, output, calibration)
        if early_workers is not None:  # nothing to embed: their CPUs and GPUs are the index's shards'
            early_workers.stop()
        index_report = _index_alone(job, index_build) if index_build else None  # nothing left to embed
        disconnect(owned)  # a Ray started beside the id scan (the index's shards ran on it), now done with

    total = Counters()
    for record in finished.values():  # the manifest's records: the output's totals, resumed units included
        total.merge(Counters.from_dict(record["counters"]))
    _merge_skipped(manifest, output)
    wall_seconds, ended_at = time.perf_counter() - started, time.time()  # the units' spans are on time.time()
    report = build_report(
        total, this_run=this_run, wall_seconds=wall_seconds, workers=len(per_worker),
        units={"total": len(plan.units), "skipped_as_done": len(done), "encoded": len(todo) - len(scheduler.failed),
               "retried": scheduler.retried, "failed": len(scheduler.failed),
               "failed_units": [f.to_dict() for f in scheduler.failed],
               "retried_units": [r.to_dict() for r in scheduler.retries],
               "failed_starts": [f.to_dict() for f in scheduler.start_failures]},
        peak_rss_mb={"driver": round(peak_rss_mb(), 1),
                     "workers": [peaks.get(i) for i in range(len(per_worker))]},
    )
    if index_report is not None:
        report["index"] = index_report
    if incremental is not None:
        report["incremental"] = {"reused": total.reused_rows, "encoded": total.rows - total.reused_rows,
                                 "dropped": max(previous_rows - total.previous_ids, 0), "usd_saved": None}
        if diff is not None:
            report["incremental"]["diff"] = diff
    if fitted:
        report["calibration"] = {**fitted, "rows_kept": this_run.sampled_rows}
    report = extend_report(report, {"job": job.name, **run_metrics(
        report, this_run=this_run, spans=spans, devices=devices_by_slot(devices, slots=len(per_worker)),
        started_at=started_at, wall_seconds=wall_seconds, dtype=job.model.dtype, model_config=plan.model.config,
        cost=job.cost, ended_at=ended_at)})
    fill_usd_saved(report, this_run=this_run)
    sweep_temporaries(output)  # a killed write's .tmp files: never left in a finished output
    report = record_run(output, report, started_at=started_at, this_run=this_run)  # runs/<id>/, then the output's
    return RunResult(output_path=output, report=report)


def _warn_once(line: str | None, warned: set[str]) -> None:
    if line and line not in warned:
        warned.add(line)
        log.warning(line)


def _describe(job: JobSpec, plan: RunPlan, output: TreePath, calibration: Calibration | None) -> OutputDescription:
    """The output's record, written to its embedpipe.json (and handed to the workers for every part)."""
    description = plan.describe(job, calibration=calibration)
    write_description(output, description)
    return description


def _diff_night(job: JobSpec, todo: list, incremental: Incremental, *, code: CodeId,
                beside_workers: bool) -> tuple[Incremental, dict]:
    """The night's diff as Ray tasks (embedpipe/cluster/diff.py), handed to the workers with the Incremental.
    ``beside_workers``: the run's workers, asked for beside the id scan, hold their CPUs meanwhile."""
    night = diff_on_ray(job, todo, parts=incremental.previous_parts, previous=incremental.previous_units, code=code,
                        beside_workers=beside_workers)
    log.info("incremental diff: %s", night.stats.to_dict())
    return replace(incremental, previous_units={}, same_part=night.same_part, moved=night.moved), \
        night.stats.to_dict()


def _index_alone(job: JobSpec, index_build: IndexBuild) -> dict:
    """The index step of a run with nothing left to embed; shard workers get a Ray connected for them."""
    if not index_build.needs_workers:
        return index_build()
    started_ray = connect(job.cluster)
    try:
        return index_build(run_shards=shard_runner(job.cluster, plan_workers(job.cluster), code=this_code()))
    finally:
        disconnect(started_ray)


def _finish_parts(manifest: Manifest, units: list[Unit]) -> dict[str, dict]:
    """After the last unit: the finished units' records; every part no record names (an orphan of a killed or
    timed-out attempt) is deleted, so vectors/ holds each row once for readers of the folder itself."""
    done = done_units(manifest.done(), units)
    manifest.clean_partials(done)
    return done


def _merge_skipped(manifest: Manifest, output: TreePath) -> None:
    """One ``skipped.parquet`` (id, reason) from the per-unit files, in unit order."""
    files = manifest.skipped_files()
    layout = OutputLayout(output)
    if not files:
        layout.store.remove(layout.skipped)
        return
    found = layout.store.read_many(files)
    tables = [pq.read_table(pa.BufferReader(found[f])) for f in files if f in found]  # in unit order
    atomic_write_table(pa.concat_tables(tables), layout.skipped)
