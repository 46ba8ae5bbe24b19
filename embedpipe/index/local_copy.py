"""An index on an object store, opened from a local copy: FAISS reads (and memory-maps) local files only.

The copy lives in ``<cache>/indexes/<sha256 of index.json>/`` (`embedpipe.io.cache.cache_dir`). index.json
is written last by every build and records that build's parts, settings and timings, so its hash names
one build's files: a second open of the same index reads index.json (one small GET) and finds its copy,
downloading nothing else; a rebuilt index has a new index.json and gets a new copy.

A copy is downloaded into a temporary folder next to its final name and renamed into place whole
(readers never see half a copy; two processes downloading at once both end with one complete copy).
index.json is read again after the download: an index rebuilt meanwhile is refused rather than mixed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from embedpipe.errors import BadJob
from embedpipe.io.cache import cache_dir
from embedpipe.io.layout import IndexLayout

INDEXES = "indexes"  # under the cache folder
FETCHED = ("faiss", "ids", "ivfdata")  # what opening and searching reads (holdout.parquet is the build's)


class IndexChanged(BadJob, RuntimeError):
    """The index was rebuilt while it was being downloaded."""


@dataclass(frozen=True)
class LocalCopy:
    files: IndexLayout  # the local copy's files
    downloaded: tuple[str, ...]  # the file names this open fetched (empty: the copy was there)


def local_copy(remote: IndexLayout) -> LocalCopy:
    """The local copy of the index at ``remote`` (an object-store folder with index.json), made if missing."""
    store = remote.store
    meta = store.read_bytes(remote.meta)
    key = hashlib.sha256(meta).hexdigest()
    final = IndexLayout(cache_dir() / INDEXES / key)
    if final.meta.is_file():
        return LocalCopy(final, ())
    final.dir.parent.mkdir(parents=True, exist_ok=True)
    work = IndexLayout(final.dir.with_name(f".{key}.{uuid.uuid4().hex[:8]}.tmp"))
    work.dir.mkdir()
    try:
        downloaded = []
        for name in FETCHED:
            source = getattr(remote, name)
            if name == "ivfdata" and not store.exists(source):
                continue  # only an on-disk IVF index has its inverted lists in a file of their own
            store.download(source, getattr(work, name))
            downloaded.append(Path(getattr(work, name)).name)
        if store.read_bytes(remote.meta) != meta:
            raise IndexChanged(f"{remote.dir} was rebuilt while it was being downloaded: open it again")
        work.meta.write_bytes(meta)  # last: a copy is complete once its index.json is there
        try:
            os.rename(work.dir, final.dir)
        except OSError:  # another process put the same copy in place first: theirs is as good
            if not final.meta.is_file():
                raise
    finally:
        shutil.rmtree(work.dir, ignore_errors=True)
    return LocalCopy(final, tuple(downloaded))
