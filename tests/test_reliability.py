"""Reliability on a real local Ray: worker and driver deaths, resume, bad rows under each policy."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.cluster.driver import run_job
from embedpipe.config import load_job
from embedpipe.runtime import Encoder
from tests.conftest import split_corpus, write_job

pytestmark = pytest.mark.slow
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def encoder():
    return Encoder.from_options(MODEL)


def _output(path: Path) -> tuple[list, np.ndarray]:
    table = ds.dataset(path / "vectors", format="parquet").to_table()
    return table["id"].to_pylist(), np.asarray(table["embedding"].to_pylist(), dtype=np.float32)


def _assert_exact(out: Path, table: pa.Table, encoder: Encoder) -> None:
    """Every input id exactly once, each with the vector of its own text."""
    ids, got = _output(out)
    assert len(ids) == len(set(ids)) == table.num_rows and set(ids) == set(table["id"].to_pylist())
    texts = dict(zip(table["id"].to_pylist(), table["text"].to_pylist()))
    np.testing.assert_allclose(got, encoder.embed([texts[i] for i in ids]), atol=2e-6)


def _records(out: Path) -> int:
    return len(list((out / "_manifest" / "units").glob("*.json")))


def _job(tmp_path, folder, **over):
    sections = {"input": {"path": str(folder), "unit_rows": 30}, "model": {"path": MODEL},
                "batching": {"max_tokens": 2048}, "output": {"path": str(tmp_path / "out")},
                "cluster": {"workers": 2, "cpus_per_worker": 1}}
    for key, value in over.items():
        sections[key] = {**sections.get(key, {}), **value}
    return write_job(tmp_path / "job.yaml", **sections)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, quickstart_table):
    table = quickstart_table.slice(0, 600).select(["id", "text"])
    folder = tmp_path_factory.mktemp("rel_corpus")
    split_corpus(table, folder, files=2, row_group_size=30)  # 20 units of 30 rows
    return table, folder


def _busy_worker_pids() -> list[int]:
    """This test session's worker actors encoding a unit now: descendants of this process (its local Ray), never
    another session's workers on a shared machine. Ray titles an actor's process after the method it runs:
    ``ray::EmbedWorker.process`` while it encodes, ``ray::EmbedWorker.__init__`` while it starts."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::EmbedWorker.process")
                    and _descends_from_us(int(proc.name))):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _busy_workers(*, deadline: float, running: Callable[[], bool]) -> list[int]:
    """The worker actors encoding a unit now, waited for until ``deadline`` while ``running()`` (the run's thread is
    alive): a signal to one of them lands mid-unit. A worker still starting (its actor's ``__init__``) would be a
    failed start to replace, with no unit to retry."""
    while not (busy := _busy_worker_pids()) and time.time() < deadline and running():
        time.sleep(0.01)
    return busy


def _descends_from_us(pid: int) -> bool:
    while pid > 1:
        if pid == os.getpid():
            return True
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after "(comm) state" is the parent pid
    return False


def _run_and_signal_a_worker(job, out: Path, signum: int, *, records=None, after: int = 2,
                             units: int = 20) -> tuple[threading.Thread, dict, int]:
    """Start ``job`` on a thread, wait until it is mid-run (``after`` of its ``units`` units done), send ``signum`` to
    one worker; returns the thread, the dict its result lands in, and the worker's pid. ``records``: how the
    finished units are counted (default: the unit records under ``out``; an object store's own listing)."""
    records = records or (lambda: _records(out))
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(result=run_job(job, progress=False)), daemon=True)
    runner.start()
    deadline = time.time() + 300
    while records() < after and time.time() < deadline and runner.is_alive():
        time.sleep(0.05)
    victims = _busy_workers(deadline=deadline, running=runner.is_alive)
    assert victims and records() < units, "the signal must land mid-run, on a worker encoding a unit"
    os.kill(victims[0], signum)
    return runner, outcome, victims[0]


def test_sigkill_a_worker_mid_run(tmp_path, corpus, ray_session, encoder):
    table, folder = corpus
    runner, outcome, _ = _run_and_signal_a_worker(load_job(_job(tmp_path, folder)), tmp_path / "out", signal.SIGKILL)
    runner.join(timeout=600)
    report = outcome["result"].report
    assert report["units"]["retried"] >= 1 and report["units"]["failed"] == 0
    assert report["units"]["encoded"] == report["units"]["total"] == 20
    _assert_exact(tmp_path / "out", table, encoder)


