"""The one owner of every path in an output tree, and of the one atomic write.

    <output.path>/
      .embedpipe-output  .embedpipe.lock           marker (what made it), the run lock
      _manifest/job.json                           the job fingerprint
      _manifest/units/<unit>.json                  one record per finished unit
      _manifest/skipped/<unit>.parquet             a unit's rows that got no vector
      vectors/part-<unit>.parquet                  one part per unit (object stores: part-<unit>.<attempt>.parquet)
      document_vectors/part-<unit>.parquet         output.document_vectors: one vector per chunked document
      index/index.faiss ids.parquet holdout.parquet index.ivfdata index.json   (_build/ while building)
      report.json report.md report.png runs/<run id>/report.json
      skipped.parquet quantization.json
      embedpipe.json                               what the output is (embedpipe/io/describe.py)
      CURRENT versions/<run id>/ (each an output tree) versions/<run id>/VALIDATED   (versioned roots)

Callers ask an ``OutputLayout(root)`` for a path and never spell one; writes go through
``atomic_path`` (a temporary name in the same folder, ``.<name>.<pid>.tmp``, then ``os.replace``).

``root`` may be an fsspec URL (``s3://bucket/out``): its paths are then ``Url``s and ``layout.store``
(embedpipe/io/store.py) an ``ObjectStore``, where each write is one PUT (atomic) and, there being no
rename, a part is written under an attempt-unique name (``part-<unit>.<attempt>.parquet``); the unit's
manifest record, written last, names it and is the commit point. Local roots keep ``Path``s and the names
above exactly.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa

from embedpipe.io.store import ATTEMPT_HEX, Store, TreePath, Url, Written, store_for, tree_path

MARKER = ".embedpipe-output"
LOCK = ".embedpipe.lock"
MANIFEST = "_manifest"
UNITS = "units"
SKIPPED_DIR = "skipped"
JOB = "job.json"
VECTORS = "vectors"
DOCUMENT_VECTORS = "document_vectors"
INDEX = "index"
INDEX_WORK = "_build"
RUNS = "runs"
REPORT_JSON, REPORT_MD, REPORT_PNG = "report.json", "report.md", "report.png"
SKIPPED = "skipped.parquet"
QUANTIZATION = "quantization.json"
DESCRIPTION = "embedpipe.json"
CURRENT, VERSIONS, VALIDATED = "CURRENT", "versions", "VALIDATED"
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"  # a version's and a run's name: the UTC second its run started

# What embedpipe writes at the top of an output (versioned roots add CURRENT and versions/); --overwrite
# removes exactly these, and nothing else in the folder.
OWNED = (MANIFEST, VECTORS, DOCUMENT_VECTORS, INDEX, REPORT_JSON, REPORT_MD, REPORT_PNG, SKIPPED, QUANTIZATION, RUNS,
         DESCRIPTION)
VERSIONED_OWNED = (CURRENT, VERSIONS, DESCRIPTION)
# Folders whose contents embedpipe lists and cleans: each must be a real folder inside the output.
CLEANED_DIRS = (VECTORS, DOCUMENT_VECTORS, MANIFEST, f"{MANIFEST}/{UNITS}", f"{MANIFEST}/{SKIPPED_DIR}", INDEX,
                VERSIONS, RUNS)
# The names of what the manifest records: parts, unit records, skipped rows (anything else is not cleaned).
# A part: part-<unit>.parquet (local), part-<unit>.<attempt>.parquet (object stores: attempt-unique).
PART_NAME = re.compile(rf"^part-(?P<unit>[\w.-]+?)(\.(?P<attempt>[0-9a-f]{{{ATTEMPT_HEX}}}))?\.parquet$")
PART_GLOB = "part-*.parquet"
RECORD_NAME = re.compile(r"^(?P<unit>[\w.-]+)\.(json|parquet)$")
# The temporary names of atomic_path (`.<name>.<pid>.tmp`), and `<name>.tmp` of earlier embedpipe versions.
TEMP_NAME = re.compile(r"^\..+\.\d+\.tmp$")
TEMPORARY = re.compile(r"^(\..+\.\d+|.+)\.tmp$")


def part_name(unit_id: str, attempt: str | None = None) -> str:
    return f"part-{unit_id}.{attempt}.parquet" if attempt else f"part-{unit_id}.parquet"


@dataclass(frozen=True)
class IndexLayout:
    """The files of one FAISS index folder (``<output>/index``, or a folder given to ``search``)."""

    dir: TreePath

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", tree_path(self.dir))

    @property
    def store(self) -> Store:
        return store_for(self.dir)

    @property
    def faiss(self) -> Path:
        return self.dir / "index.faiss"

    @property
    def ivfdata(self) -> Path:  # on-disk inverted lists, next to index.faiss (faiss opens it from there)
        return self.dir / "index.ivfdata"

    @property
    def ids(self) -> Path:
        return self.dir / "ids.parquet"

    @property
    def holdout(self) -> Path:
        return self.dir / "holdout.parquet"

    @property
    def meta(self) -> Path:  # written last: the index is finished once it exists
        return self.dir / "index.json"

    @property
    def work(self) -> Path:  # the build's scratch folder, removed and made anew by each build
        return self.dir / INDEX_WORK

    @property
    def work_ids(self) -> Path:  # ids.parquet as the scan writes it, moved into place with the index
        return self.work / self.ids.name

    @property
    def shards(self) -> Path:
        return self.work / "shards"

    def shard(self, unit_id: str) -> Path:
        return shard_path(self.shards, unit_id)


def shard_path(shard_dir: str | Path, unit_id: str) -> Path:
    """One unit's IVF shard in the build's shard folder (a worker knows only that folder)."""
    return Path(shard_dir) / f"shard-{unit_id}.ivfl"


@dataclass(frozen=True)
class OutputLayout:
    """Every path of the output tree at ``root`` (a run's output, or a versioned root's)."""

    root: TreePath  # a Path, or a Url for an object store (never Path("s3://..."): it collapses "//")

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", tree_path(self.root))

    @property
    def store(self) -> Store:
        """The one door to the tree's files: a local folder, or an object store for URL roots."""
        return store_for(self.root)

    def entry(self, name: str) -> Path:
        """A top-level entry by its name (one of OWNED, VERSIONED_OWNED, CLEANED_DIRS)."""
        return self.root / name

    # ---------------------------------------------------------------- ownership
    @property
    def marker(self) -> Path:
        return self.root / MARKER

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    # ---------------------------------------------------------------- manifest
    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    @property
    def job(self) -> Path:
        return self.manifest / JOB

    @property
    def units(self) -> Path:
        return self.manifest / UNITS

    def unit_record(self, unit_id: str) -> Path:
        return self.units / f"{unit_id}.json"

    @property
    def skipped_dir(self) -> Path:
        return self.manifest / SKIPPED_DIR

    def skipped_part(self, unit_id: str) -> Path:
        return self.skipped_dir / f"{unit_id}.parquet"

    # ---------------------------------------------------------------- vectors, index
    @property
    def vectors(self) -> Path:
        return self.root / VECTORS

    def part(self, unit_id: str, attempt: str | None = None) -> TreePath:
        """A unit's part; ``attempt`` (object stores, ``store.unique_parts``) makes the name attempt-unique."""
        return self.vectors / part_name(unit_id, attempt)

    @property
    def document_vectors(self) -> Path:
        return self.root / DOCUMENT_VECTORS

    def document_part(self, unit_id: str, attempt: str | None = None) -> TreePath:
        """A unit's document vectors (output.document_vectors), named as its part is."""
        return self.document_vectors / part_name(unit_id, attempt)

    def relative(self, path: TreePath) -> str:
        """``path`` relative to the root, with ``/`` (as a manifest record names its parts)."""
        if isinstance(self.root, Url):
            return str(path)[len(self.root.rstrip("/")) + 1:]
        return Path(path).relative_to(self.root).as_posix()

    def resolve(self, relative: str) -> TreePath:
        """The path a manifest record's relative path names."""
        return self.root / relative

    def parts(self) -> list[TreePath]:
        """The part files now in vectors/, by name: a folder listing, which holds orphans while a run is live or
        after a killed one. Readers of a run's vectors take its parts from the manifest instead
        (``Manifest.done``), and the driver deletes orphans on resume and at the end of every run."""
        return [self.vectors / name for name in sorted(self.store.list(self.vectors)) if PART_NAME.match(name)]

    @property
    def index_dir(self) -> Path:
        return self.root / INDEX

    @property
    def index(self) -> IndexLayout:
        return IndexLayout(self.index_dir)

    # ---------------------------------------------------------------- report, run history
    @property
    def report_json(self) -> Path:
        return self.root / REPORT_JSON

    @property
    def report_md(self) -> Path:
        return self.root / REPORT_MD

    @property
    def report_png(self) -> Path:
        return self.root / REPORT_PNG

    @property
    def runs(self) -> Path:
        return self.root / RUNS

    def run(self, run_id: str) -> "OutputLayout":
        """One run's folder under runs/: its own report.json, report.md, report.png."""
        return OutputLayout(self.runs / run_id)

    @property
    def skipped(self) -> Path:
        return self.root / SKIPPED

    @property
    def quantization(self) -> Path:
        return self.root / QUANTIZATION

    @property
    def description(self) -> Path:  # embedpipe.json: model, dim, dtype, metric, ... (embedpipe/io/describe.py)
        return self.root / DESCRIPTION

    # ---------------------------------------------------------------- versioned roots
    @property
    def current(self) -> Path:
        return self.root / CURRENT

    @property
    def versions(self) -> Path:
        return self.root / VERSIONS

    def version(self, run_id: str) -> "OutputLayout":
        return OutputLayout(self.versions / run_id)

    @property
    def validated(self) -> Path:  # in a version folder: written once the run finished and validated
        return self.root / VALIDATED


