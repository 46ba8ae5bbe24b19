"""The run manifest under ``<output.path>/_manifest/``: what job made this output, which units are done.

- ``job.json``: the job fingerprint — input files (size, modification time), the model's content
  (the sha256 of every file a worker reads from the model folder: weights, configs, tokenizer) and
  every setting that changes what is written, plus the resolved model folder for the record. A
  rerun with the same fingerprint resumes; another fingerprint is refused.
- ``units/<unit id>.json``: one record per finished unit (its part files with sizes and
  sha256, rows, counters), written by the worker after the unit's files are renamed into
  place. A unit is done only when its record exists and its parts are intact: on resume the
  parts are checked against their recorded sha256, and a corrupt one is redone.
- ``skipped/<unit id>.parquet``: the unit's rows that got no vector (id, reason).

Every file is written to a temporary name and renamed, so a crash leaves either the old
state or the new one, never half a record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from embedpipe.io.cache import cache_dir
from embedpipe.io.layout import MANIFEST, OWNED, PART_NAME, RECORD_NAME, TEMP_NAME, OutputLayout, atomic_write_bytes
from embedpipe.io.store import Store, Written
from embedpipe.io.ownership import ManifestMismatch, claim_output, remove_owned
from embedpipe.units import Unit

atomic_write = atomic_write_bytes  # the layout's one atomic write, under its earlier name
__all__ = ["MANIFEST", "PART_NAME", "RECORD_NAME", "TEMP_NAME", "atomic_write"]

log = logging.getLogger(__name__)

# Left out of the job fingerprint: paths (the files' own fingerprints cover them) and the output settings
# that do not change a stored vector (how the FAISS index is built from the parts, how many versions stay):
# changing those reuses every finished unit, and a rerun builds the index anew from the same parts.
# storage_options say how to reach the store (endpoint, credentials), never what is in it, and are not written.
FINGERPRINT_SKIP = {"input": {"path", "storage_options"}, "model": {"path", "storage_options"},
                    "output": {"path", "storage_options", "format", "index", "index_memory_gb", "target_recall", "keep_versions"}}
# Files of a model folder that a worker reads (weights, configs, tokenizer, vocabularies); the rest (README,
# ONNX/OpenVINO exports, TF/Flax weights) cannot change a vector and is left out of the model's hash.
MODEL_SUFFIXES = (".json", ".txt", ".model", ".safetensors", ".bin")
MODEL_SKIP_DIRS = ("onnx", "openvino")

def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class HashCache:
    """sha256 of files, kept by (real path, size, mtime, inode) in a small JSON file, so a rerun does not
    hash gigabytes of weights again; any change to a file's size, time or inode hashes it anew.

    Lives in ``$EMBEDPIPE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/embedpipe`` or ``~/.cache/embedpipe``);
    where that cannot be written, files are hashed every time."""

    MAX_ENTRIES = 20_000

    def __init__(self, path: Path | None = None):
        self.path = Path(path or cache_dir() / "sha256.json").expanduser()
        self.hashed = 0  # files hashed by this object (not found in the cache)
        try:
            self.entries: dict[str, dict] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.dirty = False

    def sha256(self, path: Path) -> str:
        real = os.path.realpath(path)
        stat = os.stat(real)
        key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ino": stat.st_ino}
        entry = self.entries.get(real)
        if entry is not None and all(entry.get(k) == v for k, v in key.items()):
            return entry["sha256"]
        digest = file_sha256(real)
        self.hashed += 1
        self.entries[real] = {**key, "sha256": digest}
        self.dirty = True
        return digest

    def save(self) -> None:
        if not self.dirty:
            return
        entries = dict(list(self.entries.items())[-self.MAX_ENTRIES:])
        try:
            atomic_write(self.path, json.dumps(entries).encode())
        except OSError as exc:  # a read-only home: correct, only slower next time
            log.info("file hash cache %s not written: %s", self.path, exc)
        self.dirty = False


def model_files(model_dir: Path) -> list[Path]:
    """The files of a model folder that can change its vectors, in a stable order."""
    names = [p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file()]
    return [model_dir / name for name in select_model_files(names)]


def select_model_files(names: Iterable[str]) -> list[str]:
    """Of a model folder's files (``/``-separated names relative to the folder: a local folder's walk or an
    object store's listing), those a worker reads, sorted: the one rule of what belongs to a model."""
    names = sorted(set(names), key=lambda n: PurePosixPath(n).parts)  # a folder's walk order: the hash's order
    safetensors_dirs = {posixpath.dirname(n) for n in names if PurePosixPath(n).suffix == ".safetensors"}
    chosen = []
    for name in names:
        path = PurePosixPath(name)
        if any(part.startswith(".") for part in path.parts) or path.parts[0] in MODEL_SKIP_DIRS:
            continue
        if path.suffix not in MODEL_SUFFIXES:
            continue
        if path.suffix == ".bin" and posixpath.dirname(name) in safetensors_dirs:
            continue  # pickled weights beside safetensors are never read
        chosen.append(name)
    return chosen


