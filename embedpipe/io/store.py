"""Where an output tree lives: a local folder or an object store (fsspec URL), behind one interface.

OutputLayout (embedpipe/io/layout.py) names every path of the tree; its ``store`` does the I/O:

| operation | LocalStore (a folder) | ObjectStore (s3://, gs://, az://, memory://, ...) |
| --- | --- | --- |
| ``write_bytes``/``write_table``/``put_file`` (whole, atomic) | temporary name, then ``os.replace`` | one PUT (an object appears whole or not at all) |
| ``read_bytes``, ``read_many`` | read the file(s) | GET, concurrent GETs |
| ``exists`` (a file), ``isdir`` | stat | HEAD, listing |
| ``list(folder)`` | names and sizes of the plain files in it (one ``scandir``) | names and sizes under the prefix (one listing) |
| ``remove``, ``remove_many``, ``remove_tree`` | unlink (a link itself), rmtree | DELETE (batched), recursive delete |
| ``sha256`` | hash the file | hash the object as it streams |
| ``upload(local, path)`` | copy | PUT each file |
| ``unique_parts`` | False: ``part-<unit>.parquet`` renamed into place | True: no rename, so a part is written under an attempt-unique name and the unit's manifest record (written last) is the commit point |

Paths under a URL root are ``Url``s (a ``str`` that joins with ``/``): ``Path("s3://b/x")`` would collapse
``//``. Every store call on a URL goes through ``embedpipe.io.fs.filesystem`` (the job's storage options
for that store) and ``remote_errors`` (a store's error as one line, exit 3).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

import pyarrow as pa
import pyarrow.parquet as pq

from embedpipe.io.fs import filesystem, is_url, remote_errors

ATTEMPT_HEX = 12  # hex digits of an attempt token: part-<unit>.<token>.parquet on object stores


class Url(str):
    """A path in an object store, ``proto://bucket/key``: ``/`` joins, ``.name``, ``.parent`` as pathlib's."""

    def __truediv__(self, name: str) -> "Url":
        return Url(f"{self.rstrip('/')}/{name}")

    @property
    def name(self) -> str:
        return posixpath.basename(self.rstrip("/"))

    @property
    def parent(self) -> "Url":
        protocol, rest = self.split("://", 1)
        head = posixpath.dirname(rest.rstrip("/"))
        return Url(f"{protocol}://{head}") if head else self

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    def with_name(self, name: str) -> "Url":
        return self.parent / name


TreePath = Union[Path, Url]


def tree_path(path: str | os.PathLike) -> TreePath:
    """A path of an output tree in its own kind: a ``Url`` for URLs, a ``Path`` for local paths."""
    if isinstance(path, Url):
        return path
    return Url(str(path).rstrip("/")) if is_url(str(path)) else Path(path)


def attempt_token() -> str:
    """What makes one attempt's part name unique (short random hex; no two attempts share one)."""
    return uuid.uuid4().hex[:ATTEMPT_HEX]


@dataclass(frozen=True)
class Written:
    """A file as written: its path, size and sha256 (of the bytes written: never read back from the store)."""

    path: TreePath
    bytes: int
    sha256: str


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def table_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **parquet_options(table))
    return sink.getvalue().to_pybytes()


def parquet_options(table: pa.Table) -> dict:
    """``pq.write_table``'s options for ``table``, the one rule of every table a store writes: no dictionary for its
    float vector columns. Their values are almost all distinct, so pyarrow's dictionary only grows until it falls
    back to plain pages: a MiniLM part of 500 float32 rows was 1,203 kB in 13.5 ms with it and 772 kB in 2.7 ms
    without, the same values (2 cores of an AMX Xeon, docs/performance.md, 2026-12-08). Integer vectors keep it
    (int8, uint8, packed binary: INT32 in Parquet, their 256 values 8 bits a value: 235 kB against 446 kB plain)."""
    floats = {f.name for f in table.schema if _float_vectors(f.type)}
    if not floats:
        return {}
    return {"use_dictionary": [f.name for f in table.schema if f.name not in floats] or False}


def _float_vectors(kind: pa.DataType) -> bool:
    lists = pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind)
    return lists and pa.types.is_floating(kind.value_type)


