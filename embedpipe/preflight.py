"""Checks that run on the driver before any worker starts or any model runs.

An object store that cannot serve input.path or take output.path's writes (unreachable endpoint, missing
bucket, no or refused credentials, a missing permission, no fsspec package for the protocol), a corrupt or
unreadable file, a missing column, ids of two types across the input, a null id
(under ``input.on_bad_row: error``), duplicate ids and a model directory with missing or unsafe
files are each reported here, naming the file and the fix, so a bad nightly job fails in seconds
instead of after an hour of encoding. The checks that span the job and another package (the
output dtype against FAISS, the index factory string, model.prompt_name and output.dim against the
model) run here too; ``embedpipe/config.py`` is the schema alone.

``preflight`` returns the run's ``RunPlan``: the units, the model's facts (resolved directory,
sentence-transformers spec, config.json, dimension, prompts, FLOPs per token), the output root and
the index plan. The model directory is resolved here, once per run.

Ids: every file must hold them as one Arrow type (int32 and int64 are two types: the output
keeps the input's id type, and parts of two types break reading ``vectors/`` and later
incremental runs). Null ids are never duplicates; under ``skip`` and ``embed_empty`` the worker
skips their rows (``embedpipe/io/rows.py``).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embedpipe.config import JobError, JobSpec, OutputConfig
from embedpipe.errors import BadJob
from embedpipe.index.factory import FactoryError, parse_factory
from embedpipe.index.plan import IndexPlan, ModelFacts, plan_index
from embedpipe.io import fs
from embedpipe.io.duplicates import IdOccurrences, exact_keys, id_keys
from embedpipe.io.formats import UnitReader, plan_input
from embedpipe.io.describe import ModelRecord, OutputDescription, describe
from embedpipe.io.quantize import Calibration, stored_type
from embedpipe.io.rows import null_id_error, valid_rows
from embedpipe.io.store import TreePath, tree_path
from embedpipe.report.flops import read_model_config
from embedpipe.units import InputError, Unit

if TYPE_CHECKING:
    from embedpipe.models.st import STSpec

MAX_LISTED = 5  # duplicate ids named in an error message
READ_THREADS = 16  # units whose ids the duplicate check reads at once
READ_AHEAD = 64  # units read ahead of the check (bounds the ids held at once)


class ModelError(BadJob, ValueError):
    """The model directory cannot be used as it is: names the file and the fix."""


@dataclass(frozen=True)
class ModelPlan:
    """The model's facts, worked out once from its files (no weights loaded) and handed down."""

    dir: Path  # model.path resolved offline
    st: STSpec  # the sentence-transformers modules (pooling, normalize, prompts, Dense, transformer_dir)
    config: dict  # the transformer's config.json
    dim: int  # the model's own vector dimension (after its Dense layers)
    vector_dim: int  # the stored vectors': output.dim, else dim
    normalize: bool  # vectors are L2-normalised (model.normalize, or the model's Normalize module)
    pooling: str  # resolved: model.pooling, else the Pooling module's, else the class's default
    max_seq_len: int  # resolved: model.max_seq_len, else the sentence-transformers max length, else positions
    prompt: str  # resolved: what goes before every document (model.prompt, prompt_name, the default prompt)

    @property
    def prompts(self) -> dict[str, str]:
        return self.st.prompts

    def flops_per_token(self, seq_len: float) -> float:
        """Forward FLOPs per token at ``seq_len`` (the family's own rule, embedpipe/report/flops.py)."""
        from embedpipe.report.flops import flops_per_token_from_config

        return flops_per_token_from_config(self.config, seq_len)

    def index_facts(self) -> ModelFacts:
        return ModelFacts(dim=self.vector_dim, normalize=self.normalize, query_prompt=self.prompts.get("query", ""))

    def record(self, name: str) -> ModelRecord:
        """The model as the output's embedpipe.json names it: as given, as resolved, and by its files' sha256."""
        from embedpipe.io.manifest import HashCache, model_files, model_fingerprint

        hashes = HashCache()  # the run's fingerprint hashed these already: size, time and inode hits
        weights = {p.relative_to(self.dir).as_posix(): hashes.sha256(p) for p in model_files(self.dir)
                   if p.suffix in (".safetensors", ".bin")}
        return ModelRecord(name=name, path=str(self.dir), sha256=model_fingerprint(self.dir, cache=hashes),
                           weights=weights)


