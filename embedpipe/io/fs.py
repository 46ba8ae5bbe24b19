"""Paths and URLs through one door: local paths stay plain paths, `s3://`, `gs://`, `memory://`,
`file://` and every other fsspec protocol go through fsspec.

Names keep the form they were given in: a local input lists as local paths, a URL input lists as
URLs (with their protocol), so a unit's file can be opened on any worker that has the same
credentials and fsspec implementation installed.

A URL that its store cannot serve (no fsspec package for the protocol, an unreachable endpoint, no
credentials or rejected ones, a missing bucket or key, a permission the credentials lack) fails here as a
`StorageError` (bad input, exit 3) whose one line names the URL, what is wrong and the fix (the job field
or environment variable to set, the permission to grant), whatever the backend raised (fsspec, botocore,
aiohttp, gcsfs); no secret of the job's storage_options or the environment is ever in that line.
`check_readable` and `check_writable` ask the store those questions before any worker starts (preflight).
"""

from __future__ import annotations

import glob
import os
import posixpath
import re
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping

import fsspec
import fsspec.core
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations

from embedpipe.config import PUBLIC_STORAGE_OPTIONS, REDACTED
from embedpipe.errors import StorageError


def is_url(path: str) -> bool:
    """True for `proto://...` (file:// included); plain local paths are not URLs."""
    return "://" in str(path)


# fsspec options per store (``proto://bucket``), set in each process from the job: `use_job_storage`.
_STORAGE_OPTIONS: dict[str, dict[str, Any]] = {}
# the job section(s) whose path is in each store ("input", "output"): the field an error's fix names
_SECTIONS: dict[str, set[str]] = {}


def store_of(url: str) -> str:
    """The store a URL is in: ``s3://bucket/a/b.parquet`` -> ``s3://bucket``."""
    protocol, rest = str(url).split("://", 1)
    return f"{protocol}://{rest.split('/', 1)[0]}"


def use_storage_options(url: str, options: Mapping[str, Any]) -> None:
    """Open every URL in ``url``'s store with these fsspec options, in this process (driver or worker)."""
    if is_url(url) and options:
        _STORAGE_OPTIONS[store_of(url)] = dict(options)


def use_job_storage(job) -> None:
    """The job's ``model.storage_options``, ``input.storage_options`` and ``output.storage_options`` for its
    model, input and output stores (one store in two sections: the input's or output's options win).

    Called wherever a job starts to touch its stores: the driver's run, each worker, each Ray task."""
    for section in ("model", "input", "output"):
        cfg = getattr(job, section)
        use_storage_options(cfg.path, cfg.storage_options)
        if is_url(cfg.path):
            _SECTIONS.setdefault(store_of(cfg.path), set()).add(section)