def model_fingerprint(model_dir: Path, *, cache: HashCache | None = None) -> str:
    """sha256 over the names and contents of the model's files (each content hash cached by path, size and time)."""
    cache = cache or HashCache()
    digest = hashlib.sha256()
    for path in model_files(model_dir):
        digest.update(path.relative_to(model_dir).as_posix().encode())
        digest.update(cache.sha256(path).encode())
    cache.save()
    return digest.hexdigest()


def job_fingerprint(job, *, files: list[str], model_dir: Path, model_sha256: str | None = None) -> dict[str, Any]:
    """The job's identity in its manifest: its input stamps, its model's content hash and its settings.
    ``model_sha256``: that hash when the caller has it (the shipped model's, ``model_fingerprint`` of the same
    folder), so the manifest names the bytes the workers were sent; None: hashed here."""
    settings = {section: {k: v for k, v in values.items() if k not in FINGERPRINT_SKIP.get(section, set())}
                for section, values in job.to_dict().items() if section in ("input", "model", "output")}
    from embedpipe.io import fs

    inputs = [fs.stamp(file) for file in files]  # local files: path, size, mtime_ns; URLs: the store's stamp
    body = {"inputs": inputs, "model": model_sha256 or model_fingerprint(model_dir), "settings": settings}
    body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    # for the record and the messages, not the hash: the same model bytes in another folder are the same model
    body["model_dir"] = str(model_dir)
    return body


def vector_salt(fingerprint: dict[str, Any]) -> bytes:
    """What maps a text to its vector: the model and its settings (not the inputs, not where output goes).

    Incremental runs key reused vectors by a hash of this salt and the row's text.
    """
    settings = fingerprint["settings"]
    output = {k: v for k, v in settings.get("output", {}).items() if k in ("dim", "dtype")}
    salted = {"model": fingerprint["model"], "model_settings": settings.get("model", {}), "output": output}
    chunking = settings.get("input", {}).get("chunking") or {}
    if chunking.get("mode", "off") != "off":  # how documents are cut (absent when off: earlier salts stay)
        salted["chunking"] = chunking
    body = json.dumps(salted, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).digest()