@dataclass(frozen=True)
class RunPlan:
    """Everything a run decides before any worker starts; the driver, calibration, index build and
    report read it, and nothing resolves the model or parses output.index again."""

    files: list[str]
    units: list[Unit]
    duplicate_rows: int  # rows dropped by on_duplicate_id: keep_first
    model: ModelPlan
    output: TreePath  # output.path (the versioned root for versioned outputs): a Path, or a Url for object stores
    index: IndexPlan | None  # None for output.format: parquet
    workers: int = 1  # the workers the units were cut for (embedpipe/units.py: unit_size)

    @property
    def model_dir(self) -> Path:
        return self.model.dir

    @property
    def rows(self) -> int:
        return sum(u.num_rows for u in self.units)

    def describe(self, job: JobSpec, *, calibration: Calibration | None = None,
                 chunking: dict | None = None) -> OutputDescription:
        """The output's record (embedpipe.json, and every part's schema metadata) from the facts resolved here;
        ``calibration``: the run's int8/uint8 ranges; ``chunking``: the settings of a chunked run, else None."""
        m = self.model
        return describe(model=m.record(job.model.path), dim=m.vector_dim, model_dim=m.dim, dtype=job.output.dtype,
                        normalized=m.normalize, pooling=m.pooling, max_seq_len=m.max_seq_len, prompt=m.prompt,
                        query_prompt=m.prompts.get("query", ""), calibration=calibration,
                        chunking=chunking if chunking is not None else job.input.chunking.record(
                            max_seq_len=m.max_seq_len))


Plan = RunPlan  # the name callers used before RunPlan carried the model and index facts


def preflight(job: JobSpec, *, workers: int | None = None) -> RunPlan:
    """Check the job against its output, input and model, in that order of cost; the run's plan.

    ``workers``: how many workers will share the units (the driver's estimate before it starts Ray,
    embedpipe/cluster/connect.py: expected_workers); default cluster.workers, else 1."""
    return scan_ids(check_job(job, workers=workers))


@dataclass(frozen=True)
class CheckedJob:
    """A job whose output, input (files, columns, units) and model passed preflight's checks; its ids are still to
    be scanned (``scan_ids``): the one check that reads every unit."""

    job: JobSpec
    files: list[str]
    units: list[Unit]  # before the duplicate-id scan: no rows dropped yet
    model: ModelPlan
    index: IndexPlan | None  # None for output.format: parquet
    workers: int


def check_job(job: JobSpec, *, workers: int | None = None) -> CheckedJob:
    """Preflight's checks up to the ids: output settings and stores, the input's listing, footers, columns and units,
    the model's files, the index settings. The driver starts Ray once these passed, beside ``scan_ids``
    (cluster/early.py)."""
    workers = workers or job.cluster.workers or 1
    fs.use_job_storage(job)  # the job's storage_options for its input and output stores, in this process
    check_output_settings(job.output)
    check_stores(job)
    if job.output.versioned:
        check_current(tree_path(job.output.path))
    inputs = plan_input(job.input, workers=workers)  # lists the input, checks its columns and text, cuts the units
    model = plan_model(job)
    index = None
    if job.output.format != "parquet":  # the rows a unit holds, whatever the scan drops from it
        index = plan_index(job, rows=sum(u.num_rows for u in inputs.units), model=model.index_facts())
    return CheckedJob(job=job, files=inputs.files, units=inputs.units, model=model, index=index, workers=workers)


class ScanStopped(Exception):
    """``scan_ids`` was asked to stop (its ``stop`` set: the run was interrupted) before it was through."""


def scan_ids(checked: CheckedJob, *, stop: threading.Event | None = None) -> RunPlan:
    """The duplicate-id scan over every unit's ids (with their type and nulls): the run's plan. ``stop``: set from
    another thread, the scan raises ScanStopped at its next unit (its reads in flight finish, no new one starts)."""
    job = checked.job
    reader = UnitReader(text_column=job.input.text_column, id_column=job.input.id_column)
    units, dropped = _resolve_duplicates(checked.units, reader=reader, id_column=job.input.id_column,
                                         policy=job.input.on_duplicate_id, on_bad_row=job.input.on_bad_row,
                                         stop=stop)
    return RunPlan(files=checked.files, units=units, duplicate_rows=dropped, model=checked.model,
                   output=tree_path(job.output.path), index=checked.index, workers=checked.workers)


