"""Paths and URLs through one door: local paths stay plain paths, `s3://`, `gs://`, `memory://`,
`file://` and every other fsspec protocol go through fsspec.

Names keep the form they were given in: a local input lists as local paths, a URL input lists as
URLs (with their protocol), so a unit's file can be opened on any worker that has the same
credentials and fsspec implementation installed.

A URL that its store cannot serve (no fsspec package for the protocol, an unreachable endpoint, no
credentials, a missing bucket or key) fails here as a `StorageError` (bad input, exit 3) whose one
line names the URL and the fix, whatever the backend raised (fsspec, botocore, aiohttp, gcsfs).
"""

from __future__ import annotations

import glob
import os
import posixpath
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping

import fsspec
import fsspec.core
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations

from embedpipe.errors import StorageError


def is_url(path: str) -> bool:
    """True for `proto://...` (file:// included); plain local paths are not URLs."""
    return "://" in str(path)


# fsspec options per store (``proto://bucket``), set in each process from the job: `use_job_storage`.
_STORAGE_OPTIONS: dict[str, dict[str, Any]] = {}


def store_of(url: str) -> str:
    """The store a URL is in: ``s3://bucket/a/b.parquet`` -> ``s3://bucket``."""
    protocol, rest = str(url).split("://", 1)
    return f"{protocol}://{rest.split('/', 1)[0]}"


def use_storage_options(url: str, options: Mapping[str, Any]) -> None:
    """Open every URL in ``url``'s store with these fsspec options, in this process (driver or worker)."""
    if is_url(url) and options:
        _STORAGE_OPTIONS[store_of(url)] = dict(options)


def use_job_storage(job) -> None:
    """The job's ``input.storage_options`` and ``output.storage_options`` for its input and output stores.

    Called wherever a job starts to touch its stores: the driver's run, each worker, each Ray task."""
    use_storage_options(job.input.path, job.input.storage_options)
    use_storage_options(job.output.path, job.output.storage_options)