class LocalStore:
    """An output tree in a local (or mounted) folder: every write is a temporary name, then ``os.replace``."""

    unique_parts = False
    local = True

    # ---------------------------------------------------------------- writes (whole and atomic)
    @contextmanager
    def atomic_path(self, path: TreePath) -> Iterator[Path]:
        """A temporary path to write ``path``'s content to; renamed onto ``path`` on success, removed on failure."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            yield tmp
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def write_bytes(self, path: TreePath, data: bytes) -> Written:
        with self.atomic_path(path) as tmp:
            tmp.write_bytes(data)
        return Written(Path(path), len(data), sha256_bytes(data))

    def write_table(self, table: pa.Table, path: TreePath) -> Written:
        with self.atomic_path(path) as tmp:
            pq.write_table(table, tmp, **parquet_options(table))
        return Written(Path(path), os.path.getsize(path), self.sha256(path))

    def put_file(self, local: str | Path, path: TreePath) -> None:
        """A finished local file to ``path`` (moved by one rename when on the same filesystem)."""
        with self.atomic_path(path) as tmp:
            shutil.copyfile(local, tmp)

    def upload(self, local: str | Path, path: TreePath) -> None:
        """A local file or folder to ``path`` (each file whole)."""
        local = Path(local)
        if local.is_dir():
            for file in sorted(p for p in local.rglob("*") if p.is_file()):
                self.put_file(file, Path(path) / file.relative_to(local))
        else:
            self.put_file(local, path)

    def mkdir(self, path: TreePath) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- reads
    def read_bytes(self, path: TreePath) -> bytes:
        return Path(path).read_bytes()

    def read_many(self, paths: list[TreePath]) -> dict[TreePath, bytes]:
        """The files that could be read, by path (one missing or unreadable is left out)."""
        found = {}
        for path in paths:
            try:
                found[path] = Path(path).read_bytes()
            except OSError:
                continue
        return found

    @contextmanager
    def open(self, path: TreePath) -> Iterator:
        with open(path, "rb") as f:
            yield f

    def arrow_source(self, path: TreePath):
        """What pyarrow should read (native IO for local files)."""
        return str(path)

    def download(self, path: TreePath, local: str | Path) -> Path:
        shutil.copyfile(path, local)
        return Path(local)

    def exists(self, path: TreePath) -> bool:
        """A plain file (not a link) at ``path``."""
        path = Path(path)
        return path.is_file() and not path.is_symlink()

    def isdir(self, path: TreePath) -> bool:
        return Path(path).is_dir()

    def list(self, folder: TreePath) -> dict[str, int]:
        """Names and sizes of the plain files directly in ``folder`` (links and folders left out); {} when none."""
        try:
            with os.scandir(folder) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file(follow_symlinks=False)}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def names(self, folder: TreePath) -> list[str]:
        """Every entry directly in ``folder`` (files, folders, links), sorted; [] when there is none."""
        try:
            return sorted(os.listdir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def sha256(self, path: TreePath) -> str:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()

    # ---------------------------------------------------------------- removal
    def remove(self, path: TreePath) -> None:
        Path(path).unlink(missing_ok=True)

    def remove_many(self, paths: list[TreePath]) -> None:
        for path in paths:
            self.remove(path)

    def remove_tree(self, path: TreePath) -> None:
        path = Path(path)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)  # does not follow links inside the tree


class ObjectStore:
    """An output tree under an fsspec URL: every write is one PUT of the whole object; there is no rename."""

    unique_parts = True
    local = False

    def _fs(self, path: TreePath):
        return filesystem(str(path))

    # ---------------------------------------------------------------- writes (whole and atomic: one PUT)
    @contextmanager
    def atomic_path(self, path: TreePath) -> Iterator[Path]:
        """A local temporary file to write ``path``'s content to; uploaded by one PUT on success."""
        with tempfile.TemporaryDirectory(prefix="embedpipe-") as folder:
            tmp = Path(folder) / Url(path).name
            yield tmp
            self.put_file(tmp, path)

    def write_bytes(self, path: TreePath, data: bytes) -> Written:
        fsys, inner = self._fs(path)
        with remote_errors(str(path)):
            fsys.pipe_file(inner, data)
        return Written(Url(path), len(data), sha256_bytes(data))

    def write_table(self, table: pa.Table, path: TreePath) -> Written:
        return self.write_bytes(path, table_bytes(table))

    def put_file(self, local: str | Path, path: TreePath) -> None:
        fsys, inner = self._fs(path)
        with remote_errors(str(path)):
            fsys.put_file(str(local), inner)

    def upload(self, local: str | Path, path: TreePath) -> None:
        local = Path(local)
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        for file in files:
            self.put_file(file, Url(path) / file.relative_to(local).as_posix() if local.is_dir() else path)

    def mkdir(self, path: TreePath) -> None:
        """Nothing to do: an object store has prefixes, not folders."""

    # ---------------------------------------------------------------- reads
    def read_bytes(self, path: TreePath) -> bytes:
        fsys, inner = self._fs(path)
        with remote_errors(str(path)):
            return fsys.cat_file(inner)

    def read_many(self, paths: list[TreePath]) -> dict[TreePath, bytes]:
        """Concurrent GETs (one request each, in flight together where the store's client allows)."""
        if not paths:
            return {}
        fsys, _ = self._fs(paths[0])
        inner = {self._fs(p)[1]: p for p in paths}
        with remote_errors(str(paths[0])):
            got = fsys.cat(list(inner), on_error="omit")
        return {inner[k]: v for k, v in got.items() if isinstance(v, bytes)}

    @contextmanager
    def open(self, path: TreePath) -> Iterator:
        fsys, inner = self._fs(path)
        with remote_errors(str(path)):
            f = fsys.open(inner, "rb")
        with f:
            yield f

    def arrow_source(self, path: TreePath):
        """A pyarrow file over the object (ranged reads: a Parquet footer, then the columns asked)."""
        fsys, inner = self._fs(path)
        with remote_errors(str(path)):
            return pa.PythonFile(fsys.open(inner, "rb"), mode="r")

    def download(self, path: TreePath, local: str | Path) -> Path:
        fsys, inner = self._fs(path)
        with remote_errors(str(path)):
            fsys.get_file(inner, str(local))
        return Path(local)

    def exists(self, path: TreePath) -> bool:
        fsys, inner = self._fs(path)
        with remote_errors(str(path)):
            fsys.invalidate_cache(posixpath.dirname(inner))
            return fsys.isfile(inner)

    def isdir(self, path: TreePath) -> bool:
        return bool(self._list(path))

    def list(self, folder: TreePath) -> dict[str, int]:
        """Names and sizes of the objects directly under ``folder/`` (one listing, never a cached one)."""
        return {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0)
                for e in self._list(folder) if e.get("type") == "file"}

    def names(self, folder: TreePath) -> list[str]:
        """Every object and prefix directly under ``folder/``, sorted; [] when there is none."""
        return sorted({posixpath.basename(e["name"].rstrip("/")) for e in self._list(folder)})

    def _list(self, folder: TreePath) -> list[dict]:
        fsys, inner = self._fs(folder)
        with remote_errors(str(folder)):
            fsys.invalidate_cache(inner)  # other processes (workers) wrote here since the last listing
            try:
                return fsys.ls(inner, detail=True)
            except FileNotFoundError:
                return []

    def sha256(self, path: TreePath) -> str:
        digest = hashlib.sha256()
        with self.open(path) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()

    # ---------------------------------------------------------------- removal
    def remove(self, path: TreePath) -> None:
        self.remove_many([path])

    def remove_many(self, paths: list[TreePath]) -> None:
        """One batched delete where the store has one (S3: DeleteObjects); a missing object is no error."""
        if not paths:
            return
        fsys, _ = self._fs(paths[0])
        inner = [self._fs(p)[1] for p in paths]
        with remote_errors(str(paths[0])):
            try:
                fsys.rm(inner)
            except FileNotFoundError:
                for one in inner:
                    try:
                        fsys.rm_file(one)
                    except FileNotFoundError:
                        continue
            fsys.invalidate_cache()

    def remove_tree(self, path: TreePath) -> None:
        fsys, inner = self._fs(path)
        with remote_errors(str(path)):
            if fsys.isfile(inner):
                fsys.rm_file(inner)
            elif self._list(path):
                fsys.rm(inner, recursive=True)
            fsys.invalidate_cache()


Store = Union[LocalStore, ObjectStore]
LOCAL = LocalStore()
OBJECT = ObjectStore()


def store_for(path: str | os.PathLike) -> Store:
    """The store of a path of an output tree: ObjectStore for URLs (file:// included), else LocalStore."""
    return OBJECT if is_url(str(path)) else LOCAL
