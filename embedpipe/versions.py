"""Versioned outputs for nightly reindexing: one folder per run, an atomic ``CURRENT`` pointer.

    <output.path>/
      CURRENT                       the run id of the version readers should use (one line)
      versions/<run id>/            vectors/, index/, report.json, _manifest/ of one run
      versions/<run id>/VALIDATED   written once the run finished and passed validation

A run writes its own version folder; only after it finished and validated (every unit done,
row counts add up, index recall reached when there is an index) is ``CURRENT`` replaced by an
atomic rename (on an object store, ``s3://``: one PUT of the small ``CURRENT`` object, which readers
see whole, old or new, never half; ``VALIDATED`` likewise, written before it). A killed or failed run leaves ``CURRENT`` where it was; rerunning the same job
resumes the unfinished version. ``output.keep_versions`` prunes older validated versions and
abandoned unfinished ones, never the current one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq

from embedpipe.config import JobSpec
from embedpipe.errors import RunError
from embedpipe.io.layout import (CURRENT, DESCRIPTION, VALIDATED, VERSIONS, OutputLayout, atomic_write_bytes,
                                 stamp_name)
from embedpipe.io.describe import OutputDescription, changes, read_description
from embedpipe.io.manifest import Manifest, vector_salt
from embedpipe.io.ownership import is_output, remove_owned
from embedpipe.io.store import TreePath, store_for, tree_path

__all__ = ["CURRENT", "VALIDATED", "VERSIONS"]  # the layout's names, imported from here by earlier callers


class RunFailed(RunError, RuntimeError):
    """The run finished but did not validate: CURRENT was left where it was."""


def current_version(root: str | Path) -> str | None:
    layout = OutputLayout(root)
    if not layout.store.exists(layout.current):
        return None
    return layout.store.read_bytes(layout.current).decode().strip() or None


def current_path(root: str | Path) -> TreePath | None:
    """The folder readers should use: the current version, or ``root`` itself when unversioned."""
    version = current_version(root)
    return OutputLayout(root).version(version).root if version else None


def version_names(root: str | Path) -> list[str]:
    """The names under versions/, newest first (one listing; object stores list prefixes)."""
    layout = OutputLayout(root)
    if layout.store.local:
        folder = Path(layout.versions)
        return sorted((p.name for p in folder.iterdir() if p.is_dir()), reverse=True) if folder.is_dir() else []
    return sorted(layout.store.names(layout.versions), reverse=True)


def is_validated(root: str | Path, version: str) -> bool:
    layout = OutputLayout(root).version(version)
    return layout.store.exists(layout.validated)


def choose_version(root: str | Path, fingerprint: dict, *, started_at: float | None = None) -> str:
    """Resume the newest unfinished version of this same job, else a new version named by the second its run
    started (``started_at``, time.time(); None: now), so that its first run has the same name."""
    current = current_version(root)
    names = version_names(root)
    unfinished = [name for name in names if name != current and not is_validated(root, name)]
    for name in unfinished[:1]:
        job = _read_json(OutputLayout(root).version(name).job)
        if job is not None and job.get("sha256") == fingerprint["sha256"]:
            return name
    return stamp_name(time.time() if started_at is None else started_at, taken=set(names))


def validate(version_dir: str | Path, report: dict, *, expected_rows: int) -> None:
    """Every unit done, every input row accounted for and present, index recall reached."""
    problems = []
    if report["units"]["failed"]:
        problems.append(f"{report['units']['failed']} units failed")
    embedded = report.get("chunking", {}).get("documents", report["rows"])  # input.chunking: rows are chunks
    if embedded + report["skipped_rows"] != expected_rows:
        what = "documents chunked" if "chunking" in report else "rows written"
        problems.append(f"{embedded} {what} + {report['skipped_rows']} skipped != {expected_rows} input rows")
    manifest = Manifest(version_dir)  # the recorded parts, never a listing of vectors/ (orphans are not rows)
    written = sum(pq.ParquetFile(manifest.store.arrow_source(p)).metadata.num_rows
                  for record in manifest.done().values() for p in manifest.part_paths(record))
    if written != report["rows"]:
        problems.append(f"the vector parts hold {written} rows, the report says {report['rows']}")
    index = report.get("index") or {}
    if index.get("target_reached") is False:
        problems.append(f"the index reached recall@10 {index.get('recall_at_10')} below output.target_recall")
    if problems:
        raise RunFailed(f"{tree_path(version_dir).name} did not validate ({'; '.join(problems)}): CURRENT still "
                        f"points at the previous version; fix the cause and rerun the same command to resume")


def promote(root: str | Path, version: str) -> None:
    """Mark the version validated, then point CURRENT at it: each one atomic write (a rename locally; on an
    object store one PUT of a small object, which readers see whole or not at all)."""
    layout = OutputLayout(root)
    atomic_write_bytes(layout.version(version).validated, b"")
    atomic_write_bytes(layout.current, f"{version}\n".encode())


def prune(root: str | Path, *, keep: int | None) -> list[str]:
    """Remove validated versions beyond the newest ``keep`` and unfinished ones older than CURRENT."""
    if keep is None:
        return []
    current = current_version(root)
    folders = _version_folders(root)
    validated = [p for p in folders if OutputLayout(p).store.exists(OutputLayout(p).validated)]
    doomed = [p for p in validated[keep:] if p.name != current]
    doomed += [p for p in folders if p not in validated and current and p.name < current]
    for folder in doomed:
        OutputLayout(folder).store.remove_tree(folder)
    return sorted(p.name for p in doomed)


def remove_all(root: str | Path) -> list[str]:
    """--overwrite on a versioned output: CURRENT and every version folder embedpipe made; nothing else."""
    doomed = [p.name for p in _version_folders(root)]
    remove_owned(tree_path(root), (CURRENT, DESCRIPTION, *(f"{VERSIONS}/{name}" for name in doomed)))
    return doomed


def _version_folders(root: str | Path) -> list[TreePath]:
    """The folders under versions/ that are embedpipe outputs, newest first (a folder someone else put there
    is never pruned or removed)."""
    layout = OutputLayout(root)
    if layout.store.local and Path(layout.versions).is_symlink():
        return []
    folders = [layout.version(name).root for name in version_names(root)]
    if layout.store.local:
        folders = [p for p in folders if not Path(p).is_symlink()]
    return [p for p in folders if is_output(p)]


def previous_parts(root: str | Path) -> tuple[str, ...]:
    """The current version's parts its manifest records intact (size checked), for an incremental run."""
    return previous_units(root)[0]