def test_kill_the_driver_then_rerun_resumes(tmp_path, corpus, ray_session, encoder):
    table, folder = corpus
    job = _job(tmp_path, folder)
    cmd = [str(Path(sys.executable).parent / "embedpipe"), "run", str(job), "--no-progress"]
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while _records(tmp_path / "out") < 3 and time.time() < deadline and driver.poll() is None:
        time.sleep(0.05)
    assert driver.poll() is None, "the driver finished before it could be killed"
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    time.sleep(2)  # its local Ray shares its fate
    done_before = _records(tmp_path / "out")
    assert 3 <= done_before < 20

    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])  # the same command again
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["units"]["skipped_as_done"] >= done_before and report["units"]["encoded"] < 20
    assert report["units"]["skipped_as_done"] + report["units"]["encoded"] == 20
    assert report["rows"] == table.num_rows  # totals cover the whole output, resumed units included
    assert not [p for p in (tmp_path / "out" / "vectors").iterdir() if p.name.startswith(".")]
    _assert_exact(tmp_path / "out", table, encoder)

    again = CliRunner().invoke(app, ["run", str(job), "--no-progress"])  # nothing left to do
    assert again.exit_code == 0 and "20 already done, 0 encoded" in again.output
    other = CliRunner().invoke(app, ["run", str(job), "--no-progress", "--set", "model.max_seq_len=64"])
    assert other.exit_code == 2 and "--overwrite" in other.output


@pytest.fixture(scope="module")
def bad_corpus(tmp_path_factory, quickstart_table):
    """A string-text file and a binary-text file, each with bad rows among good ones."""
    folder = tmp_path_factory.mktemp("bad_rows")
    good = quickstart_table.slice(0, 50)
    texts = good["text"].to_pylist()
    strings = pa.table({"id": [f"s{i}" for i in range(33)],
                        "text": texts[:30] + [None, "", "  \n\t"]})
    binary = pa.table({"id": [f"b{i}" for i in range(22)],
                       "text": pa.array([t.encode() for t in texts[30:50]] + [b"\xff\xfe\xfd", None], pa.binary())})
    pq.write_table(strings, folder / "a.parquet", row_group_size=20)
    pq.write_table(binary, folder / "b.parquet", row_group_size=20)
    bad = {"s30": "null", "s31": "empty", "s32": "empty", "b20": "undecodable", "b21": "null"}
    texts_by_id = {**dict(zip(strings["id"].to_pylist(), strings["text"].to_pylist())),
                   **{f"b{i}": t for i, t in enumerate(texts[30:50])}, "b20": None, "b21": None}
    return folder, bad, texts_by_id


@pytest.mark.parametrize("policy", ["skip", "embed_empty", "error"])
def test_bad_rows_under_each_policy(tmp_path, bad_corpus, ray_session, encoder, policy):
    folder, bad, texts = bad_corpus
    job = _job(tmp_path, folder, input={"on_bad_row": policy, "unit_rows": 20}, cluster={"workers": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    out = tmp_path / "out"
    if policy == "error":
        assert result.exit_code == 3
        assert "has a bad text" in result.output and "input.on_bad_row" in result.output
        return
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["bad_rows"] == {"empty": 2, "null": 2, "undecodable": 1}
    ids, got = _output(out)
    good = [i for i in texts if i not in bad]
    if policy == "skip":
        assert sorted(ids) == sorted(good)
        skipped = pq.read_table(out / "skipped.parquet").to_pylist()
        assert {r["id"]: r["reason"] for r in skipped} == bad and len(skipped) == len(bad)
        assert report["skipped_rows"] == 5 and report["rows"] == len(good)
    else:
        assert sorted(ids) == sorted(texts) and not (out / "skipped.parquet").exists()
        assert report["skipped_rows"] == 0 and report["rows"] == len(texts)
    want = encoder.embed([texts[i] if i not in bad else "" for i in ids])
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_duplicate_ids_keep_first_end_to_end(tmp_path, ray_session, encoder, quickstart_table):
    rows = quickstart_table.slice(0, 40).select(["id", "text"])
    dup = rows.slice(0, 5).set_column(1, "text", pa.array([f"another text {i}" for i in range(5)]))
    pq.write_table(pa.concat_tables([rows, dup]), tmp_path / "d.parquet", row_group_size=15)
    job = _job(tmp_path, tmp_path / "d.parquet", input={"on_duplicate_id": "keep_first"}, cluster={"workers": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    _assert_exact(tmp_path / "out", rows, encoder)  # the first occurrence's text, never the copy's
    skipped = pq.read_table(tmp_path / "out" / "skipped.parquet").to_pylist()
    assert skipped == [{"id": i, "reason": "duplicate_id"} for i in rows["id"].to_pylist()[:5]]
