"""One live run per output path: a lock naming host, pid and start time, kept fresh by a heartbeat.

Schedulers overlap runs (a slow night, a manual rerun): the second run on a held output path
fails at once with the holder's name. A lock left by a dead run is taken over: on the same host
when its pid is gone, from any host when its heartbeat is older than ``STALE_SECONDS``. A run whose
lock was taken over anyway (it stalled past ``STALE_SECONDS``, or its store was unreachable that
long) learns it at its next heartbeat and stops with `LockLost` (exit 5): two runs never keep
writing one output.

Local (and mounted) paths: a lock file. Every step is atomic, so runs starting together on a stale
lock end with exactly one holder:

- create: the lock is written whole to a unique temporary file, then hard-linked to its name
  (``os.link`` fails when the name exists), then read back to confirm this run holds it;
- take over: a stale lock is first claimed by hard-linking it to a tombstone named after that
  one file (inode, mtime); the link fails for every run but one. The claimer checks that the
  tombstone still is the file it judged stale (inode, mtime and content), removes the lock only
  then, and creates its own like everyone else.

Object stores (``s3://``): a lock object, written only by conditional requests the store decides
(`embedpipe.io.conditional`), so it is race-free as well:

- create: ``PUT If-None-Match: *``; the store lets exactly one run create it;
- heartbeat: the object is rewritten with a fresh timestamp in its content (an object's mtime cannot
  be touched) by ``PUT If-Match: <the ETag this run last wrote>``: a lock another run took over
  fails the condition, and this run stops with `LockLost`;
- age: the store's own ``LastModified`` of the last heartbeat (the judge's clock against the
  store's, never the holder's);
- take over: the run that judged a lock stale replaces it with ``PUT If-Match: <the ETag it judged>``;
  of several runs judging the same stale lock only one write matches, and a heartbeat that lands
  between the judgement and the takeover changes the ETag, so a live holder is never replaced;
- release: ``DELETE If-Match: <our ETag>`` (a lock another run holds by now is left alone).

Residual risks (docs/reliability.md): a holder that stalls longer than ``STALE_SECONDS`` (a frozen VM,
a partition from the store) can be taken over while it is still alive; it finds out at its next
heartbeat (at most ``HEARTBEAT_SECONDS`` later) and stops, but writes it made in that window land
next to the new holder's (the manifest's per-attempt records keep them apart). A judge whose clock
runs ahead of the store's by more than ``STALE_SECONDS - HEARTBEAT_SECONDS`` would call a live lock
stale. A store without conditional writes (``memory://``, and every fsspec backend but s3fs here)
has no lock: the run is refused unless the job says ``output.lock: none``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from embedpipe.errors import OutputRefused, StorageError
from embedpipe.io.conditional import ConditionUnsupported, conditional_object
from embedpipe.io.fs import filesystem, is_url
from embedpipe.io.layout import LOCK, OutputLayout

LOCK_NAME = LOCK  # the layout's name of the lock file
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 600.0  # a lock not refreshed for this long belongs to a dead run
CLAIM_SECONDS = 60.0  # a takeover claim older than this was left by a run that died while taking over
ATTEMPTS = 200  # create / take-over rounds before giving up (another run is mid-takeover)
RETRY_SECONDS = 0.005


class OutputBusy(OutputRefused, RuntimeError):
    """Another live run holds the output path."""


class LockLost(OutputRefused, RuntimeError):
    """This run's lock was taken over by another run (or could not be refreshed): the run was stopped."""


class LockUnsupported(OutputRefused, RuntimeError):
    """The output's store cannot create an object only if it is absent: no run lock is possible there."""


