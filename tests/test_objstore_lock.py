"""The run lock on an object store (moto's real S3 API on loopback): conditional create, heartbeat,
stale takeover by If-Match, a lost lock stopping the run, and stores without conditional writes refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest

from embedpipe.io import lock as lock_mod
from embedpipe.io.fs import filesystem, join
from embedpipe.io.lock import LOCK_NAME, LockLost, LockUnsupported, OutputBusy, OutputLock

DEAD_PID = 2**22 + 12345  # no such pid on this host


def _lock_url(bucket: str) -> str:
    return join(bucket, "out", LOCK_NAME)


def _read(url: str) -> dict | None:
    fs, inner = filesystem(url)
    fs.invalidate_cache()
    return json.loads(fs.cat_file(inner)) if fs.exists(inner) else None


def _plant(url: str, *, host: str, pid: int) -> None:
    fs, inner = filesystem(url)
    fs.pipe_file(inner, json.dumps({"host": host, "pid": pid, "started": "2026-11-29T00:00:00+00:00",
                                    "token": "planted"}).encode())


def test_a_second_run_on_the_same_s3_output_is_refused_naming_the_holder(s3_bucket):
    out = join(s3_bucket, "out")
    with OutputLock(out):
        held = _read(_lock_url(s3_bucket))
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
        with pytest.raises(OutputBusy, match=rf"{out} is being written by another run \(host "
                                             rf"{socket.gethostname()}, pid {os.getpid()}, started"):
            OutputLock(out).__enter__()
    assert _read(_lock_url(s3_bucket)) is None  # released


def test_a_lock_of_a_dead_run_on_this_host_is_taken_over(s3_bucket):
    _plant(_lock_url(s3_bucket), host=socket.gethostname(), pid=DEAD_PID)
    with OutputLock(join(s3_bucket, "out")):
        assert _read(_lock_url(s3_bucket))["pid"] == os.getpid()


def test_another_hosts_lock_is_live_until_its_heartbeat_is_older_than_stale_seconds(s3_bucket, monkeypatch):
    _plant(_lock_url(s3_bucket), host="other-node", pid=1)
    with pytest.raises(OutputBusy, match="other-node"):
        OutputLock(join(s3_bucket, "out")).__enter__()
    monkeypatch.setattr(lock_mod, "STALE_SECONDS", 1.0)
    time.sleep(2.2)  # the store's LastModified has one-second steps
    with OutputLock(join(s3_bucket, "out")):
        assert _read(_lock_url(s3_bucket))["pid"] == os.getpid()


def test_the_heartbeat_rewrites_the_lock_object(s3_bucket, monkeypatch):
    monkeypatch.setattr(lock_mod, "HEARTBEAT_SECONDS", 0.1)
    with OutputLock(join(s3_bucket, "out")):
        first = _read(_lock_url(s3_bucket))
        time.sleep(0.8)
        later = _read(_lock_url(s3_bucket))
    assert later["token"] == first["token"] and later["beats"] >= first["beats"] + 3
    assert later["heartbeat"] > first["heartbeat"]


TAKERS, TRIALS = 6, 8


def test_runs_judging_the_same_stale_lock_together_end_with_exactly_one_holder(s3_bucket):
    wins = [0] * TRIALS
    start, done = threading.Barrier(TAKERS), threading.Barrier(TAKERS)

    def taker() -> None:
        for t in range(TRIALS):
            lock = OutputLock(join(s3_bucket, f"t{t}"))
            start.wait(timeout=60)
            try:
                lock.__enter__()
            except OutputBusy:  # the winner is this very pid, alive: busy for everyone else
                lock = None
            else:
                wins[t] += 1
            done.wait(timeout=60)  # everyone tried while the winner still holds it
            if lock is not None:
                lock.__exit__(None, None, None)

    for t in range(TRIALS):
        _plant(join(s3_bucket, f"t{t}", LOCK_NAME), host=socket.gethostname(), pid=DEAD_PID)
    threads = [threading.Thread(target=taker) for _ in range(TAKERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert wins == [1] * TRIALS, f"holders per trial: {wins}"
    fs, inner = filesystem(s3_bucket)
    fs.invalidate_cache()
    assert not fs.find(inner), "a lock object was left behind"


def test_a_run_whose_lock_was_taken_over_stops_at_its_next_heartbeat(s3_bucket, monkeypatch):
    monkeypatch.setattr(lock_mod, "HEARTBEAT_SECONDS", 0.1)
    # SIGINT handled by Python, as in a run (run_job's handler): a process started in the background by a
    # non-interactive shell inherits SIGINT ignored, and the heartbeat then cannot interrupt this bare lock's body
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    began = time.monotonic()
    try:
        with pytest.raises(LockLost, match=r"taken over by another run \(host other-node, pid 7"):
            with OutputLock(join(s3_bucket, "out")):
                _plant(_lock_url(s3_bucket), host="other-node", pid=7)  # another run took it over
                time.sleep(10)  # the run's work: interrupted by the heartbeat
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - began < 5
    assert _read(_lock_url(s3_bucket))["host"] == "other-node"  # the new holder's lock is left alone


def test_confirm_checks_the_store_before_a_step_a_lost_run_must_not_take(s3_bucket):
    lock = OutputLock(join(s3_bucket, "out")).__enter__()
    lock.confirm()
    _plant(_lock_url(s3_bucket), host="other-node", pid=7)
    with pytest.raises(LockLost, match="other-node"):
        lock.confirm()
    with pytest.raises(LockLost):
        lock.__exit__(None, None, None)
    assert _read(_lock_url(s3_bucket))["host"] == "other-node"


def test_a_store_without_conditional_create_is_refused_unless_the_job_opts_out():
    with pytest.raises(LockUnsupported, match=r"memory://objlock-test/out: the run lock needs .* set output.lock: none"):
        OutputLock("memory://objlock-test/out").__enter__()
    with OutputLock("memory://objlock-test/out", mode="none"):
        pass
    fs, inner = filesystem("memory://objlock-test")
    assert not fs.exists(inner + "/out/" + LOCK_NAME)


def _cli_job(tmp_path, corpus, out: str, **output) -> str:
    from tests.conftest import write_job

    return str(write_job(tmp_path / "job.yaml", input={"path": str(corpus)},
                         model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                         output={"path": out, **output}, cluster={"workers": 1}))


def test_the_cli_refuses_a_run_on_an_s3_output_held_by_another_with_exit_5(tmp_path, small_corpus, s3_bucket,
                                                                            s3_options):
    from typer.testing import CliRunner

    from embedpipe.cli import app

    out = join(s3_bucket, "out")
    with OutputLock(out):  # this live process holds it
        result = CliRunner().invoke(app, ["run", _cli_job(tmp_path, small_corpus[1], out, storage_options=s3_options),
                                          "--no-progress"])
    assert result.exit_code == 5, result.output
    assert f"{out} is being written by another run (host {socket.gethostname()}, pid {os.getpid()}" in result.output


def test_the_cli_refuses_a_store_without_conditional_create_with_exit_5(tmp_path, small_corpus):
    from typer.testing import CliRunner

    from embedpipe.cli import app

    result = CliRunner().invoke(app, ["run", _cli_job(tmp_path, small_corpus[1], "memory://objlock-cli/out"),
                                      "--no-progress"])
    assert result.exit_code == 5, result.output
    assert "cannot: write to s3:// or a local path, or set output.lock: none" in " ".join(result.output.split())