def storage_options(path: str) -> dict[str, Any]:
    """The fsspec options ``path`` is opened with ({} for local paths and stores without options)."""
    return dict(_STORAGE_OPTIONS.get(store_of(path), {})) if is_url(path) else {}


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``path`` (with its store's options) and the path within it (protocol stripped)."""
    with remote_errors(path):
        return fsspec.core.url_to_fs(str(path), **storage_options(str(path)))


@contextmanager
def remote_errors(url: str, *, action: str = "read", section: str | None = None) -> Iterator[None]:
    """What the store behind ``url`` raises, as one `StorageError` line naming the URL and the fix.

    ``action`` (list, read, write, delete) is what the code inside does: an access-denied line names the
    permission it needs. ``section`` (input, output) names the job fields in the fix; by default the
    section(s) whose path is in this store."""
    try:
        yield
    except TypeError as exc:  # a storage option the backend does not take (raised at its first request)
        options = storage_options(url)
        if "unexpected keyword argument" not in str(exc) or not options:
            raise
        protocol = str(url).split("://", 1)[0]
        raise StorageError(f"{url}: a storage option is not one {protocol}:// takes ({exc}): check the names "
                           f"in the job's storage_options ({', '.join(sorted(options))}) against the fsspec "
                           f"backend's documentation") from None
    except _storage_errors() as exc:
        if isinstance(exc, StorageError):
            raise
        raise StorageError(_scrub(f"{url}: {_diagnose(url, exc, action=action, section=section)}", url)) from None


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
    with remote_errors(path, action="list"):
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
    with remote_errors(path, action="list"):
        return fs.exists(inner)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, inner = filesystem(path)
    with remote_errors(path, action="list"):
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


# what fsspec's ``info`` of an object may say about its version (backends name it differently)
STAMP_KEYS = ("mtime", "LastModified", "last_modified", "updated", "ETag", "etag", "created")


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
    modified = next((info[k] for k in STAMP_KEYS if info.get(k) is not None), None)
    return {"path": path, "size": info.get("size"), "modified": str(modified)}


# --------------------------------------------------------------------------- checks before any worker starts

PROBE_PREFIX = ".embedpipe-write-probe-"  # + random hex: the one object check_writable writes, and deletes
PROBE_BYTES = b"embedpipe write probe\n"


def check_readable(url: str, *, section: str = "input") -> None:
    """The store behind ``url`` answers, its bucket exists, the credentials are accepted and may list the
    URL's prefix and read the first object under it; else a `StorageError` line naming the fix.

    S3 (s3fs): two requests, a LIST of at most one key under the URL's prefix (s3:ListBucket) and a one-byte
    GET of that key (s3:GetObject); a prefix with nothing under it passes (the listing then says so). Other
    fsspec stores: their backend package is checked here, the rest when the input is listed."""
    fsys, inner = filesystem(url)  # no fsspec package for the protocol: fails here
    if not _is_s3(fsys):
        return
    with remote_errors(url, action="list", section=section):
        first = _first_object(fsys, _literal_prefix(inner))
    if first is not None:
        key, size = first
        with remote_errors(_unstrip(fsys, key, like=url), action="read", section=section):
            if size:
                fsys.cat_file(key, start=0, end=1)
            else:  # an empty object has no byte to read (S3 answers 416): its HEAD needs s3:GetObject too
                fsys.info(key)


def check_writable(url: str, *, section: str = "output") -> None:
    """The store behind ``url`` takes writes under it: a probe object deleted, written, read and deleted.

    The probe is ``<url>/.embedpipe-write-probe-<random hex>``. It is deleted first, while it does not exist,
    so credentials that may not delete fail before anything is written; then written (22 bytes), read back
    and deleted, also when the read fails. Nothing is left behind (a versioned bucket keeps the probe's
    noncurrent version and delete marker). S3: a LIST of at most one key comes first (the bucket exists,
    s3:ListBucket): five requests in all."""
    fsys, inner = filesystem(url)
    if isinstance(fsys, LocalFileSystem):
        return
    root = inner.rstrip("/")
    if _is_s3(fsys):
        with remote_errors(url, action="list", section=section):
            _first_object(fsys, root + "/")
    probe = f"{root}/{PROBE_PREFIX}{uuid.uuid4().hex}"
    with remote_errors(url, action="delete", section=section):
        _remove(fsys, probe)
    with remote_errors(url, action="write", section=section):
        fsys.pipe_file(probe, PROBE_BYTES)
    try:
        with remote_errors(url, action="read", section=section):
            fsys.cat_file(probe)
    finally:
        with remote_errors(url, action="delete", section=section):
            _remove(fsys, probe)


def _is_s3(fsys: fsspec.AbstractFileSystem) -> bool:
    return callable(getattr(fsys, "call_s3", None))  # s3fs.S3FileSystem, for every S3-compatible endpoint


def _first_object(fsys: fsspec.AbstractFileSystem, prefix: str) -> tuple[str, int] | None:
    """(bucket/key, size) of the first object under ``prefix`` on S3: one LIST of at most one key."""
    bucket, key, _ = fsys.split_path(prefix)
    found = fsys.call_s3("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1).get("Contents") or []
    return (f"{bucket}/{found[0]['Key']}", int(found[0].get("Size") or 0)) if found else None


def _literal_prefix(inner: str) -> str:
    """The part of a path before its first glob character: ``b/corpus/*.parquet`` -> ``b/corpus/``."""
    return re.split(r"[*?\[]", inner, maxsplit=1)[0]


def _remove(fsys: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        fsys.rm_file(path)
    except FileNotFoundError:  # stores that refuse to delete what is not there (S3 answers 204)
        pass


# --------------------------------------------------------------------------- what went wrong, and the fix

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


# error class names and store error codes (botocore's Error.Code, HTTP status) along an exception's chain
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "ProfileNotFound",
                   "DefaultCredentialsError", "ClientAuthenticationError"}
_REJECTED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired",
             "InvalidClientTokenId", "AuthenticationFailed", "InvalidAuthenticationInfo"}
_DENIED = {"AccessDenied", "AllAccessDisabled", "403", "Forbidden", "AuthorizationFailure",
           "AuthorizationPermissionMismatch"}
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError",
                "ClientConnectorError", "ServerDisconnectedError", "ConnectionError", "ConnectionRefusedError",
                "TimeoutError", "ServerTimeoutError"}


