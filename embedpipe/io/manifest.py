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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from embedpipe.io.layout import MANIFEST, OWNED, PART_NAME, RECORD_NAME, TEMP_NAME, OutputLayout, atomic_write_bytes
from embedpipe.io.ownership import ManifestMismatch, claim_output, remove_owned

atomic_write = atomic_write_bytes  # the layout's one atomic write, under its earlier name
__all__ = ["MANIFEST", "PART_NAME", "RECORD_NAME", "TEMP_NAME", "atomic_write"]

log = logging.getLogger(__name__)

# Left out of the job fingerprint: paths (the files' own fingerprints cover them) and the output settings
# that do not change a stored vector (how the FAISS index is built from the parts, how many versions stay):
# changing those reuses every finished unit, and a rerun builds the index anew from the same parts.
# storage_options say how to reach the store (endpoint, credentials), never what is in it, and are not written.
FINGERPRINT_SKIP = {"input": {"path", "storage_options"}, "model": {"path"},
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
        base = os.environ.get("EMBEDPIPE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "embedpipe"
        self.path = Path(path or Path(base) / "sha256.json").expanduser()
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
    files = []
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        parts = path.relative_to(model_dir).parts
        if any(part.startswith(".") for part in parts) or parts[0] in MODEL_SKIP_DIRS:
            continue
        if path.suffix not in MODEL_SUFFIXES:
            continue
        if path.suffix == ".bin" and any(path.parent.glob("*.safetensors")):
            continue  # pickled weights beside safetensors are never read
        files.append(path)
    return files


def model_fingerprint(model_dir: Path, *, cache: HashCache | None = None) -> str:
    """sha256 over the names and contents of the model's files (each content hash cached by path, size and time)."""
    cache = cache or HashCache()
    digest = hashlib.sha256()
    for path in model_files(model_dir):
        digest.update(path.relative_to(model_dir).as_posix().encode())
        digest.update(cache.sha256(path).encode())
    cache.save()
    return digest.hexdigest()


def job_fingerprint(job, *, files: list[str], model_dir: Path) -> dict[str, Any]:
    settings = {section: {k: v for k, v in values.items() if k not in FINGERPRINT_SKIP.get(section, set())}
                for section, values in job.to_dict().items() if section in ("input", "model", "output")}
    from embedpipe.io import fs

    inputs = [fs.stamp(file) for file in files]  # local files: path, size, mtime_ns; URLs: the store's stamp
    body = {"inputs": inputs, "model": model_fingerprint(model_dir), "settings": settings}
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
    body = json.dumps({"model": fingerprint["model"], "model_settings": settings.get("model", {}), "output": output},
                      sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).digest()


class Manifest:
    """One per output path; the driver opens it, workers write unit records through it."""

    def __init__(self, output: str | Path):
        self.output = Path(output)
        self.layout = OutputLayout(self.output)
        self.root = self.layout.manifest

    # ------------------------------------------------------------------ driver side
    @classmethod
    def open(cls, output: str | Path, fingerprint: dict[str, Any], *, overwrite: bool = False) -> "Manifest":
        """Claim the output folder (refusing one embedpipe did not create), then resume, refuse or start."""
        manifest = cls(output)
        claim_output(manifest.output, kind="run")
        if overwrite:
            manifest.clear()
        job_file = manifest.layout.job
        if job_file.is_file():
            old = _read_json(job_file)
            if old is None:
                raise ManifestMismatch(f"{job_file} is unreadable (not the JSON embedpipe writes): pass --overwrite "
                                       f"to replace this output, or choose a new output.path")
            if old.get("sha256") != fingerprint["sha256"]:
                changed = [k for k in ("inputs", "model", "settings") if old.get(k) != fingerprint[k]]
                if "model" in changed:  # name both folders: the content differs even where the path does not
                    changed[changed.index("model")] = (f"model (its files' contents: was {old.get('model_dir', '?')}, "
                                                       f"now {fingerprint.get('model_dir', '?')})")
                raise ManifestMismatch(
                    f"{manifest.output} holds the output of another job (changed: {', '.join(changed)}): "
                    f"choose a new output.path, or pass --overwrite to replace it")
        else:
            atomic_write(job_file, json.dumps(fingerprint, indent=2, default=str).encode())
        return manifest

    def clear(self) -> None:
        """--overwrite: remove what embedpipe writes here (links themselves, never their targets), nothing else."""
        remove_owned(self.output, OWNED)

    def done(self, *, verify: bool = False) -> dict[str, dict[str, Any]]:
        """Records of units whose parts are all present with their recorded sizes; with ``verify`` (on
        resume) also with their recorded sha256, hashed on a few threads. An unreadable record or a
        corrupt part leaves its unit undone, with a warning: the unit is redone."""
        records = {}
        for path in sorted(self.layout.units.glob("*.json")):
            record = _read_json(path)
            if not _well_formed(record):
                log.warning("%s is unreadable (cut short or edited): its unit is redone", path)
                continue
            parts = [self.output / p["path"] for p in record["parts"]]
            if all(p.is_file() and not p.is_symlink() and p.stat().st_size == meta["bytes"]
                   for p, meta in zip(parts, record["parts"])):
                records[record["unit_id"]] = record
        if verify and records:
            checks = [(unit, self.output / p["path"], p["sha256"]) for unit, r in records.items() for p in r["parts"]]
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
                hashes = list(pool.map(lambda check: file_sha256(check[1]), checks))
            for (unit, path, want), got in zip(checks, hashes):
                if got != want and records.pop(unit, None) is not None:
                    log.warning("%s does not match the sha256 its unit recorded (corrupt): unit %s is redone",
                                path, unit)
        return records

    def clean_partials(self, done: set[str]) -> list[Path]:
        """Remove temporary files and the files of units without a record (a crashed run's leftovers).

        Only files with the names embedpipe gives them: anything else in these folders is left alone."""
        removed = []
        for folder, pattern in ((self.layout.vectors, PART_NAME), (self.layout.units, RECORD_NAME),
                                (self.layout.skipped_dir, RECORD_NAME)):
            if not folder.is_dir() or folder.is_symlink():
                continue
            for path in folder.iterdir():
                if path.is_symlink() or not path.is_file():
                    continue
                match = pattern.match(path.name)
                if TEMP_NAME.match(path.name) or (match and match["unit"] not in done):
                    path.unlink()
                    removed.append(path)
        return removed

    def skipped_files(self) -> list[Path]:
        return sorted(self.layout.skipped_dir.glob("*.parquet"))

    # ------------------------------------------------------------------ worker side
    def skipped_path(self, unit_id: str) -> Path:
        return self.layout.skipped_part(unit_id)

    def record(self, unit_id: str, *, parts: list[Path], **fields: Any) -> dict[str, Any]:
        """Write the unit's record last: from now on the unit is done."""
        record = {
            "unit_id": unit_id,
            "parts": [{"path": str(Path(p).relative_to(self.output)), "bytes": Path(p).stat().st_size,
                       "sha256": file_sha256(p)} for p in parts],
            **fields,
        }
        atomic_write(self.layout.unit_record(unit_id), json.dumps(record, indent=1).encode())
        return record


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _well_formed(record: Any) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("unit_id"), str)
            and isinstance(record.get("parts"), list)
            and all(isinstance(p, dict) and {"path", "bytes", "sha256"} <= set(p) for p in record["parts"]))