class OutputLock:
    """Hold the run lock of ``output`` (a local path or a URL) for a ``with`` block.

    ``mode``: ``"auto"`` (the job's ``output.lock``) locks every output whose store can; ``"none"``
    takes no lock at all (the caller promises that one run at a time writes there)."""

    def __init__(self, output: str | Path, *, mode: str = "auto"):
        self._backend = None if mode == "none" else _backend_for(output)
        self.path = self._backend.path if self._backend else None
        self._stop = threading.Event()
        self._guard = threading.Lock()  # the heartbeat's verdict and whether the `with` body still runs
        self._inside = False
        self._lost: str | None = None
        self._signalled = False  # the heartbeat interrupted the main thread
        self._beat: threading.Thread | None = None

    def __enter__(self) -> "OutputLock":
        if self._backend is None:
            return self
        self._backend.acquire()
        self._inside = threading.current_thread() is threading.main_thread()  # else: LockLost at the exit only
        self._beat = threading.Thread(target=self._heartbeat, name="embedpipe-lock", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._backend is None:
            return
        try:
            with self._guard:
                self._inside = False
            self._stop.set()
            if self._beat is not None:
                self._beat.join(timeout=5)
            if self._lost is None:
                self._backend.release()
            elif self._signalled and not (exc_type and issubclass(exc_type, KeyboardInterrupt)):
                time.sleep(1.0)  # the heartbeat's SIGINT is on its way: take it here, not after the exit
        except KeyboardInterrupt:  # the heartbeat's own stop signal
            if self._lost is None:
                raise
        if self._lost is not None:
            raise LockLost(self._lost) from None

    def confirm(self) -> None:
        """Raise `LockLost` unless this run still holds the lock (checked at the store now): before a step that
        must never be taken by a run that lost its lock (moving CURRENT)."""
        if self._backend is None:
            return
        reason = self._lost or self._backend.lost()
        if reason is not None:
            self._lost = reason
            raise LockLost(reason)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            reason = self._backend.refresh()
            if reason is None:
                continue
            with self._guard:
                self._lost = reason
                if self._inside:
                    self._signalled = _stop_main_thread()
            return


def _stop_main_thread() -> bool:
    """Interrupt the run in the main thread (a real SIGINT there, so a blocking wait wakes up too); the
    `with` block's exit turns it into `LockLost`. Nothing when SIGINT is not handled by Python."""
    if not callable(signal.getsignal(signal.SIGINT)):
        return False
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    return True


def _backend_for(output: str | Path):
    """The lock of ``output``'s kind: a lock file (local paths, file:// URLs) or a lock object (s3://)."""
    url = OutputLayout(output).lock  # a Path, or a Url for URL roots
    if not is_url(str(url)):
        return _FileLock(url)
    url = str(url)
    fs, inner = filesystem(url)
    if isinstance(fs, LocalFileSystem):
        return _FileLock(Path(inner))
    store = conditional_object(url)
    if store is None:
        protocol = str(output).split("://", 1)[0]
        raise LockUnsupported(
            f"{output}: the run lock needs a store that creates an object only if it is absent, and {protocol}:// "
            f"({type(fs).__name__}) cannot: write to s3:// or a local path, or set output.lock: none and make sure "
            f"only one run writes to this output at a time")
    return _ObjectLock(store)


# ------------------------------------------------------------------------ shared rules

def _me(token: str) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "token": token}


def _stale(holder: dict | None, *, age: float) -> bool:
    """A lock is stale when unreadable, not refreshed for STALE_SECONDS, or held by a dead pid on this host."""
    if holder is None or age > STALE_SECONDS:
        return True
    if holder.get("host") == socket.gethostname():
        return not pid_alive(int(holder.get("pid", -1)))
    return False


def _busy(where: str, holder: dict) -> OutputBusy:
    return OutputBusy(
        f"{where} is being written by another run (host {holder.get('host')}, pid {holder.get('pid')}, started "
        f"{holder.get('started')}): wait for it to finish, or stop it; a lock left by a dead run is taken over "
        f"automatically")