def _diagnose(url: str, exc: BaseException, *, action: str = "read", section: str | None = None) -> str:
    """The problem and the fix for one store error, on one line."""
    protocol = url.split("://", 1)[0] if is_url(url) else "file"
    name, codes = type(exc).__name__, _error_codes(exc)
    said = _said(exc)
    package = known_implementations.get(protocol, {}).get("class", "").split(".")[0]
    fields = _Fields(_sections(url, section))
    if isinstance(exc, ImportError) or (isinstance(exc, ValueError) and "install" in said.lower()):
        return (f"no fsspec package for {protocol}:// is installed ({said}): install it (pip install "
                f"{package or 'the fsspec package of ' + protocol}) on the driver and on every worker")
    if isinstance(exc, ValueError) and "protocol" in said.lower():
        return f"{said}: use a local path or a URL of an fsspec protocol (s3://, gs://, az://, memory://, ...)"
    if codes & _NO_CREDENTIALS:
        return f"no credentials for {store_of(url)} ({said}): {_credentials_fix(protocol, fields)}"
    if codes & _REJECTED:
        return (f"the store refused the credentials{_credentials_source(url, fields)} ({said}): "
                f"{_credentials_fix(protocol, fields, rejected=True)}")
    if "NoSuchBucket" in codes:
        address, _ = _endpoint(url, fields)
        return (f"bucket {store_of(url).split('://', 1)[1]!r} does not exist at {address} ({said}): create it, or "
                f"fix the bucket name in {fields('path')}, or the endpoint ({_endpoint_fields(protocol, fields)})")
    if isinstance(exc, FileNotFoundError) or codes & {"NoSuchKey", "404"}:
        return f"not found ({said}): check the bucket and the key, and that {fields('path')} names existing files"
    if codes & _DENIED or isinstance(exc, PermissionError):
        detailed = not codes & {"403", "Forbidden"} or "AccessDenied" in codes  # a HEAD's 403 has no error code
        return (f"access denied ({said}): {_permission_fix(url, protocol, action, fields)}"
                + ("" if detailed else f", or check the credentials{_credentials_source(url, fields)}"))
    if codes & _UNREACHABLE or "connect" in said.lower() or isinstance(exc, (ConnectionError, TimeoutError)):
        address, source = _endpoint(url, fields)
        return (f"cannot reach the store at {address}{', set by ' + source if source else ''} ({said}): point "
                f"{_endpoint_fields(protocol, fields)} at the store, and check the network from the driver "
                f"and every node")
    return (f"cannot {action} it ({name}: {said}): check the URL; "
            f"{_credentials_fix(protocol, fields)}; {_endpoint_fields(protocol, fields)}")


def _said(exc: BaseException) -> str:
    """What the store said, on one line, with its error code (``NoSuchBucket: The specified bucket ...``)."""
    said = " ".join(str(exc).split())[:300] or type(exc).__name__
    code = next((c for c in _store_codes(exc) if not c.isdigit()), None)
    return f"{code}: {said}" if code and code not in said else said


def _store_codes(exc: BaseException | None) -> list[str]:
    """The store's error codes (botocore's Error.Code) along the chain, outermost first."""
    codes, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            codes.append(str(response["Error"]["Code"]))
        exc = exc.__cause__ or exc.__context__
    return codes


def _error_codes(exc: BaseException) -> set[str]:
    """Class names and store error codes of ``exc`` and the errors it was raised from (s3fs turns botocore's
    ClientError into an OSError raised inside the handler: the code stays on the chain)."""
    names: set[str] = set()
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        names.add(type(chain).__name__)
        chain = chain.__cause__ or chain.__context__
    return names | set(_store_codes(exc))


def _sections(url: str, section: str | None) -> tuple[str, ...]:
    """The job section(s) an error on ``url`` is about: the one given, else those whose path is in its store."""
    if section:
        return (section,)
    return tuple(sorted(_SECTIONS.get(store_of(url), {"input"}))) if is_url(url) else ("input",)


@dataclass(frozen=True)
class _Fields:
    """The job fields an error's fix names: ``fields("storage_options")`` -> ``input.storage_options``."""

    sections: tuple[str, ...]

    def __call__(self, name: str) -> str:
        return " or ".join(f"{s}.{name}" for s in self.sections)