def check_output_owner(job: JobSpec, plan: RunPlan) -> None:
    """What ``run`` refuses about output.path, asked the same way without writing: a folder embedpipe did not
    create (OutputNotOwned, exit 5), and one holding another job's output (ManifestMismatch, exit 2)."""
    from embedpipe.io.manifest import Manifest, job_fingerprint
    from embedpipe.io.ownership import check_output

    check_output(job.output.path)
    if not job.output.versioned:  # a versioned root starts a new version for another job
        Manifest(job.output.path).check_job(job_fingerprint(job, files=plan.files, model_dir=plan.model_dir))


def describe_units(plan: RunPlan, *, workers_source: str) -> list[str]:
    """The work plan for ``embedpipe validate``: files, units, rows per unit, workers; a warning line when a
    worker would get no unit."""
    sizes = sorted(u.num_rows for u in plan.units)
    per_unit = (f"{sizes[0]:,} rows each" if sizes and sizes[0] == sizes[-1]
                else f"{sizes[0]:,} to {sizes[-1]:,} rows each" if sizes else "no rows")
    files = f"{len(plan.files)} file{'s' * (len(plan.files) != 1)}"
    lines = [f"plan: {len(plan.units)} units, {plan.rows:,} rows ({per_unit}) from {files}, for {plan.workers} "
             f"worker{'s' * (plan.workers != 1)} ({workers_source})"]
    idle = plan.workers - len(plan.units)
    if idle > 0:
        lines.append(f"warning: {idle} of {plan.workers} workers would sit idle: {len(plan.units)} units for "
                     f"{plan.workers} workers (units hold at least {min(sizes or [0]):,} rows); use fewer "
                     f"cluster.workers, or lower input.unit_rows below that")
    return lines


def check_output_settings(output: OutputConfig) -> None:
    """output.dtype against the FAISS index, and the output.index factory string (no I/O)."""
    if output.format != "parquet" and stored_type(output.dtype).quantized:
        raise JobError("output.dtype", f"{output.dtype} vectors cannot feed the FAISS index (output.format: "
                       f"{output.format}); FAISS compresses vectors itself",
                       "keep output.dtype float32 and choose a compressed index (output.index: 'HNSW32,SQ8' "
                       "or 'IVF4096,SQ8' for 8-bit codes, 'IVF4096,PQ32' for fewer bytes), or set "
                       "output.format: parquet")
    if output.index != "auto":
        try:
            parse_factory(output.index)
        except FactoryError as exc:
            raise JobError("output.index", str(exc), "write a valid factory string or output.index: auto") from None


def check_stores(job: JobSpec) -> None:
    """Object-store paths answer before anything is listed or written: the endpoint is reachable, the bucket
    exists, the credentials are accepted and hold the permissions the run needs (output.path: list, write,
    read and delete, by a probe object that is removed again; input.path: list and read). Local paths: nothing
    to check here. A handful of requests (embedpipe/io/fs.py: check_writable, check_readable)."""
    if fs.is_url(job.output.path):
        fs.check_writable(job.output.path, section="output")
    if fs.is_url(job.input.path):
        fs.check_readable(job.input.path, section="input")


