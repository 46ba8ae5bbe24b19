"""The node's model cache: a model's files in a folder named by their content hash, written once per node.

    $EMBEDPIPE_CACHE_DIR/models/<sha256>/     (default ~/.cache/embedpipe/models/<sha256>/)

Workers never read ``model.path``: the driver ships the model's files (embedpipe/cluster/modelship.py)
and a worker calls ``materialize`` with a way to fetch each file's bytes. The folder is the model's
content hash (the manifest's ``model_fingerprint``: names and sha256 of every file a worker reads), so
two workers of one node, a restarted worker and the next run of the same model find it there and fetch
nothing; another model, or the same one with a changed file, gets another folder.

A folder is written atomically: its files go into ``.<sha256>.<host>.<pid>.tmp`` beside it, each is
checked against its sha256, then the temp folder is renamed to its final name. A crash leaves a temp
folder, never a half-filled model folder; the next writer on that host removes temp folders of dead
processes. When two workers of a node race, the first rename wins and the other drops its copy.
Knows nothing of Ray: ``fetch`` is any callable that returns a file's bytes in chunks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from embedpipe.errors import RunError
from embedpipe.io.lock import pid_alive

log = logging.getLogger(__name__)


class ModelCacheError(RunError, ValueError):
    """The shipped bytes are not the model the driver hashed, or the cache folder cannot be written."""


@dataclass(frozen=True)
class ModelFile:
    """One file of a model folder, as the driver hashed it."""

    name: str  # path inside the model folder, with "/" separators
    size: int
    sha256: str


def cache_root() -> Path:
    """``$EMBEDPIPE_CACHE_DIR/models`` (default ``$XDG_CACHE_HOME/embedpipe/models``, ``~/.cache/embedpipe/models``)."""
    from embedpipe.io.cache import cache_dir

    return cache_dir() / "models"


def cached_model(digest: str, files: Iterable[ModelFile], *, root: Path | None = None) -> Path | None:
    """The model's folder when this node holds it whole (every file there, of its size); else None."""
    folder = (root or cache_root()) / digest
    if not folder.is_dir():
        return None
    for f in files:
        path = folder / f.name
        if not path.is_file() or path.stat().st_size != f.size:
            return None
    return folder


def materialize(digest: str, files: list[ModelFile], fetch: Callable[[int], Iterable[bytes]], *,
                root: Path | None = None) -> tuple[Path, bool]:
    """The model's folder on this node, and whether it had to be fetched (False: a cache hit).

    ``fetch(i)`` yields the bytes of ``files[i]``; it is called only on a miss. Bytes that do not hash
    to the file's sha256 are refused (``ModelCacheError``) and nothing is cached."""
    root = root or cache_root()
    hit = cached_model(digest, files, root=root)
    if hit is not None:
        return hit, False
    folder = root / digest
    tmp = root / f".{digest}.{socket.gethostname()}.{os.getpid()}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _sweep_dead_temps(root, digest)
        shutil.rmtree(tmp, ignore_errors=True)  # this pid's own leftover (a reused pid)
        for i, f in enumerate(files):
            _write_checked(tmp / f.name, f, fetch(i), digest=digest)
        return _publish(tmp, folder, digest, files, root=root), True
    except OSError as exc:
        raise ModelCacheError(f"model cache {folder}: cannot write the model there ({exc}): free space or make "
                              f"it writable, or point EMBEDPIPE_CACHE_DIR at a writable local disk") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # refused bytes, a failed write, or a copy that lost the race


def _publish(tmp: Path, folder: Path, digest: str, files: list[ModelFile], *, root: Path) -> Path:
    """Rename the checked temp folder into place; a complete folder renamed there first wins."""
    if folder.exists() and cached_model(digest, files, root=root) is None:
        _remove_folder(folder, root=root)  # damaged (a file removed or cut by hand): replaced
    try:
        os.rename(tmp, folder)
    except OSError:  # another worker of this node renamed its copy first: use that one
        if cached_model(digest, files, root=root) is None:
            raise
    return folder


def _write_checked(path: Path, f: ModelFile, chunks: Iterable[bytes], *, digest: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sha, size = hashlib.sha256(), 0
    with open(path, "wb") as out:
        for chunk in chunks:
            sha.update(chunk)
            size += len(chunk)
            out.write(chunk)
    if size != f.size or sha.hexdigest() != f.sha256:
        raise ModelCacheError(
            f"model file {f.name} of model {digest[:12]}: the shipped bytes ({size} B, sha256 {sha.hexdigest()[:12]}) "
            f"are not the file the driver hashed ({f.size} B, sha256 {f.sha256[:12]}): the model folder changed "
            f"while the run started; leave it unchanged and rerun to resume")


def _remove_folder(folder: Path, *, root: Path) -> None:
    aside = root / f".{folder.name}.{socket.gethostname()}.{os.getpid()}.old.tmp"
    os.rename(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _sweep_dead_temps(root: Path, digest: str) -> None:
    """Remove this host's temp folders of ``digest`` whose writer process is gone (a crash mid-write)."""
    host = socket.gethostname()
    for tmp in root.glob(f".{digest}.{host}.*.tmp"):
        pid = tmp.name[len(f".{digest}.{host}."):].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            log.info("model cache: removing %s, left by a writer that died", tmp)
            shutil.rmtree(tmp, ignore_errors=True)
