"""One small object on an object store, written only on a condition: create if absent, replace or
delete only if it is still the version we read.

The run lock (`embedpipe.io.lock`) rests on these three writes; each is one request the store
decides atomically, so two runs racing on the same object cannot both win:

- ``create``: S3 ``PutObject`` with ``If-None-Match: *`` (fails when the object exists);
- ``replace``: ``PutObject`` with ``If-Match: <ETag read>`` (fails when anyone wrote it since);
- ``delete``: ``DeleteObject`` with ``If-Match: <ETag read>``.

A read returns the content and its tag (the ETag) from one ``GetObject``, so the two always agree,
with the store's own ``LastModified`` (the store's clock, not the writer's).

Only stores known to decide these conditions server-side get a `ConditionalObject`: S3 and S3-compatible
stores through s3fs (AWS S3 honours both conditions since 2024; so does moto). Every other fsspec backend
(``memory://``, ``gs://`` until it is wired here, HTTP, ...) gets None from `conditional_object`: its
``mode="create"`` is at best a check-then-write, which two runs can both pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedpipe.io.fs import filesystem, remote_errors

# The store refused the write because its condition did not hold (S3: 412 PreconditionFailed; 409
# ConditionalRequestConflict when two conditional writes to one key overlap).
_CONDITION_FAILED = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
# The store does not understand the condition at all (an older S3-compatible server).
_NOT_SUPPORTED = ("NotImplemented", "501")


class ConditionUnsupported(RuntimeError):
    """The store answered a conditional write with 'not implemented'."""


@dataclass(frozen=True)
class Seen:
    """The object as one read found it."""

    data: bytes
    tag: str  # the store's version tag (ETag): replace/delete only while it is still this
    modified: float  # the store's last-modified time of this version (unix seconds)


class ConditionalObject:
    """The object at ``url`` on an S3 (or S3-compatible) store, through s3fs."""

    def __init__(self, url: str, fs) -> None:
        self.url = url
        self._fs = fs
        _, inner = filesystem(url)
        self._bucket, self._key, _ = fs.split_path(inner)

    def create(self, data: bytes) -> str | None:
        """Write ``data`` if no object is there; its tag, or None when one exists."""
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, *, tag: str) -> str | None:
        """Overwrite the object if it is still version ``tag``; the new tag, or None when it changed or is gone."""
        return self._put(data, IfMatch=tag)

    def read(self) -> Seen | None:
        """The object's content, tag and modification time from one request; None when there is none."""
        import fsspec.asyn

        async def get():
            resp = await self._fs._call_s3("get_object", Bucket=self._bucket, Key=self._key)
            try:
                return Seen(data=await resp["Body"].read(), tag=resp["ETag"], modified=resp["LastModified"].timestamp())
            finally:
                resp["Body"].close()

        with remote_errors(self.url):
            try:
                return fsspec.asyn.sync(self._fs.loop, get)
            except FileNotFoundError:
                return None

    def delete(self, *, tag: str) -> bool:
        """Remove the object if it is still version ``tag``; False when it changed (someone else's now)."""
        with remote_errors(self.url):
            try:
                self._fs.call_s3("delete_object", Bucket=self._bucket, Key=self._key, IfMatch=tag)
            except FileNotFoundError:
                return False
            except OSError as exc:
                if _code(exc) in _CONDITION_FAILED:
                    return False
                if _code(exc) in _NOT_SUPPORTED:  # no conditional delete: read, compare, delete (a tiny window)
                    seen = self.read()
                    if seen is None or seen.tag != tag:
                        return False
                    self._fs.call_s3("delete_object", Bucket=self._bucket, Key=self._key)
                    return True
                raise
            finally:
                self._fs.invalidate_cache(f"{self._bucket}/{self._key}")
        return True

    def _put(self, data: bytes, **condition: str) -> str | None:
        with remote_errors(self.url):
            try:
                out = self._fs.call_s3("put_object", Bucket=self._bucket, Key=self._key, Body=data, **condition)
            except FileExistsError:  # s3fs's name for a failed If-None-Match
                return None
            except OSError as exc:
                if _code(exc) in _CONDITION_FAILED:
                    return None
                if _code(exc) in _NOT_SUPPORTED:
                    raise ConditionUnsupported(f"{self.url}: the store does not support {next(iter(condition))}") from None
                raise
            finally:
                self._fs.invalidate_cache(f"{self._bucket}/{self._key}")
        return out["ETag"]


def conditional_object(url: str) -> ConditionalObject | None:
    """The object at ``url`` with conditional writes, or None when its store cannot decide them server-side."""
    fs, _ = filesystem(url)
    if type(fs).__module__.split(".")[0] == "s3fs":
        return ConditionalObject(url, fs)
    return None


def _code(exc: BaseException) -> str:
    """The store's error code behind an s3fs OSError (botocore's ClientError is its cause)."""
    response = getattr(exc.__cause__, "response", None) or {}
    error = response.get("Error") or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(error.get("Code") or status or "")
