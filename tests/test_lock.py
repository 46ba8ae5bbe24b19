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


TAKERS, TRIALS = 6, 50


def _taker(root: str, trials: int, start, done, wins) -> None:
    """One process: per trial, wait for the others, try the stale lock once, hold it until all have tried."""
    from pathlib import Path

    for t in range(trials):
        lock = OutputLock(Path(root) / f"t{t:02d}")
        start.wait(timeout=60)
        try:
            lock.__enter__()
        except OutputBusy:
            lock = None
        else:
            with wins.get_lock():
                wins[t] += 1
        done.wait(timeout=60)  # every taker has tried while the winner still holds the lock
        if lock is not None:
            lock.__exit__(None, None, None)


def test_concurrent_takeover_of_a_stale_lock_has_exactly_one_winner(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may run Ray threads
    for t in range(TRIALS):
        (tmp_path / f"t{t:02d}").mkdir()
        _plant(tmp_path / f"t{t:02d}", host=socket.gethostname(), pid=2**22 + 12345)  # a dead local run
    start, done = ctx.Barrier(TAKERS), ctx.Barrier(TAKERS)
    wins = ctx.Array("i", TRIALS)
    procs = [ctx.Process(target=_taker, args=(str(tmp_path), TRIALS, start, done, wins)) for _ in range(TAKERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert list(wins) == [1] * TRIALS, f"holders per trial: {list(wins)}"
    assert not list(tmp_path.glob("t*/*")), "a lock or a temporary file was left behind"


def test_a_takeover_interrupted_by_a_dead_run_is_finished_by_the_next(tmp_path, monkeypatch):
    import embedpipe.io.lock as lock

    path = _plant(tmp_path, host=socket.gethostname(), pid=2**22 + 12345)
    st = os.stat(path)
    os.link(path, tmp_path / f"{LOCK_NAME}.stale-{st.st_ino}-{st.st_mtime_ns}")  # its claimer died right there
    monkeypatch.setattr(lock, "CLAIM_SECONDS", 0.0)
    with OutputLock(tmp_path):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not list(tmp_path.iterdir())


def test_a_run_whose_lock_was_taken_over_leaves_the_new_holders_lock(tmp_path):
    first = OutputLock(tmp_path).__enter__()
    (tmp_path / LOCK_NAME).unlink()  # as a takeover after a stalled heartbeat does
    with OutputLock(tmp_path):
        first.__exit__(None, None, None)
        assert (tmp_path / LOCK_NAME).exists()