class Manifest:
    """One per output path; the driver opens it, workers write unit records through it.

    The output may be a local folder or an object store (``OutputLayout(output).store``); the records are
    the same. On an object store a part's name is attempt-unique and its record, one PUT written last, is
    the commit point: a part that no record names is an orphan, never read, and deleted by
    ``clean_partials`` (on resume and at the end of every run)."""

    def __init__(self, output: str | Path):
        self.layout = OutputLayout(output)
        self.output = self.layout.root
        self.store = self.layout.store
        self.root = self.layout.manifest

    # ------------------------------------------------------------------ driver side
    @classmethod
    def open(cls, output: str | Path, fingerprint: dict[str, Any], *, overwrite: bool = False) -> "Manifest":
        """Claim the output folder (refusing one embedpipe did not create), then resume, refuse or start."""
        manifest = cls(output)
        claim_output(manifest.output, kind="run")
        if overwrite:
            manifest.clear()
        if not manifest.check_job(fingerprint):
            atomic_write(manifest.layout.job, json.dumps(fingerprint, indent=2, default=str).encode())
        return manifest

    def check_job(self, fingerprint: dict[str, Any]) -> bool:
        """Refuse (ManifestMismatch) an output holding another job's output; True when it holds this job's,
        False when it holds none yet. Reads only: ``open`` (run) and ``embedpipe validate`` both ask here."""
        job_file = self.layout.job
        if not self.store.exists(job_file):
            return False
        old = _read_json(self.store, job_file)
        if old is None:
            raise ManifestMismatch(f"{job_file} is unreadable (not the JSON embedpipe writes): pass --overwrite "
                                   f"to replace this output, or choose a new output.path")
        if old.get("sha256") != fingerprint["sha256"]:
            changed = [k for k in ("inputs", "model", "settings") if old.get(k) != fingerprint[k]]
            if "model" in changed:  # name both folders: the content differs even where the path does not
                changed[changed.index("model")] = (f"model (its files' contents: was {old.get('model_dir', '?')}, "
                                                   f"now {fingerprint.get('model_dir', '?')})")
            raise ManifestMismatch(
                f"{self.output} holds the output of another job (changed: {', '.join(changed)}): "
                f"choose a new output.path, or pass --overwrite to replace it")
        return True

    def clear(self) -> None:
        """--overwrite: remove what embedpipe writes here (links themselves, never their targets), nothing else."""
        remove_owned(self.output, OWNED)

    def records(self) -> list[dict[str, Any]]:
        """Every well-formed unit record, by unit id (one listing of units/, the records read together)."""
        names = sorted(n for n in self.store.list(self.layout.units) if n.endswith(".json"))
        paths = [self.layout.units / n for n in names]
        found = self.store.read_many(paths)
        records = []
        for path in paths:
            record = _parse_json(found.get(path))
            if not _well_formed(record):
                log.warning("%s is unreadable (cut short or edited): its unit is redone", path)
                continue
            records.append(record)
        return records

    def done(self, *, verify: bool = False) -> dict[str, dict[str, Any]]:
        """Records of units whose parts are all present with their recorded sizes: ONE listing per folder the
        records name (vectors/), never a look per part. With ``verify`` (on resume), local parts are also
        checked against their recorded sha256, hashed on a few threads; object-store parts are trusted by name
        and size (each was written by one PUT under a name no other attempt uses, and an object is never
        changed in place; its record keeps the sha256 for any reader that wants to check). An unreadable record
        or a corrupt part leaves its unit undone, with a warning: the unit is redone."""
        records = self.records()
        listings: dict[str, dict[str, int]] = {}
        for record in records:
            for part in _files(record):
                folder = posixpath.dirname(part["path"])
                if folder not in listings:
                    listings[folder] = self.store.list(self.layout.resolve(folder) if folder else self.output)
        intact = {}
        for record in records:
            if all(listings[posixpath.dirname(p["path"])].get(posixpath.basename(p["path"])) == p["bytes"]
                   for p in _files(record)):
                intact[record["unit_id"]] = record
        if verify and intact and self.store.local:
            checks = [(unit, self.layout.resolve(p["path"]), p["sha256"]) for unit, r in intact.items()
                      for p in _files(r)]
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
                hashes = list(pool.map(lambda check: self.store.sha256(check[1]), checks))
            for (unit, path, want), got in zip(checks, hashes):
                if got != want and intact.pop(unit, None) is not None:
                    log.warning("%s does not match the sha256 its unit recorded (corrupt): unit %s is redone",
                                path, unit)
        return intact

    def part_paths(self, record: dict[str, Any]) -> list:
        """The paths of the parts a unit record names."""
        return [self.layout.resolve(p["path"]) for p in record["parts"]]

    def clean_partials(self, done: set[str] | dict[str, dict[str, Any]]) -> list:
        """Remove temporary files and the files of units without a record (a crashed run's leftovers); given the
        done units' records, also every part that no record names (an orphan: another attempt of a unit, cut
        off by a killed worker or driver). One listing per folder; on object stores, one batched delete.

        Only files with the names embedpipe gives them: anything else in these folders is left alone."""
        kept = {p["path"] for r in done.values() for p in _files(r)} if isinstance(done, dict) else None
        doomed = []
        for folder, pattern in ((self.layout.vectors, PART_NAME), (self.layout.document_vectors, PART_NAME),
                                (self.layout.units, RECORD_NAME), (self.layout.skipped_dir, RECORD_NAME)):
            if self.store.local and Path(folder).is_symlink():
                continue
            for name in self.store.list(folder):
                match = pattern.match(name)
                orphan = (kept is not None and pattern is PART_NAME and match
                          and f"{self.layout.relative(folder)}/{name}" not in kept)
                if TEMP_NAME.match(name) or (match and match["unit"] not in done) or orphan:
                    doomed.append(folder / name)
        self.store.remove_many(doomed)
        return doomed

    def skipped_files(self) -> list:
        return [self.layout.skipped_dir / n for n in sorted(self.store.list(self.layout.skipped_dir))
                if n.endswith(".parquet")]

    # ------------------------------------------------------------------ worker side
    def skipped_path(self, unit_id: str):
        return self.layout.skipped_part(unit_id)

    def record(self, unit_id: str, *, parts: list[Written | Path], document_parts: list[Written] = (),
               **fields: Any) -> dict[str, Any]:
        """Write the unit's record last: from now on the unit is done. ``parts``: what the writer wrote (size
        and sha256 of the bytes written), or local paths (hashed here); ``document_parts``: its document
        vectors (output.document_vectors), checked and cleaned like the parts but never read as vectors."""
        written = [p if isinstance(p, Written) else Written(Path(p), os.path.getsize(p), file_sha256(p))
                   for p in parts]
        entry = lambda w: {"path": self.layout.relative(w.path), "bytes": w.bytes, "sha256": w.sha256}  # noqa: E731
        record = {
            "unit_id": unit_id,
            "parts": [entry(w) for w in written],
            **({"document_parts": [entry(w) for w in document_parts]} if document_parts else {}),
            **fields,
        }
        atomic_write(self.layout.unit_record(unit_id), json.dumps(record, indent=1).encode())
        return record