def plan_model(job: JobSpec) -> ModelPlan:
    """Resolve model.path (the run's only resolution), check the files a worker will need are there
    and safe, read the model's facts, and check the job's model options against them."""
    from embedpipe.models import resolve
    from embedpipe.models.defaults import model_defaults
    from embedpipe.models.st import model_dim, read_st_spec, resolve_prompt

    try:
        model_dir = resolve.resolve_model_path(job.model.path, storage_options=job.model.storage_options)
    except resolve.ModelNotFound as exc:
        raise ModelError(f"model.path: {exc}") from None
    try:  # torch-free: the Dense modules' configs, and their weight files checked present, not read
        spec = read_st_spec(model_dir, allow_pickle=job.model.allow_pickle, dense_weights="check")
    except (ValueError, KeyError, OSError) as exc:
        raise ModelError(f"model.path: {model_dir}: {exc}") from None
    config = check_model_files(model_dir / spec.transformer_dir, allow_pickle=job.model.allow_pickle)
    try:
        dim = model_dim(model_dir, spec)
    except ValueError as exc:
        raise ModelError(f"model.path: {exc}: copy the model's config.json into the directory again") from None
    check_model_options(job, spec=spec, dim=dim)
    normalize = spec.normalize if job.model.normalize == "auto" else bool(job.model.normalize)
    try:
        defaults = model_defaults(config)  # the family's pooling and positions, from config.json
    except (ValueError, KeyError) as exc:
        raise ModelError(f"model.path: {model_dir / spec.transformer_dir / 'config.json'}: {exc}: fix config.json "
                         f"or use a model embedpipe implements") from None
    return ModelPlan(dir=model_dir, st=spec, config=config, dim=dim, vector_dim=job.output.dim or dim,
                     normalize=normalize, pooling=defaults.pooling(spec, job.model.pooling),
                     max_seq_len=defaults.max_seq_len(spec, job.model.max_seq_len),
                     prompt=resolve_prompt(spec, prompt=job.model.prompt, prompt_name=job.model.prompt_name))


def check_model_options(job: JobSpec, *, spec: STSpec, dim: int) -> None:
    """model.prompt_name and output.dim against the model (``embed()`` checks its options here too)."""
    from embedpipe.models.st import resolve_prompt

    m, o = job.model, job.output
    try:
        resolve_prompt(spec, prompt=m.prompt, prompt_name=m.prompt_name)
    except ValueError as exc:
        raise JobError("model.prompt_name", str(exc), "set model.prompt_name to one of them, "
                       "or a literal prefix in model.prompt") from None
    if o.dim is not None and o.dim > dim:
        raise JobError("output.dim", f"{o.dim} exceeds the model's dimension {dim}",
                       f"set output.dim to at most {dim}, or null for all of them")


def check_model_files(weights_dir: Path, *, allow_pickle: bool) -> dict:
    """config.json (of a model_type embedpipe implements), tokenizer.json and safe weights; config.json read."""
    for name, fix in (("config.json", "copy the model's config.json into the directory"),
                      ("tokenizer.json", "save the fast tokenizer there (AutoTokenizer.save_pretrained)")):
        if not (weights_dir / name).is_file():
            raise ModelError(f"model.path: {weights_dir} has no {name}: {fix}")
    config = check_model_type(weights_dir / "config.json")
    if not any(weights_dir.glob("*.safetensors")):
        pickles = sorted(p.name for p in weights_dir.glob("pytorch_model*.bin"))
        if not pickles:
            raise ModelError(f"model.path: {weights_dir} has no weights (*.safetensors): copy the model's "
                             f"safetensors files into the directory")
        if not allow_pickle:
            raise ModelError(f"model.path: {weights_dir} has only pickled weights ({', '.join(pickles)}): convert "
                             f"them to safetensors, or set model.allow_pickle: true to load them with "
                             f"torch.load(weights_only=True)")
    return config


def check_model_type(config_path: Path) -> dict:
    """config.json's model_type must be one embedpipe implements (else every worker would fail loading it)."""
    from embedpipe.models.families import family

    try:
        config = read_model_config(config_path.parent, transformer_dir="")
    except (ValueError, OSError) as exc:
        raise ModelError(f"model.path: {config_path} is not readable JSON ({exc}): copy the model's config.json "
                         f"into the directory again") from None
    try:
        family(config.get("model_type") if isinstance(config, dict) else None)
    except ValueError as exc:
        raise ModelError(f"model.path: {config_path.parent}: {exc}") from None
    return config


def check_current(root: TreePath) -> None:
    """A versioned output's CURRENT (written by a run, or by hand for a rollback) must name a validated version."""
    from embedpipe.io.layout import OutputLayout
    from embedpipe.versions import current_version, is_validated, version_names

    run_id = current_version(root)
    if run_id is None:
        return  # first run, or no CURRENT: a new version is made
    layout = OutputLayout(root)
    names = version_names(root)
    if Path(run_id).name == run_id and is_validated(root, run_id):
        return
    folder = layout.version(run_id).root
    problem = "does not exist" if run_id not in names else "is not VALIDATED (an unfinished or failed run)"
    good = [name for name in names if is_validated(root, name)]
    listed = ", ".join(good[:MAX_LISTED]) + (f" and {len(good) - MAX_LISTED} older" if len(good) > MAX_LISTED else "")
    write = (f"echo {good[0]} > CURRENT.tmp && mv CURRENT.tmp CURRENT" if layout.store.local
             else f"put the one line {good[0]} into the object {layout.current}") if good else ""
    fix = (f"write one of them into CURRENT ({write}), or remove CURRENT to build a new version from scratch"
           if good else "remove CURRENT to build a new version from scratch")
    raise JobError("output.path", f"{layout.current} names run id {run_id!r}, but {folder} {problem}; validated "
                   f"versions: {listed or 'none'}", fix)