def _credentials_fix(protocol: str, fields: _Fields, *, rejected: bool = False) -> str:
    options = fields("storage_options")
    if protocol == "s3":
        verb = "correct" if rejected else "set"
        return (f"{verb} {options} key and secret (or profile), or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                f"(or AWS_PROFILE) on the driver and every node" + ("; temporary credentials (AWS_SESSION_TOKEN) "
                                                                     "may have expired" if rejected else ""))
    if protocol in ("gs", "gcs"):
        return (f"set GOOGLE_APPLICATION_CREDENTIALS (a service-account key file) or {options} token, or run "
                f"gcloud auth application-default login, on the driver and every node")
    if protocol in ("az", "abfs", "abfss", "adl"):
        return (f"set {options} account_name and account_key (or sas_token), or AZURE_STORAGE_CONNECTION_STRING, "
                f"on the driver and every node")
    return f"set the store's credentials in {options}"


def _credentials_source(url: str, fields: _Fields) -> str:
    """Where the credentials in use came from, for a line saying they were refused."""
    options = storage_options(url)
    if any(k in options for k in ("key", "secret", "token", "profile")):
        return f" (from {fields('storage_options')})"
    if url.startswith("s3://") and os.environ.get("AWS_ACCESS_KEY_ID"):
        return " (from AWS_ACCESS_KEY_ID)"
    if url.startswith("s3://") and os.environ.get("AWS_PROFILE"):
        return " (from AWS_PROFILE)"
    return ""


def _endpoint(url: str, fields: _Fields) -> tuple[str, str | None]:
    """The store's address in use and the field or variable that set it (None: the backend's default)."""
    options = storage_options(url)
    client = options.get("client_kwargs") if isinstance(options.get("client_kwargs"), dict) else {}
    if options.get("endpoint_url"):
        return str(options["endpoint_url"]), f"{fields('storage_options')}.endpoint_url"
    if client.get("endpoint_url"):
        return str(client["endpoint_url"]), f"{fields('storage_options')}.client_kwargs.endpoint_url"
    if url.startswith("s3://"):
        for variable in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if os.environ.get(variable):
                return os.environ[variable], variable
        return "AWS's default endpoint", None
    return "the store's default endpoint", None


def _endpoint_fields(protocol: str, fields: _Fields) -> str:
    if protocol == "s3":
        return f"{fields('storage_options')} endpoint_url, or AWS_ENDPOINT_URL"
    return f"the store's endpoint in {fields('storage_options')}"


_PERMISSIONS = {
    "s3": {"list": "s3:ListBucket", "read": "s3:GetObject", "write": "s3:PutObject", "delete": "s3:DeleteObject"},
    "gs": {"list": "storage.objects.list", "read": "storage.objects.get", "write": "storage.objects.create",
           "delete": "storage.objects.delete"},
}
_PERMISSIONS["gcs"] = _PERMISSIONS["gs"]
_NEEDS = {"input": ("list", "read"), "model": ("list", "read"), "output": ("list", "read", "write", "delete")}


def _permission_fix(url: str, protocol: str, action: str, fields: _Fields) -> str:
    """The permission ``action`` needs on ``url`` (and all the job's paths need), for an access-denied line."""
    names = _PERMISSIONS.get(protocol)
    if names is None:
        return f"grant these credentials {action} access to {url}"
    bucket, _, key = url.split("://", 1)[1].partition("/")
    key = key.rstrip("/")
    if protocol == "s3" and action == "list":
        resource = f"arn:aws:s3:::{bucket}"
    elif protocol == "s3":  # an output's objects are all under its prefix; an input's path may be a prefix
        resource = f"arn:aws:s3:::{bucket}/{key}/*" if "output" in fields.sections else f"arn:aws:s3:::{bucket}/{key}*"
    else:
        resource = f"gs://{bucket}"
    needs = "; ".join(f"{s}.path needs {', '.join(names[a] for a in _NEEDS[s])}" for s in fields.sections)
    return f"grant {names.get(action, action)} on {resource} to these credentials ({needs})"


def _scrub(text: str, url: str) -> str:
    """``text`` without any secret of ``url``'s storage options or the environment (nor a URL's user:password)."""
    secrets = _secret_values(storage_options(url))
    secrets += [os.environ.get(v, "") for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                                "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING")]
    for secret in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return re.sub(r"://[^/@\s]+@", f"://{REDACTED}@", text)


def _secret_values(options: Mapping[str, Any]) -> list[str]:
    """The text of every option the job record redacts (config.redact_storage_options): its secrets."""
    found: list[str] = []
    for name, value in options.items():
        if name in PUBLIC_STORAGE_OPTIONS:
            found += _secret_values(value) if isinstance(value, Mapping) else []
        else:
            found += _all_text(value)
    return found


def _all_text(value: Any) -> list[str]:
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _all_text(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _all_text(v)]
    return [str(value)] if isinstance(value, (str, int)) and not isinstance(value, bool) else []


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
