"""One live run per output path: a lock file naming host, pid and start time, kept fresh by a heartbeat.

Schedulers overlap runs (a slow night, a manual rerun): the second run on a held output path
fails at once with the holder's name. A lock left by a dead run is taken over: on the same host
when its pid is gone, from any host when its heartbeat is older than ``STALE_SECONDS``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

LOCK_NAME = ".embedpipe.lock"
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 600.0  # a lock not refreshed for this long belongs to a dead run


class OutputBusy(RuntimeError):
    """Another live run holds the output path."""


class OutputLock:
    def __init__(self, output: str | Path):
        self.path = Path(output) / LOCK_NAME
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> "OutputLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not self._stale(holder):
                    raise OutputBusy(
                        f"{self.path.parent} is being written by another run (host {holder.get('host')}, pid "
                        f"{holder.get('pid')}, started {holder.get('started')}): wait for it to finish, or stop "
                        f"it; a lock left by a dead run is taken over automatically") from None
                self.path.unlink(missing_ok=True)  # stale: take it over
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            break
        else:  # pragma: no cover - lost a race twice
            raise OutputBusy(f"{self.path.parent}: another run took the lock at the same moment; try again")
        self._beat = threading.Thread(target=self._heartbeat, name="embedpipe-lock", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        self.path.unlink(missing_ok=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None  # vanished, or half-written by a run that died at once: stale

    def _stale(self, holder: dict) -> bool:
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return True
        if age > STALE_SECONDS:
            return True
        if holder.get("host") == socket.gethostname():
            return not _pid_alive(int(holder.get("pid", -1)))
        return False


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
