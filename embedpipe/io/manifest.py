"""The run manifest under ``<output.path>/_manifest/``: what job made this output, which units are done.

- ``job.json``: the job fingerprint — input files (size, modification time), the model
  (config and tokenizer files, weight file headers and sizes) and every setting that changes
  what is written. A rerun with the same fingerprint resumes; another fingerprint is refused.
- ``units/<unit id>.json``: one record per finished unit (its part files with sizes and
  sha256, rows, counters), written by the worker after the unit's files are renamed into
  place. A unit is done only when its record exists and its parts are intact.
- ``skipped/<unit id>.parquet``: the unit's rows that got no vector (id, reason).

Every file is written to a temporary name and renamed, so a crash leaves either the old
state or the new one, never half a record.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

MANIFEST = "_manifest"
# What embedpipe writes under output.path; --overwrite removes exactly these.
OWNED = (MANIFEST, "vectors", "index", "report.json", "report.md", "report.png", "skipped.parquet",
         "quantization.json")
# Left out of the job fingerprint: paths (the files' own fingerprints cover them) and the output settings
# that do not change a stored vector (how the FAISS index is built from the parts, how many versions stay):
# changing those reuses every finished unit, and a rerun builds the index anew from the same parts.
FINGERPRINT_SKIP = {"input": {"path"}, "model": {"path"},
                    "output": {"path", "format", "index", "index_memory_gb", "target_recall", "keep_versions"}}


class ManifestMismatch(RuntimeError):
    """The output path holds another job's output."""


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_fingerprint(model_dir: Path) -> str:
    """Hash of the model's configs, tokenizer and weight headers: cheap even for large weights."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(model_dir).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue
        digest.update(rel.encode())
        if path.suffix in (".json", ".txt", ".model"):
            digest.update(path.read_bytes())
        elif path.suffix == ".safetensors":
            with open(path, "rb") as f:  # 8-byte header length, then a JSON header of names, shapes, offsets
                n = int.from_bytes(f.read(8), "little")
                digest.update(f.read(min(n, 64 << 20)))
            digest.update(str(path.stat().st_size).encode())
        else:
            stat = path.stat()
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def job_fingerprint(job, *, files: list[str], model_dir: Path) -> dict[str, Any]:
    settings = {section: {k: v for k, v in values.items() if k not in FINGERPRINT_SKIP.get(section, set())}
                for section, values in job.to_dict().items() if section in ("input", "model", "output")}
    from embedpipe.io import fs

    inputs = [fs.stamp(file) for file in files]  # local files: path, size, mtime_ns; URLs: the store's stamp
    body = {"inputs": inputs, "model": model_fingerprint(model_dir), "settings": settings}
    body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
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
        self.root = self.output / MANIFEST

    # ------------------------------------------------------------------ driver side
    @classmethod
    def open(cls, output: str | Path, fingerprint: dict[str, Any], *, overwrite: bool = False) -> "Manifest":
        manifest = cls(output)
        if overwrite:
            manifest.clear()
        job_file = manifest.root / "job.json"
        if job_file.is_file():
            old = json.loads(job_file.read_text())
            if old.get("sha256") != fingerprint["sha256"]:
                changed = [k for k in ("inputs", "model", "settings") if old.get(k) != fingerprint[k]]
                raise ManifestMismatch(
                    f"{manifest.output} holds the output of another job (changed: {', '.join(changed)}): "
                    f"choose a new output.path, or pass --overwrite to replace it")
        else:
            leftovers = [p.name for p in manifest.output.iterdir()] if manifest.output.is_dir() else []
            if any(name in OWNED for name in leftovers):
                raise ManifestMismatch(
                    f"{manifest.output} holds embedpipe output without a manifest: choose a new output.path, "
                    f"or pass --overwrite to replace it")
            atomic_write(job_file, json.dumps(fingerprint, indent=2, default=str).encode())
        return manifest

    def clear(self) -> None:
        for name in OWNED:
            path = self.output / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def done(self) -> dict[str, dict[str, Any]]:
        """Records of units whose parts are all present with their recorded sizes."""
        records = {}
        for path in sorted((self.root / "units").glob("*.json")):
            record = json.loads(path.read_text())
            parts = [self.output / p["path"] for p in record["parts"]]
            if all(p.is_file() and p.stat().st_size == meta["bytes"] for p, meta in zip(parts, record["parts"])):
                records[record["unit_id"]] = record
        return records

    def clean_partials(self, done: set[str]) -> list[Path]:
        """Remove temporary files and the files of units without a record (a crashed run's leftovers)."""
        removed = []
        for folder in (self.output / "vectors", self.root / "units", self.root / "skipped"):
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if path.name.startswith(".") or path.stem.removeprefix("part-") not in done:
                    path.unlink()
                    removed.append(path)
        return removed

    def skipped_files(self) -> list[Path]:
        return sorted((self.root / "skipped").glob("*.parquet"))

    # ------------------------------------------------------------------ worker side
    def skipped_path(self, unit_id: str) -> Path:
        return self.root / "skipped" / f"{unit_id}.parquet"

    def record(self, unit_id: str, *, parts: list[Path], **fields: Any) -> dict[str, Any]:
        """Write the unit's record last: from now on the unit is done."""
        record = {
            "unit_id": unit_id,
            "parts": [{"path": str(Path(p).relative_to(self.output)), "bytes": Path(p).stat().st_size,
                       "sha256": file_sha256(p)} for p in parts],
            **fields,
        }
        atomic_write(self.root / "units" / f"{unit_id}.json", json.dumps(record, indent=1).encode())
        return record
