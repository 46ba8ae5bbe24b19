"""A model folder at a URL (``s3://bucket/models/all-MiniLM-L6-v2/``, any fsspec store), copied to the local
cache once: ``<cache>/downloads/<key>/`` (`embedpipe.io.cache.cache_dir`).

Only the files a worker reads are fetched (`embedpipe.io.manifest.select_model_files`, the rule the model's
fingerprint hashes by). The key is the sha256 of the URL and the listing of those files (name, size, the
store's version stamps: ETag, modification time), so a second resolve of unchanged objects is one LIST and
downloads nothing, and a changed object gets a new copy. A copy is downloaded into a temp folder beside its
final name and renamed into place whole; the listing is read again after the download, and a model changed
meanwhile is refused rather than mixed. A copy whose files were cut or removed by hand is downloaded again.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from embedpipe.errors import BadJob
from embedpipe.io import fs
from embedpipe.io.cache import cache_dir
from embedpipe.io.manifest import MODEL_SUFFIXES, select_model_files

DOWNLOADS = "downloads"  # under the cache folder


class ModelFolderError(BadJob, FileNotFoundError):
    """A model URL with no model files under it, or whose objects changed while they were downloaded."""


@dataclass(frozen=True)
class ModelCopy:
    dir: Path  # the local copy's folder
    downloaded: tuple[str, ...]  # the file names this call fetched (empty: the copy was there)


def download_model(url: str) -> ModelCopy:
    """The local copy of the model folder at ``url`` (its store's options as `fs.use_storage_options` set them)."""
    fsys, root, listing = _listing(url)
    key = _key(url, listing)
    final = cache_dir() / DOWNLOADS / key
    if final.is_dir():
        if _complete(final, listing):
            return ModelCopy(final, ())
        shutil.rmtree(final, ignore_errors=True)  # cut or removed by hand: fetched again
    final.parent.mkdir(parents=True, exist_ok=True)
    work = final.with_name(f".{key}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        for name in listing:
            target = work.joinpath(*name.split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            with fs.remote_errors(fs.join(url, name), action="read", section="model"):
                fsys.get_file(posixpath.join(root, name), str(target))
        if _key(url, _listing(url)[2]) != key:
            raise ModelFolderError(f"model.path: {url}: its objects changed while they were downloaded: "
                                   f"run again once the model's upload is finished")
        try:
            os.rename(work, final)
        except OSError:  # another process put the same copy in place first: theirs is as good
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ModelCopy(final, tuple(listing))


def _listing(url: str) -> tuple[object, str, dict[str, dict]]:
    """(filesystem, folder within it, {name: version} of the model files under ``url``), sorted by name."""
    fsys, inner = fs.filesystem(url)
    root = inner.rstrip("/")
    with fs.remote_errors(url, action="list", section="model"):
        fsys.invalidate_cache(root)  # a listing cached by this process may predate a re-upload
        found = fsys.find(root, detail=True)
    infos = {posixpath.relpath(path, root): info for path, info in found.items()
             if info.get("type", "file") != "directory" and path != root}
    names = select_model_files(infos)
    if not names:
        raise ModelFolderError(
            f"model.path: {url}: no model files under it (found {len(infos)} objects; a model folder holds "
            f"config.json, tokenizer.json and *.safetensors, names ending {', '.join(MODEL_SUFFIXES)}): point "
            f"model.path at the folder the model was uploaded to, e.g. s3://bucket/models/all-MiniLM-L6-v2/")
    return fsys, root, {name: _version(infos[name]) for name in names}


def _complete(folder: Path, listing: dict[str, dict]) -> bool:
    """Every listed file is in ``folder`` with its listed size (a look at each file's size, no hashing)."""
    for name, version in listing.items():
        path = folder.joinpath(*name.split("/"))
        if not path.is_file() or (version["size"] is not None and path.stat().st_size != version["size"]):
            return False
    return True


def _version(info: dict) -> dict:
    """What identifies this version of one object: its size and every version stamp the store reports."""
    return {"size": info.get("size"), **{k: str(info[k]) for k in fs.STAMP_KEYS if info.get(k) is not None}}


def _key(url: str, listing: dict[str, dict]) -> str:
    body = json.dumps({"url": url.rstrip("/"), "files": listing}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()