def storage_options(path: str) -> dict[str, Any]:
    """The fsspec options ``path`` is opened with ({} for local paths and stores without options)."""
    return dict(_STORAGE_OPTIONS.get(store_of(path), {})) if is_url(path) else {}


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``path`` (with its store's options) and the path within it (protocol stripped)."""
    with remote_errors(path):
        return fsspec.core.url_to_fs(str(path), **storage_options(str(path)))


@contextmanager
def remote_errors(url: str) -> Iterator[None]:
    """What the store behind ``url`` raises, as one `StorageError` line naming the URL and the fix."""
    try:
        yield
    except _storage_errors() as exc:
        if isinstance(exc, StorageError):
            raise
        raise StorageError(f"{url}: {_diagnose(url, exc)}") from None


def join(base: str, *names: str) -> str:
    """``base/name/...`` for a local path or a URL (URLs always use ``/``)."""
    base = str(base)
    return posixpath.join(base, *names) if is_url(base) else os.path.join(base, *names)


def expand(path: str, *, suffixes: tuple[str, ...] | None = None) -> list[str]:
    """The files behind ``path``, sorted: a file, a glob, or every file under a directory.

    ``suffixes`` filters the directory walk (not globs or a named file). Local paths come back
    as local paths, URLs as URLs.
    """
    path = str(path)
    if not is_url(path):
        if glob.has_magic(path):
            return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if os.path.isdir(path):
            return sorted(str(p) for p in Path(path).rglob("*") if p.is_file() and _suffix_ok(p.name, suffixes))
        return [path] if os.path.isfile(path) else []
    fs, inner = filesystem(path)
    with remote_errors(path):
        if glob.has_magic(inner):
            found = [p for p in fs.glob(inner) if fs.isfile(p)]
        elif fs.isdir(inner):
            found = [p for p in fs.find(inner) if _suffix_ok(posixpath.basename(p), suffixes)]
        else:
            found = [inner] if fs.isfile(inner) else []
    return sorted(_unstrip(fs, p, like=path) for p in found)


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, inner = filesystem(path)
    with remote_errors(path):
        return fs.exists(inner)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, inner = filesystem(path)
    with remote_errors(path):
        return fs.isdir(inner)


@contextmanager
def open_binary(path: str) -> Iterator[BinaryIO]:
    """A seekable binary file for reading, local or remote."""
    if not is_url(path):
        with fsspec.open(str(path), "rb") as f:
            yield f
        return
    fs, inner = filesystem(path)
    with remote_errors(path):
        f = fs.open(inner, "rb")
    with f:
        yield f


def arrow_source(path: str, *, memory_map: bool = False) -> str | pa.NativeFile:
    """What pyarrow should open: the path itself when local (native IO, optionally memory-mapped),
    else a pyarrow file over the fsspec file."""
    if not is_url(path):
        return pa.memory_map(path) if memory_map else path
    fs, inner = filesystem(path)
    if isinstance(fs, LocalFileSystem):  # file:// URLs: still native IO
        return pa.memory_map(inner) if memory_map else inner
    with remote_errors(path):
        return pa.PythonFile(fs.open(inner, "rb"), mode="r")


def arrow_filesystem(paths: list[str]) -> tuple[Any, list[str]]:
    """What pyarrow's datasets should open ``paths`` (all in one store) with: (None, the paths) when local, else a
    pyarrow filesystem over fsspec's (with the store's options) and the paths within it."""
    if not paths or not is_url(paths[0]):
        return None, list(paths)
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fsys, _ = filesystem(paths[0])
    return PyFileSystem(FSSpecHandler(fsys)), [filesystem(p)[1] for p in paths]


def read_text(path: str) -> str:
    with open_binary(path) as f:
        return f.read().decode("utf-8")


def stamp(path: str) -> dict:
    """What identifies this version of a file for the manifest's fingerprint.

    Local files: absolute path, size and modification time (ns). URLs: the URL, the size and the
    store's modification stamp, whichever fsspec's ``info`` reports (mtime, LastModified, updated, ETag).
    """
    if not is_url(path):
        stat = os.stat(path)
        return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    fsys, inner = filesystem(path)
    with remote_errors(path):
        info = fsys.info(inner)
    keys = ("mtime", "LastModified", "last_modified", "updated", "ETag", "etag", "created")
    modified = next((info[k] for k in keys if info.get(k) is not None), None)
    return {"path": path, "size": info.get("size"), "modified": str(modified)}


def _storage_errors() -> tuple[type[BaseException], ...]:
    """What a store raises: OS errors (not found, denied, refused, timed out), a missing or unknown backend
    package (ImportError, ValueError), and the error bases of the backends loaded in this process."""
    found: list[type[BaseException]] = [OSError, ImportError, ValueError]
    for module, names in (("botocore.exceptions", ("BotoCoreError", "ClientError")), ("aiohttp", ("ClientError",)),
                          ("gcsfs.retry", ("HttpError",)), ("google.auth.exceptions", ("GoogleAuthError",)),
                          ("azure.core.exceptions", ("AzureError",))):
        loaded = sys.modules.get(module)  # a backend not imported yet raised nothing
        found += [getattr(loaded, name) for name in names if loaded is not None and hasattr(loaded, name)]
    return tuple(found)


def _diagnose(url: str, exc: BaseException) -> str:
    """The problem and the fix for one store error, on one line."""
    protocol = url.split("://", 1)[0] if is_url(url) else "file"
    said = " ".join(str(exc).split())[:300] or type(exc).__name__
    package = known_implementations.get(protocol, {}).get("class", "").split(".")[0]
    name = type(exc).__name__
    if isinstance(exc, ImportError) or (isinstance(exc, ValueError) and "install" in said.lower()):
        return (f"no fsspec package for {protocol}:// is installed ({said}): install it (pip install "
                f"{package or 'the fsspec package of ' + protocol}) on the driver and on every worker")
    if isinstance(exc, ValueError) and "protocol" in said.lower():
        return f"{said}: use a local path or a URL of an fsspec protocol (s3://, gs://, az://, memory://, ...)"
    if isinstance(exc, FileNotFoundError) or name in ("NoSuchBucket", "NoSuchKey"):
        return f"not found ({said}): check the bucket and the key, and that input.path names existing files"
    credentials = _CREDENTIALS.get(protocol, "set the store's credentials")
    if isinstance(exc, PermissionError) or "credential" in name.lower() or "denied" in said.lower():
        return f"access denied or no credentials ({said}): {credentials}"
    endpoint = _ENDPOINT.get(protocol, "check the store's endpoint and the network")
    if "connect" in name.lower() or "connect" in said.lower() or isinstance(exc, (ConnectionError, TimeoutError)):
        return f"cannot reach the store ({said}): {endpoint}"
    return f"cannot read it ({name}: {said}): check the URL; {credentials}; {endpoint}"


_CREDENTIALS = {
    "s3": "set credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)",
    "gs": "set credentials (GOOGLE_APPLICATION_CREDENTIALS, or gcloud auth application-default login)",
    "gcs": "set credentials (GOOGLE_APPLICATION_CREDENTIALS, or gcloud auth application-default login)",
}
_ENDPOINT = {
    "s3": "check the endpoint (AWS_ENDPOINT_URL for an S3-compatible store, AWS_REGION) and the network",
}


def _suffix_ok(name: str, suffixes: tuple[str, ...] | None) -> bool:
    if name.startswith((".", "_")):  # hidden and marker files (.tmp parts, _SUCCESS, .DS_Store)
        return False
    return suffixes is None or name.lower().endswith(suffixes)


def _unstrip(fs: fsspec.AbstractFileSystem, inner: str, *, like: str) -> str:
    """``inner`` with the protocol of ``like`` (``s3://b/k``, not fsspec's canonical form)."""
    protocol = like.split("://", 1)[0]
    full = fs.unstrip_protocol(inner)
    rest = full.split("://", 1)[1] if "://" in full else inner
    return f"{protocol}://{rest}"