def _taken(where: str, holder: dict | None) -> str:
    who = (f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}" if holder
           else "nobody holds it now")
    return (f"{where}: this run's lock was taken over by another run ({who}), after this run could not refresh it "
            f"for {STALE_SECONDS:g} s: it stopped so that two runs never write one output; finished units are kept, "
            f"rerun once the other run is done")


def _parse(text: str | bytes) -> dict | None:
    try:
        holder = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # half-written by an older embedpipe that died at once: stale
    return holder if isinstance(holder, dict) else None


def pid_alive(pid: int) -> bool:
    """Whether a process of this host with this pid is alive (one we may not signal is)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------ object stores

class _ObjectLock:
    """The lock object of an output on an object store (conditional writes: see the module docstring)."""

    def __init__(self, store):
        self._store = store
        self.path = store.url
        self._token = uuid.uuid4().hex
        self._me = _me(self._token)
        self._beats = 0
        self._tag: str | None = None  # the ETag of the version this run last wrote
        self._refreshed = time.monotonic()

    def _content(self) -> bytes:
        self._beats += 1  # every write differs, so every write has its own ETag
        now = datetime.now(timezone.utc).isoformat(timespec="microseconds")
        return json.dumps({**self._me, "heartbeat": now, "beats": self._beats}).encode()

    def acquire(self) -> None:
        for _ in range(ATTEMPTS):
            data = self._content()
            tag = self._store.create(data)
            if tag is None:
                seen = self._store.read()
                if seen is None:
                    continue  # released between our two requests: create again
                holder = _parse(seen.data)
                if (holder or {}).get("token") == self._token:
                    tag = seen.tag  # our create landed; its answer was lost and the retry found it
                elif not _stale(holder, age=time.time() - seen.modified):
                    raise _busy(str(self._store.url).rsplit("/", 1)[0], holder)
                else:
                    try:
                        tag = self._store.replace(data, tag=seen.tag)  # only if nobody wrote it since we judged it
                    except ConditionUnsupported:
                        raise OutputBusy(
                            f"{self.path}: a stale lock (host {(holder or {}).get('host')}, pid "
                            f"{(holder or {}).get('pid')}) is there and this store cannot replace an object "
                            f"conditionally (If-Match): check that run is gone, remove the object, rerun") from None
            if tag is not None:
                self._tag, self._refreshed = tag, time.monotonic()
                self._check_if_match()
                return
        raise OutputBusy(f"{self.path}: other runs kept taking over this stale lock at the same moment; try again")

    def _check_if_match(self) -> None:
        """The first heartbeat, at once: a store that creates conditionally but cannot replace conditionally
        (If-Match) could not keep the lock safe, so the run is refused here rather than half-locked."""
        try:
            reason = self.refresh()
        except ConditionUnsupported:
            self._store.delete(tag=self._tag)
            raise LockUnsupported(
                f"{self.path}: this store creates objects conditionally but cannot replace them conditionally "
                f"(If-Match), which the lock's heartbeat and takeover need: set output.lock: none and make sure "
                f"only one run writes to this output at a time") from None
        if reason is not None:
            raise OutputBusy(reason)

    def refresh(self) -> str | None:
        """Rewrite the lock with a fresh heartbeat; why it is lost, or None."""
        data = self._content()
        try:
            tag = self._store.replace(data, tag=self._tag)
            if tag is None:
                seen = self._store.read()
                if seen is not None and seen.data == data:
                    tag = seen.tag  # our write landed; its answer was lost and the retry failed the condition
                else:
                    return _taken(self.path, _parse(seen.data) if seen else None)
        except StorageError:  # the store is unreachable for now: try again at the next beat, until it is too late
            if time.monotonic() - self._refreshed > STALE_SECONDS - HEARTBEAT_SECONDS:
                return _taken(self.path, None)
            return None
        self._tag, self._refreshed = tag, time.monotonic()
        return None

    def lost(self) -> str | None:
        seen = self._store.read()
        if seen is not None and seen.tag == self._tag:
            return None
        return _taken(self.path, _parse(seen.data) if seen else None)

    def release(self) -> None:
        if self._tag is not None:
            self._store.delete(tag=self._tag)


# ------------------------------------------------------------------------ local files

@dataclass(frozen=True)
class _Seen:
    """One lock file as found: its identity (inode, mtime) and its content."""

    ino: int
    dev: int
    mtime_ns: int
    text: str

    @property
    def holder(self) -> dict | None:
        return _parse(self.text)


class _FileLock:
    """The lock file of a local (or mounted) output (hard links: see the module docstring)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._token = uuid.uuid4().hex  # names this lock's incarnation: "is it still mine?"

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = _me(self._token)
        for _ in range(ATTEMPTS):
            if self._create(me):
                return
            seen = _look(self.path)
            if seen is None:
                continue  # released or taken over between our two steps: try to create again
            holder = seen.holder
            if not _stale(holder, age=time.time() - seen.mtime_ns / 1e9):
                raise _busy(str(self.path.parent), holder)
            if not self._retire(seen):
                time.sleep(RETRY_SECONDS)  # another run is taking this stale lock over right now
        raise OutputBusy(f"{self.path}: another run kept taking over this stale lock at the same moment; "
                         f"try again (if no other run is starting, remove {self.path.name}.stale-* there)")

    def release(self) -> None:
        if self._mine():  # a lock taken over from us (our heartbeat went stale) is the new holder's
            self.path.unlink(missing_ok=True)

    def refresh(self) -> str | None:
        if not self._mine():
            seen = _look(self.path)
            return _taken(str(self.path), seen.holder if seen else None)
        try:
            os.utime(self.path)
        except FileNotFoundError:
            return _taken(str(self.path), None)
        return None

    def lost(self) -> str | None:
        if self._mine():
            return None
        seen = _look(self.path)
        return _taken(str(self.path), seen.holder if seen else None)

    def _create(self, me: dict) -> bool:
        """Write the lock whole under a unique name, link it into place; True if we hold it now."""
        tmp = self.path.with_name(f"{LOCK_NAME}.{self._token}.tmp")
        tmp.write_text(json.dumps(me))
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return self._mine()

    def _retire(self, seen: _Seen) -> bool:
        """Remove the stale lock ``seen`` if this run wins the claim on it; False when another run holds the claim."""
        tomb = self.path.with_name(f"{LOCK_NAME}.stale-{seen.ino}-{seen.mtime_ns}")
        try:
            os.link(self.path, tomb)  # whatever the lock is now, under a name only one run can create
        except FileNotFoundError:
            return True  # gone already
        except FileExistsError:
            _clear_abandoned(tomb, seen)
            return False
        try:
            if _look(tomb) == seen and _look(self.path) == seen:  # still the very file we judged stale
                self.path.unlink()
        finally:
            tomb.unlink(missing_ok=True)
        return True

    def _mine(self) -> bool:
        seen = _look(self.path)
        return seen is not None and (seen.holder or {}).get("token") == self._token


def _look(path: Path) -> _Seen | None:
    """The file at ``path`` (identity and content read together), or None when there is none."""
    try:
        before = os.stat(path)
        text = path.read_text()
        after = os.stat(path)
    except FileNotFoundError:
        return None
    if (before.st_ino, before.st_dev) != (after.st_ino, after.st_dev):
        return None  # replaced while we read it: look again
    return _Seen(ino=after.st_ino, dev=after.st_dev, mtime_ns=after.st_mtime_ns, text=text)


def _clear_abandoned(tomb: Path, seen: _Seen) -> None:
    """A claim (tombstone) older than CLAIM_SECONDS on the same stale lock: its run died mid-takeover."""
    try:
        claimed = os.stat(tomb).st_ctime  # linking the tombstone set the file's ctime
    except FileNotFoundError:
        return
    if time.time() - claimed > CLAIM_SECONDS and _look(tomb) == seen:
        tomb.unlink(missing_ok=True)
