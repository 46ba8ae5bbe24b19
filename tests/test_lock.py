import json
import os
import socket
import time

import pytest

from embedpipe.io.lock import LOCK_NAME, STALE_SECONDS, OutputBusy, OutputLock


def _plant(tmp_path, *, host, pid, age=0.0):
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "2026-11-29T00:00:00+00:00"}))
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_live_run_holds_the_path_and_names_itself(tmp_path):
    with OutputLock(tmp_path):
        with pytest.raises(OutputBusy, match=rf"host {socket.gethostname()}, pid {os.getpid()}, started"):
            OutputLock(tmp_path).__enter__()
    assert not (tmp_path / LOCK_NAME).exists()  # released


def test_lock_of_a_dead_local_process_is_taken_over(tmp_path):
    _plant(tmp_path, host=socket.gethostname(), pid=2**22 + 12345)  # no such pid
    with OutputLock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_other_host_lock_is_live_until_its_heartbeat_stops(tmp_path):
    _plant(tmp_path, host="other-node", pid=1)
    with pytest.raises(OutputBusy, match="other-node"):
        OutputLock(tmp_path).__enter__()
    _plant(tmp_path, host="other-node", pid=1, age=STALE_SECONDS + 60)
    with OutputLock(tmp_path):
        pass