def _resolve_duplicates(units: list[Unit], *, reader: UnitReader, id_column: str, policy: str,
                        on_bad_row: str = "error", stop: threading.Event | None = None) -> tuple[list[Unit], int]:
    """Find ids seen more than once (in input order); error, or mark later copies to drop.

    On the same read of every unit's ids: one id type across the input, and no null id under
    ``on_bad_row: error``. Null ids are left out of the duplicate search."""
    first: tuple[str, pa.DataType] | None = None  # the first unit's file and id type
    with IdOccurrences(rows=sum(u.num_rows for u in units)) as seen:  # bounded memory (embedpipe/io/duplicates.py)
        for u, (unit, ids) in enumerate(zip(units, _read_ids(units, reader=reader, id_column=id_column))):
            if stop is not None and stop.is_set():
                raise ScanStopped(f"the duplicate-id scan stopped at unit {u} of {len(units)}")
            first = first or (unit.file, ids.type)
            _check_id_type(first, unit.file, ids.type, id_column=id_column)
            valid = valid_rows(ids)  # not pyarrow's to_numpy: it imports pandas (0.2 s before Ray's start)
            if on_bad_row == "error" and not valid.all():
                raise null_id_error(unit.file, unit.row_start + int(np.flatnonzero(~valid)[0]))
            seen.add(id_keys(ids)[valid], unit=u, rows=np.flatnonzero(valid))
        def unit_ids(u: int) -> pa.Array:  # read again for the units holding a text id's key seen twice
            return reader.columns(units[u], [id_column]).column(0).combine_chunks()

        exact = first is None or exact_keys(first[1])
        dup_rows = seen.later(values=None if exact else unit_ids)  # [D, 2] (unit, row) of later occurrences
    if not len(dup_rows):
        return units, 0
    if policy == "error":
        examples = []
        for u, row in dup_rows[:MAX_LISTED]:
            ids = reader.columns(units[u], [id_column]).column(0)
            examples.append(f"{ids[int(row)].as_py()!r} ({units[u].file})")
        raise InputError(f"{len(dup_rows)} rows repeat an id seen earlier, e.g. {', '.join(examples)}: "
                         f"make the ids unique, or set input.on_duplicate_id: keep_first")
    drops: dict[int, list[int]] = {}
    for u, row in dup_rows.tolist():
        drops.setdefault(u, []).append(row)
    units = [replace(unit, drop_rows=tuple(sorted(drops[u]))) if u in drops else unit for u, unit in enumerate(units)]
    return units, len(dup_rows)


def _read_ids(units: list[Unit], *, reader: UnitReader, id_column: str) -> Iterator[pa.Array]:
    """Each unit's id column in unit order, read ``READ_THREADS`` at a time (one GET each on an object store),
    at most ``READ_AHEAD`` units ahead of the caller."""
    def read(unit: Unit) -> pa.Array:
        return reader.columns(unit, [id_column]).column(0).combine_chunks()

    pool = ThreadPoolExecutor(READ_THREADS)
    try:
        for start in range(0, len(units), READ_AHEAD):
            yield from pool.map(read, units[start:start + READ_AHEAD])
    finally:  # the caller stopped early (an error, a stopped scan): the reads not begun are dropped
        pool.shutdown(wait=True, cancel_futures=True)


def _check_id_type(first: tuple[str, pa.DataType], file: str, id_type: pa.DataType, *, id_column: str) -> None:
    first_file, first_type = first
    if id_type != first_type:
        raise InputError(f"input ids of two types: {first_file} holds {id_column!r} as {first_type}, {file} as "
                         f"{id_type}: cast the ids to one type in every file (the output keeps the ids' type)")