def previous_units(root: str | Path) -> tuple[tuple[str, ...], dict[tuple[str, str], int]]:
    """The current version's intact parts (sorted) and, for the night's diff, each one-part unit's key
    (``embedpipe.io.diff.unit_key``: its input file and first row group or row) -> its part's index.
    One listing of the manifest's records and one of vectors/."""
    from embedpipe.io.diff import unit_key

    folder = current_path(root)
    if folder is None:
        return (), {}
    manifest = Manifest(folder)
    records = manifest.done()
    parts = tuple(sorted(str(p) for record in records.values() for p in manifest.part_paths(record)))
    index = {p: i for i, p in enumerate(parts)}
    units = {unit_key(record.get("file", ""), unit_id): index[str(paths[0])] for unit_id, record in records.items()
             if len(paths := manifest.part_paths(record)) == 1}
    return parts, units


def reencode_reason(root: str | Path, fingerprint: dict, *,
                    description: OutputDescription | None = None) -> str | None:
    """Why no row of the current version can be reused (the model's files or a vector setting changed), or None;
    ``description``: this run's output record, compared with the current version's embedpipe.json to name the
    facts that changed."""
    folder = current_path(root)
    old = _read_json(OutputLayout(folder).job) if folder is not None else None
    if old is None:
        return None
    if vector_salt(old) == vector_salt(fingerprint):
        return None
    if old.get("model") != fingerprint["model"]:
        return (f"the model's files changed since version {folder.name} (was {old.get('model_dir', '?')}, now "
                f"{fingerprint.get('model_dir', '?')})")
    before = read_description(folder) if description is not None else None
    changed = changes(before, description) if before is not None else []
    if changed:  # the current version's embedpipe.json against this run's: name what changed
        return f"the vectors' settings changed since version {folder.name}: {'; '.join(changed)}"
    return f"a model or vector setting changed since version {folder.name}"


def previous_vectors(root: str | Path, job: JobSpec) -> str | None:
    """The current version's vectors for an incremental run (None on the first run)."""
    folder = current_path(root)
    return str(OutputLayout(folder).vectors) if job.output.incremental and folder is not None else None


def previous_rows(root: str | Path) -> int:
    folder = current_path(root)
    report = _read_json(OutputLayout(folder).report_json) if folder is not None else None
    return int(report["rows"]) if report is not None else 0


def _read_json(path: TreePath) -> dict | None:
    """A small JSON file of the tree (local or an object), or None when there is none."""
    store = store_for(path)
    if not store.exists(path):
        return None
    return json.loads(store.read_bytes(path))
