"""The index build, run by the driver after every unit is embedded:

    scan parts (ids, uniform sample, hold-out queries) -> ids.parquet
    -> for each candidate: train (driver) -> add (workers: per-unit shards | driver: in unit order)
       -> merge shards in unit-id order -> exact neighbours -> recall, tune nprobe / efSearch
    -> index.faiss, index.json, holdout.parquet under <output.path>/index/

The parts are the manifest's (each unit's recorded part: an orphan of a killed attempt is never read). An
output in an object store is built in a local temporary folder (its shards added in this process) and
uploaded, index.json last: the index there is finished once index.json exists, as it is locally.

Sharded kinds (IVF without refine) are added by the workers, one shard per unit, merged by inverted
list. Flat, HNSW, exhaustive codes and refine indexes are added by the driver from the parts in unit
order (an HNSW graph cannot be merged from shards; a flat index is a copy). Either way one part is
read at a time: the driver never holds all vectors, only the index it builds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa

from embedpipe.config import JobSpec
from embedpipe.index.factory import IndexSpec
from embedpipe.index.ids import IdMapWriter, IdPlan, NativeIdCheck, plan_ids
from embedpipe.index.merge import merge_in_memory, merge_on_disk
from embedpipe.index.parts import (Part, Sample, UniformSampler, existing_parts, read_chunk_columns, read_ids,
                                    read_vectors)
from embedpipe.index.plan import IndexPlan, plan_for_vectors
from embedpipe.index.recall import TIE_SLACK, ExactNeighbours, Neighbours, Tuning, tune
from embedpipe.index.shard import ShardBuilder, ShardContext, ShardResult
from embedpipe.index.train import train_index
from embedpipe.io.layout import IndexLayout, OutputLayout, atomic_move, atomic_path, atomic_write_table, atomic_write_text
from embedpipe.io.manifest import Manifest
from embedpipe.report.counters import Counters

log = logging.getLogger(__name__)

# (context, parts) -> shard results as they finish: the cluster runs ShardWorker tasks (the index
# package never starts or joins Ray itself; embedpipe/cluster/shards.py is the driver's)
RunShards = Callable[[ShardContext, list[Part]], Iterable[ShardResult]]

K = 10
FORMAT_VERSION = 1
REFINE_K_FACTORS = (4, 16, 64)  # refine stages re-rank k * k_factor candidates
EF_SEARCH = (16, 32, 64, 128, 256, 512, 1024)


@dataclass
class Built:
    spec: IndexSpec
    index: object  # faiss.Index, trained, filled, tuned
    tuning: Tuning
    on_disk: bool
    seconds: float

    def summary(self) -> dict:
        m = self.tuning.chosen
        return {"factory": self.spec.factory, "recall_at_10": m.recall_at_10, "recall_at_1": m.recall_at_1,
                "search_params": m.params, "target_reached": self.tuning.reached,
                "build_seconds": round(self.seconds, 3)}


def search_sweeps(spec: IndexSpec, *, k: int) -> list[list[dict]]:
    """Search settings to try: sweeps of settings, each cheapest first."""
    factors = [{"k_factor_rf": f} for f in REFINE_K_FACTORS] if spec.refine else [{}]
    if spec.kind == "ivf":
        probes = [2 ** i for i in range(spec.nlist.bit_length()) if 2 ** i < spec.nlist] + [spec.nlist]
        coarse = (lambda p: {"quantizer_efSearch": max(64, 2 * p)}) if spec.coarse_hnsw else (lambda p: {})
        return [[{"nprobe": p, **coarse(p), **f} for p in probes] for f in factors]
    if spec.kind == "hnsw":
        return [[{"efSearch": ef, **f} for ef in EF_SEARCH if ef >= k] for f in factors]
    return [factors]


class IndexBuild:
    """Built once per run by the driver (before any worker starts: the plan is checked then);
    called after every unit is embedded."""

    def __init__(self, job: JobSpec, plan: IndexPlan, *, parts: list[Part], manifest: Manifest | None = None):
        """``parts``: the planned parts, in unit order; ``manifest`` (the driver's): the parts are then the
        ones its unit records name, else the planned files that exist (tests, notebooks)."""
        self.job, self.plan, self.planned, self.manifest = job, plan, parts, manifest
        self.run_shards: RunShards | None = None
        self.target = OutputLayout(job.output.path).index  # where the finished index lives
        self.remote = not self.target.store.local
        self.files = self.target  # where it is built: a local temporary folder for an object store
        self.dir, self.work = self.target.dir, self.files.work
        self.timer = Counters(stages={})  # seconds per index stage: sample, train, add, merge, tune, write

    @property
    def needs_workers(self) -> bool:
        """Some candidate is added as per-unit shards, by workers when the caller hands ``run_shards``."""
        return not self.remote and any(spec.sharded for spec in self.plan.candidates)

    def __call__(self, *, run_shards: RunShards | None = None) -> dict:
        """Build (or keep the index an earlier run built from these same parts); the report section.
        ``run_shards`` runs the shard tasks on workers (the driver's, on the Ray it already connected);
        None adds the shards in this process (tests, notebooks)."""
        started = time.perf_counter()
        recorded = None if self.manifest is None else {
            unit: str(self.manifest.part_paths(record)[0]) for unit, record in self.manifest.done().items()}
        self.parts = existing_parts(self.planned, recorded=recorded)
        missing = len(self.planned) - len(self.parts)
        if missing:
            log.warning("index: %d of %d units have no vector part (failed units); the index leaves them out",
                        missing, len(self.planned))
        previous = self._finished()
        if previous is not None:
            log.warning("index: %s already holds the index of these parts; kept", self.dir)
            return previous
        self.plan = plan_for_vectors(self.job, self.plan, rows=sum(p.rows for p in self.parts))  # chunks: re-chosen
        self.k = min(K, self.plan.rows - 1)
        self.run_shards = None if self.remote else run_shards  # object stores: shards in this process's temp
        self.target.store.remove(self.target.meta)  # not finished until written again
        if self.remote:
            self.files = IndexLayout(tempfile.mkdtemp(prefix="embedpipe-index-"))
            self.work = self.files.work
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True, exist_ok=True)
        with self.timer.time("sample"):
            sample, ids = self._scan()
        query_ids = self._query_ids(sample, ids)
        exact: Neighbours | None = None
        tried: list[dict] = []
        best: Built | None = None
        for spec in self.plan.candidates:
            built, exact = self._build(spec, sample, ids, query_ids, exact)
            tried.append(built.summary())
            log.info("index %s: recall@10 %.4f with %s", spec.factory, built.tuning.chosen.recall_at_10,
                     built.tuning.chosen.params)
            if best is None or built.tuning.reached or built.tuning.chosen.recall_at_10 > best.tuning.chosen.recall_at_10:
                best = built  # the first to reach the target, else the best recall measured
            if built.tuning.reached:
                break
            del built
        with self.timer.time("write"):
            report = self._write(best, tried, ids, query_ids, exact)
        report["build_seconds"] = round(time.perf_counter() - started, 3)
        report["stages"] = {k: round(v, 3) for k, v in self.timer.stages.items()}
        self._write_meta(report)
        shutil.rmtree(self.work, ignore_errors=True)
        if self.remote:
            self._upload(on_disk=report["on_disk"])
        return report

    def _upload(self, *, on_disk: bool) -> None:
        """The finished files from the local build folder to the store, index.json last; the folder removed."""
        built, target, store = self.files, self.target, self.target.store
        try:
            for name in ("ids", "holdout", "ivfdata", "faiss"):
                local = getattr(built, name)
                if os.path.exists(local):
                    store.put_file(local, getattr(target, name))
            if not on_disk:
                store.remove(target.ivfdata)
            store.put_file(built.meta, target.meta)
        finally:
            shutil.rmtree(built.dir, ignore_errors=True)
            self.files = target

    def _parts_fingerprint(self) -> list:
        if self.remote:  # an attempt-unique name is written once, by one PUT: it names the part's content
            return [[p.unit_id, p.rows, posixpath.basename(p.path)] for p in self.parts]
        return [[p.unit_id, p.rows, os.path.getsize(p.path), os.stat(p.path).st_mtime_ns] for p in self.parts]

    def _finished(self) -> dict | None:
        """The report of an index built from exactly these parts by this same job, if there is one."""
        meta_path, store = self.target.meta, self.target.store
        if not (store.exists(meta_path) and store.exists(self.target.faiss)):
            return None
        meta = json.loads(store.read_bytes(meta_path))
        same = meta.get("parts") == self._parts_fingerprint() and meta.get("job") == self.job.record()
        return meta.get("report") if same else None

    # ------------------------------------------------------------------ passes over the parts

    def _scan(self) -> tuple[Sample, IdPlan]:
        """One pass: integer ids checked for uniqueness, uniform training sample, hold-out queries;
        a second, id-only pass writes ids.parquet."""
        train = max(self.plan.train_rows(s) for s in self.plan.candidates)
        sampler = UniformSampler(total=self.plan.rows, train=train, queries=self.plan.queries)
        check = NativeIdCheck()
        for part in self.parts:
            ids, vectors = read_vectors(part.path)
            if len(ids) != part.rows:
                raise RuntimeError(f"{part.path} has {len(ids)} rows, unit {part.unit_id} has {part.rows}")
            check(ids)
            sampler(ids, vectors)
        chunked = bool(self.parts) and read_chunk_columns(self.parts[0].path) is not None
        # chunked outputs (input.chunking): dense index ids, each mapped to (id, chunk) in ids.parquet
        plan = plan_ids([(p.unit_id, p.rows) for p in self.parts], native=check.unique() and not chunked)
        writer = IdMapWriter(self.files.work_ids, plan)
        for part in self.parts:
            writer(part.unit_id, read_ids(part.path), read_chunk_columns(part.path) if chunked else None)
        writer.close()
        return sampler.result(self.plan.dim), plan

    def _query_ids(self, sample: Sample, ids: IdPlan) -> np.ndarray:
        if ids.native:
            return sample.query_ids.cast(pa.int64()).to_numpy(zero_copy_only=False)
        return sample.query_positions.astype(np.int64)  # dense: index id == position

    def _build(self, spec: IndexSpec, sample: Sample, ids: IdPlan, query_ids: np.ndarray,
               exact: Neighbours | None) -> tuple[Built, Neighbours]:
        started = time.perf_counter()
        plan = self.plan
        with self.timer.time("train"):
            index = train_index(spec, sample.train[: plan.train_rows(spec)], dim=plan.dim, metric=plan.metric)
        on_disk = spec.sharded and plan.on_disk(spec)
        if spec.sharded:
            part_exact = self._add_on_workers(index, sample, ids, on_disk)
        else:
            with self.timer.time("add"):
                part_exact = self._add_on_driver(index, sample, ids)
        exact = exact if exact is not None else part_exact
        with self.timer.time("tune"):
            tuning = tune(index, sweeps=search_sweeps(spec, k=self.k), queries=sample.queries,
                          query_ids=query_ids, exact=exact, k=self.k, target=plan.target_recall)
        return Built(spec, index, tuning, on_disk, time.perf_counter() - started), exact

    def _add_on_driver(self, index, sample: Sample, ids: IdPlan) -> Neighbours:
        exact_of = ExactNeighbours(sample.queries, width=self.k + 1 + TIE_SLACK, metric=self.plan.metric)
        exact = Neighbours.empty(len(sample.queries), self.k + 1 + TIE_SLACK)
        for part in self.parts:  # unit order
            raw, vectors = read_vectors(part.path)
            index_ids = ids.index_ids(part.unit_id, raw)
            index.add_with_ids(vectors, index_ids)
            exact = exact.merge(exact_of(vectors, index_ids))
        return exact

    def _add_on_workers(self, index, sample: Sample, ids: IdPlan, on_disk: bool) -> Neighbours:
        import faiss

        shard_dir = self.files.shards
        context = ShardContext(trained=faiss.serialize_index(index), ids=ids,
                               queries=sample.queries, width=self.k + 1 + TIE_SLACK, metric=self.plan.metric,
                               shard_dir=str(shard_dir))
        if self.run_shards is not None:
            results = self.run_shards(context, self.parts)
        else:  # the same shard builder, in this process
            builder = ShardBuilder(context)
            results = (builder(part) for part in self.parts)
        exact = Neighbours.empty(len(sample.queries), self.k + 1 + TIE_SLACK)
        shards: dict[str, str] = {}
        with self.timer.time("add"):
            for r in results:  # as they finish; the merge order is fixed below
                exact = exact.merge(r.exact)
                shards[r.unit_id] = r.shard
        in_unit_order = [shards[p.unit_id] for p in self.parts]
        with self.timer.time("merge"):
            if on_disk:
                merge_on_disk(index, in_unit_order, self.files.ivfdata)
            else:
                merge_in_memory(index, in_unit_order)
        shutil.rmtree(shard_dir, ignore_errors=True)
        return exact

    # ------------------------------------------------------------------ outputs

    def _write(self, best: Built, tried: list[dict], ids: IdPlan, query_ids: np.ndarray,
               exact: Neighbours) -> dict:
        import faiss

        files = self.files
        with atomic_path(files.faiss) as tmp:  # renamed into place after ids.parquet and holdout.parquet
            faiss.write_index(best.index, str(tmp))
            atomic_move(files.work_ids, files.ids)
            atomic_write_table(pa.table({"index_id": query_ids, "exact": pa.array(list(exact.ids)),
                                         "exact_score": pa.array(list(exact.scores))}), files.holdout)
        if not best.on_disk:
            files.ivfdata.unlink(missing_ok=True)
        size = files.faiss.stat().st_size + (os.path.getsize(files.ivfdata) if best.on_disk else 0)
        m = best.tuning.chosen
        report = {
            "factory": best.spec.factory,
            "auto": self.plan.auto,
            "kind": best.spec.kind,
            "metric": self.plan.metric,
            "ntotal": int(best.index.ntotal),
            "recall_at_10": m.recall_at_10,
            "recall_at_1": m.recall_at_1,
            "search_params": m.params,
            "target_recall": self.plan.target_recall,
            "target_reached": best.tuning.reached,
            "bytes": size,
            "build_seconds": None,  # set by the caller, writing included
            "on_disk": best.on_disk,
            "ids": "native" if ids.native else "dense",
            "queries": int(len(query_ids)),
            "train_vectors": self.plan.train_rows(best.spec),
            "path": str(self.dir),
            "tried": tried,
        }
        warnings = [*self.plan.warnings, *filter(None, [self._warning(best)])]
        for warning in warnings:
            log.warning(warning)
        report["warnings"] = warnings
        return report

    def _write_meta(self, report: dict) -> None:
        """index.json, written last: what opening and searching the index needs, and what makes a
        rerun over the same parts keep this index."""
        meta = {"format_version": FORMAT_VERSION, **{k: report[k] for k in (
                    "factory", "kind", "metric", "ntotal", "search_params", "ids", "on_disk",
                    "recall_at_10", "recall_at_1", "target_recall", "target_reached")},
                "dim": self.plan.dim, "query_prompt": self.plan.query_prompt,
                "normalize": self.plan.metric == "inner_product",  # resolved (the job record may say auto)
                "job": self.job.record(),
                "parts": self._parts_fingerprint(), "report": report}
        atomic_write_text(self.files.meta, json.dumps(meta, indent=2) + "\n")

    def _warning(self, best: Built) -> str | None:
        if best.tuning.reached:
            return None
        spec, m = best.spec, best.tuning.chosen
        if spec.exact:
            fix = "exact search: only ties wider than the extra neighbours kept can cost recall"
        elif self.plan.auto:
            fix = (f"no index that fits output.index_memory_gb={self.job.output.index_memory_gb:g} reaches it; "
                   f"{self.plan.upgrade or 'raise output.index_memory_gb'} (a larger code), "
                   f"or lower output.target_recall")
        elif spec.code.startswith("PQ") and not spec.refine:
            fix = (f"add a refine stage (output.index: {spec.factory},RFlat or {spec.factory},Refine(SQfp16)) "
                   f"or a larger code (more PQ sub-quantizers, SQ8, SQfp16), or use output.index: auto")
        elif spec.kind == "hnsw":
            fix = f"use a larger graph (HNSW{2 * spec.hnsw_m}) or output.index: auto"
        else:
            fix = "use a larger code (SQfp16 or Flat), a refine stage (,RFlat), or output.index: auto"
        params = ", ".join(f"{k}={v}" for k, v in m.params.items()) or "exhaustive search"
        return (f"index {spec.factory} reaches recall@10 {m.recall_at_10:.3f} at best ({params}), below "
                f"output.target_recall {self.plan.target_recall}: {fix}")


def plan_index_build(job: JobSpec, units: list, plan: IndexPlan | None) -> IndexBuild | None:
    """The driver's index step for ``units`` and the run's index plan (checked by preflight); None
    when the job writes no index."""
    if plan is None:
        return None
    layout = OutputLayout(job.output.path)  # where ParquetPartWriter puts each unit's part (the record names it)
    return IndexBuild(job, plan, parts=[Part(u.id, str(layout.part(u.id)), u.num_rows) for u in units],
                      manifest=Manifest(job.output.path))