def covers(record: dict[str, Any], unit: Unit) -> bool:
    """The record was written for exactly this unit's rows: the same file range and row count (a unit id
    alone is not enough once units are cut to the workers: ``00000-0000000000`` holds 375 rows for two
    workers and 10,000 for one). Records from before the rows were recorded: the same row groups and as
    many rows embedded or skipped as the unit holds."""
    if "num_rows" in record:
        return (record.get("row_start") == unit.row_start and record["num_rows"] == unit.num_rows
                and list(record.get("row_groups", [])) == list(unit.row_groups))
    counters = record.get("counters") or {}
    rows = counters.get("rows", 0) + counters.get("skipped_rows", 0)
    return list(record.get("row_groups", [])) == list(unit.row_groups) and rows == unit.num_rows


def done_units(records: dict[str, dict[str, Any]], units: Iterable[Unit]) -> dict[str, dict[str, Any]]:
    """Of the manifest's done records, those of the plan's units that cover exactly the unit's rows; a record
    of another cut (another worker count, an earlier embedpipe) is left out, so clean_partials removes it and
    its part and the unit is encoded again: every row is written once."""
    by_id = {u.id: u for u in units}
    return {k: v for k, v in records.items() if k in by_id and covers(v, by_id[k])}


def _files(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every file a unit record names: its parts and its document vectors."""
    return record["parts"] + record.get("document_parts", [])


def _read_json(store: Store, path) -> Any:
    try:
        return json.loads(store.read_bytes(path))
    except (OSError, ValueError):
        return None


def _parse_json(data: bytes | None) -> Any:
    try:
        return json.loads(data) if data is not None else None
    except ValueError:
        return None


def _well_formed(record: Any) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("unit_id"), str)
            and isinstance(record.get("parts"), list)
            and all(isinstance(p, dict) and {"path", "bytes", "sha256"} <= set(p) for p in record["parts"]))
