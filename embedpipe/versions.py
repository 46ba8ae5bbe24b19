"""Versioned outputs for nightly reindexing: one folder per run, an atomic ``CURRENT`` pointer.

    <output.path>/
      CURRENT                       the run id of the version readers should use (one line)
      versions/<run id>/            vectors/, index/, report.json, _manifest/ of one run
      versions/<run id>/VALIDATED   written once the run finished and passed validation

A run writes its own version folder; only after it finished and validated (every unit done,
row counts add up, index recall reached when there is an index) is ``CURRENT`` replaced by an
atomic rename. A killed or failed run leaves ``CURRENT`` where it was; rerunning the same job
resumes the unfinished version. ``output.keep_versions`` prunes older validated versions and
abandoned unfinished ones, never the current one.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq

from embedpipe.config import JobSpec
from embedpipe.errors import RunError
from embedpipe.io.layout import CURRENT, VALIDATED, VERSIONS, OutputLayout, atomic_write_bytes
from embedpipe.io.manifest import Manifest, vector_salt
from embedpipe.io.ownership import is_output, remove_owned

__all__ = ["CURRENT", "VALIDATED", "VERSIONS"]  # the layout's names, imported from here by earlier callers


class RunFailed(RunError, RuntimeError):
    """The run finished but did not validate: CURRENT was left where it was."""


def current_version(root: str | Path) -> str | None:
    layout = OutputLayout(root)
    if not (Path(layout.current).is_file() if layout.store.local else layout.store.exists(layout.current)):
        return None
    return layout.store.read_bytes(layout.current).decode().strip() or None


def current_path(root: str | Path) -> Path | None:
    """The folder readers should use: the current version, or ``root`` itself when unversioned."""
    version = current_version(root)
    return OutputLayout(root).version(version).root if version else None


def choose_version(root: Path, fingerprint: dict) -> str:
    """Resume the newest unfinished version of this same job, else start a new run id."""
    versions = OutputLayout(root).versions
    current = current_version(root)
    unfinished = sorted((p for p in versions.iterdir() if p.is_dir() and p.name != current
                         and not OutputLayout(p).validated.exists()), reverse=True) if versions.is_dir() else []
    for folder in unfinished[:1]:
        job_file = OutputLayout(folder).job
        if job_file.is_file() and json.loads(job_file.read_text()).get("sha256") == fingerprint["sha256"]:
            return folder.name
    run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    suffix, candidate = 0, run_id
    while (versions / candidate).exists():
        suffix += 1
        candidate = f"{run_id}-{suffix}"
    return candidate


def validate(version_dir: Path, report: dict, *, expected_rows: int) -> None:
    """Every unit done, every input row accounted for and present, index recall reached."""
    problems = []
    if report["units"]["failed"]:
        problems.append(f"{report['units']['failed']} units failed")
    if report["rows"] + report["skipped_rows"] != expected_rows:
        problems.append(f"{report['rows']} rows written + {report['skipped_rows']} skipped != {expected_rows} input rows")
    manifest = Manifest(version_dir)  # the recorded parts, never a listing of vectors/ (orphans are not rows)
    written = sum(pq.ParquetFile(p).metadata.num_rows
                  for record in manifest.done().values() for p in manifest.part_paths(record))
    if written != report["rows"]:
        problems.append(f"the vector parts hold {written} rows, the report says {report['rows']}")
    index = report.get("index") or {}
    if index.get("target_reached") is False:
        problems.append(f"the index reached recall@10 {index.get('recall_at_10')} below output.target_recall")
    if problems:
        raise RunFailed(f"{version_dir.name} did not validate ({'; '.join(problems)}): CURRENT still points at "
                        f"the previous version; fix the cause and rerun the same command to resume")


def promote(root: Path, version: str) -> None:
    """Mark the version validated, then point CURRENT at it (one atomic rename)."""
    layout = OutputLayout(root)
    atomic_write_bytes(layout.version(version).validated, b"")
    atomic_write_bytes(layout.current, f"{version}\n".encode())


def prune(root: Path, *, keep: int | None) -> list[str]:
    """Remove validated versions beyond the newest ``keep`` and unfinished ones older than CURRENT."""
    if keep is None:
        return []
    current = current_version(root)
    folders = _version_folders(root)
    validated = [p for p in folders if OutputLayout(p).validated.exists()]
    doomed = [p for p in validated[keep:] if p.name != current]
    doomed += [p for p in folders if not OutputLayout(p).validated.exists() and current and p.name < current]
    for folder in doomed:
        shutil.rmtree(folder)
    return sorted(p.name for p in doomed)


def remove_all(root: Path) -> list[str]:
    """--overwrite on a versioned output: CURRENT and every version folder embedpipe made; nothing else."""
    doomed = [p.name for p in _version_folders(root)]
    remove_owned(root, (CURRENT, *(f"{VERSIONS}/{name}" for name in doomed)))
    return doomed


def _version_folders(root: Path) -> list[Path]:
    """The folders under versions/ that are embedpipe outputs, newest first (a folder someone else put there
    is never pruned or removed)."""
    folders = OutputLayout(root).versions
    if not folders.is_dir() or folders.is_symlink():
        return []
    return sorted((p for p in folders.iterdir() if p.is_dir() and not p.is_symlink() and is_output(p)), reverse=True)


def previous_parts(root: Path) -> tuple[str, ...]:
    """The current version's parts its manifest records intact (size checked), for an incremental run."""
    folder = current_path(root)
    if folder is None:
        return ()
    records = Manifest(folder).done().values()
    return tuple(sorted(str(folder / part["path"]) for record in records for part in record["parts"]))


def reencode_reason(root: Path, fingerprint: dict) -> str | None:
    """Why no row of the current version can be reused (the model's files or a vector setting changed), or None."""
    folder = current_path(root)
    job_file = OutputLayout(folder).job if folder is not None else None
    if job_file is None or not job_file.is_file():
        return None
    old = json.loads(job_file.read_text())
    if vector_salt(old) == vector_salt(fingerprint):
        return None
    if old.get("model") != fingerprint["model"]:
        return (f"the model's files changed since version {folder.name} (was {old.get('model_dir', '?')}, now "
                f"{fingerprint.get('model_dir', '?')})")
    return f"a model or vector setting changed since version {folder.name}"


def previous_vectors(root: Path, job: JobSpec) -> str | None:
    """The current version's vectors for an incremental run (None on the first run)."""
    folder = current_path(root)
    return str(OutputLayout(folder).vectors) if job.output.incremental and folder is not None else None


def previous_rows(root: Path) -> int:
    folder = current_path(root)
    report = OutputLayout(folder).report_json if folder is not None else None
    if report is None or not report.is_file():
        return 0
    return int(json.loads(report.read_text())["rows"])