# -------------------------------------------------------------------- the one atomic write

def temp_path(path: Path) -> Path:
    """The temporary name of a local ``path`` while it is written: same folder, so the rename is atomic."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_path(path: str | TreePath):
    """A context yielding a local temporary path to write ``path``'s content to: renamed onto ``path`` on
    success, removed on failure (readers see the old file or the new one, never half a file); for a URL,
    uploaded by one PUT on success."""
    path = tree_path(path)
    return store_for(path).atomic_path(path)


def atomic_move(src: str | Path, path: str | Path) -> Path:
    """Put a finished local file (written whole elsewhere in the same tree) in place by one rename."""
    os.replace(src, path)
    return Path(path)


def atomic_write_bytes(path: str | TreePath, data: bytes) -> TreePath:
    path = tree_path(path)
    return store_for(path).write_bytes(path, data).path


def atomic_write_text(path: str | TreePath, text: str) -> TreePath:
    return atomic_write_bytes(path, text.encode())


def atomic_write_table(table: pa.Table, path: str | TreePath) -> TreePath:
    path = tree_path(path)
    return store_for(path).write_table(table, path).path


def write_table(table: pa.Table, path: str | TreePath) -> Written:
    """``atomic_write_table`` that also says what was written: size and sha256 (of the bytes uploaded)."""
    path = tree_path(path)
    return store_for(path).write_table(table, path)


def stamp_name(started_at: float, *, taken: set[str]) -> str:
    """A version's or a run's name: the UTC second ``started_at`` (STAMP_FORMAT), with ``-1``, ``-2``... when a
    name of that second is ``taken``."""
    base = datetime.fromtimestamp(started_at, timezone.utc).strftime(STAMP_FORMAT)
    suffix, candidate = 0, base
    while candidate in taken:
        suffix += 1
        candidate = f"{base}-{suffix}"
    return candidate
