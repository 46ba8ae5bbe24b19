"""One live run per output path: a lock file naming host, pid and start time, kept fresh by a heartbeat.

Schedulers overlap runs (a slow night, a manual rerun): the second run on a held output path
fails at once with the holder's name. A lock left by a dead run is taken over: on the same host
when its pid is gone, from any host when its heartbeat is older than ``STALE_SECONDS``.

Every step is atomic, so runs starting together on a stale lock end with exactly one holder:

- create: the lock is written whole to a unique temporary file, then hard-linked to its name
  (``os.link`` fails when the name exists), then read back to confirm this run holds it;
- take over: a stale lock is first claimed by hard-linking it to a tombstone named after that
  one file (inode, mtime); the link fails for every run but one. The claimer checks that the
  tombstone still is the file it judged stale (inode, mtime and content), removes the lock only
  then, and creates its own like everyone else.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from embedpipe.errors import OutputRefused
from embedpipe.io.layout import LOCK, OutputLayout

LOCK_NAME = LOCK  # the layout's name of the lock file
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 600.0  # a lock not refreshed for this long belongs to a dead run
CLAIM_SECONDS = 60.0  # a takeover claim older than this was left by a run that died while taking over
ATTEMPTS = 200  # create / take-over rounds before giving up (another run is mid-takeover)
RETRY_SECONDS = 0.005


class OutputBusy(OutputRefused, RuntimeError):
    """Another live run holds the output path."""


@dataclass(frozen=True)
class _Seen:
    """One lock file as found: its identity (inode, mtime) and its content."""

    ino: int
    dev: int
    mtime_ns: int
    text: str

    @property
    def holder(self) -> dict | None:
        try:
            holder = json.loads(self.text)
        except json.JSONDecodeError:
            return None  # half-written by an older embedpipe that died at once: stale
        return holder if isinstance(holder, dict) else None


class OutputLock:
    def __init__(self, output: str | Path):
        self.path = OutputLayout(output).lock
        self._token = uuid.uuid4().hex  # names this lock's incarnation: "is it still mine?"
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> "OutputLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "token": self._token}
        for _ in range(ATTEMPTS):
            if self._create(me):
                break
            seen = _look(self.path)
            if seen is None:
                continue  # released or taken over between our two steps: try to create again
            holder = seen.holder
            if holder is not None and not _stale(holder, seen):
                raise OutputBusy(
                    f"{self.path.parent} is being written by another run (host {holder.get('host')}, pid "
                    f"{holder.get('pid')}, started {holder.get('started')}): wait for it to finish, or stop "
                    f"it; a lock left by a dead run is taken over automatically")
            if not self._retire(seen):
                time.sleep(RETRY_SECONDS)  # another run is taking this stale lock over right now
        else:
            raise OutputBusy(f"{self.path}: another run kept taking over this stale lock at the same moment; "
                             f"try again (if no other run is starting, remove {self.path.name}.stale-* there)")
        self._beat = threading.Thread(target=self._heartbeat, name="embedpipe-lock", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        if self._mine():  # a lock taken over from us (our heartbeat went stale) is the new holder's
            self.path.unlink(missing_ok=True)

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

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            if not self._mine():
                return  # released, or taken over after a stall: never refresh another run's lock
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return


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


def _stale(holder: dict, seen: _Seen) -> bool:
    if time.time() - seen.mtime_ns / 1e9 > STALE_SECONDS:
        return True
    if holder.get("host") == socket.gethostname():
        return not _pid_alive(int(holder.get("pid", -1)))
    return False


def _clear_abandoned(tomb: Path, seen: _Seen) -> None:
    """A claim (tombstone) older than CLAIM_SECONDS on the same stale lock: its run died mid-takeover."""
    try:
        claimed = os.stat(tomb).st_ctime  # linking the tombstone set the file's ctime
    except FileNotFoundError:
        return
    if time.time() - claimed > CLAIM_SECONDS and _look(tomb) == seen:
        tomb.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
