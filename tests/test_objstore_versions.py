"""Versioned incremental outputs on an object store (moto's real S3 API): CURRENT is a small object moved only
after validation; a night killed before its promotion leaves CURRENT on the previous version, and the rerun
resumes that night's version and promotes it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.io.fs import filesystem, join
from tests.conftest import write_job

pytestmark = pytest.mark.slow
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _fs(url: str):
    fs, inner = filesystem(url)
    fs.invalidate_cache()
    return fs, inner


def _current(root: str) -> str:
    fs, inner = _fs(root)
    return fs.cat_file(f"{inner}/CURRENT").decode().strip()


def _versions(root: str) -> set[str]:
    fs, inner = _fs(root)
    return {p.rsplit("/", 1)[1] for p in fs.ls(f"{inner}/versions", detail=False)}


def _validated(root: str, version: str) -> bool:
    fs, inner = _fs(root)
    return fs.isfile(f"{inner}/versions/{version}/VALIDATED")


def _records(root: str, version: str) -> int:
    fs, inner = _fs(root)
    try:
        return sum(1 for p in fs.ls(f"{inner}/versions/{version}/_manifest/units", detail=False)
                   if p.endswith(".json"))
    except FileNotFoundError:
        return 0


def _report(root: str, version: str) -> dict:
    fs, inner = _fs(root)
    return json.loads(fs.cat_file(f"{inner}/versions/{version}/report.json"))


def test_a_night_killed_before_promotion_leaves_current_and_the_rerun_promotes(
        tmp_path, quickstart_table, ray_session, s3_bucket, s3_options):
    data, root = tmp_path / "corpus.parquet", join(s3_bucket, "index")
    pq.write_table(quickstart_table.slice(0, 60).select(["id", "text"]), data, row_group_size=20)

    def job(address: str = "") -> Path:
        return write_job(tmp_path / f"nightly{'-sub' if address else ''}.yaml",
                         input={"path": str(data), "unit_rows": 20},
                         # dtype pinned: night 2 joins the session's Ray by address, where `auto` is the
                         # workers' to decide, and the rerun is embedded; both must be the same job
                         model={"path": MODEL, "max_seq_len": 64, "dtype": "float32"}, batching={"max_tokens": 2048},
                         output={"path": root, "storage_options": s3_options, "versioned": True,
                                 "incremental": True, "keep_versions": 2},
                         cluster={"workers": 1, "cpus_per_worker": 1, "address": address})

    first = CliRunner().invoke(app, ["run", str(job()), "--no-progress"])
    assert first.exit_code == 0, first.output
    night1 = _current(root)
    assert _validated(root, night1) and _report(root, night1)["rows"] == 60

    # Night 2 grows the corpus and is killed (SIGKILL, on the session's Ray) once two of its units are recorded.
    pq.write_table(quickstart_table.slice(0, 200).select(["id", "text"]), data, row_group_size=20)
    address = ray_session.get_runtime_context().gcs_address
    cmd = [str(Path(sys.executable).parent / "embedpipe"), "run", str(job(address)), "--no-progress"]
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 240
    while not (_versions(root) - {night1}) or _records(root, max(_versions(root) - {night1})) < 2:
        assert driver.poll() is None, f"night 2 ended before it could be killed: {driver.stderr.read()[-2000:]}"
        assert time.time() < deadline, "night 2 made no progress"
        time.sleep(0.1)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    [night2] = _versions(root) - {night1}
    assert _current(root) == night1 and not _validated(root, night2)

    # The rerun takes over the dead run's lock, resumes night 2's version and promotes it.
    resumed = CliRunner().invoke(app, ["run", str(job()), "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
    assert _current(root) == night2 and _validated(root, night2)
    report = _report(root, night2)
    assert report["rows"] == 200 and report["units"]["skipped_as_done"] >= 2
    # every row of night 1 reused, read through its manifest's parts on S3; only the new rows encoded
    assert report["incremental"]["reused"] == 60 and report["incremental"]["encoded"] == 140
    fs, inner = _fs(root)
    assert not fs.exists(f"{inner}/.embedpipe.lock")  # released


def test_prune_on_s3_lists_versions_and_never_removes_current(s3_bucket):
    from embedpipe.versions import choose_version, current_version, prune

    root = join(s3_bucket, "index")
    fs, inner = _fs(root)
    names = ("20260101T000000Z", "20260102T000000Z", "20260103T000000Z")
    for name in names:
        fs.pipe_file(f"{inner}/versions/{name}/VALIDATED", b"")
        fs.pipe_file(f"{inner}/versions/{name}/.embedpipe-output", b"{}")
    fs.pipe_file(f"{inner}/versions/20260104T000000Z/_manifest/job.json", json.dumps({"sha256": "abc"}).encode())
    fs.pipe_file(f"{inner}/CURRENT", b"20260101T000000Z\n")  # rolled back to the oldest
    assert current_version(root) == "20260101T000000Z"
    assert choose_version(root, {"sha256": "abc"}) == "20260104T000000Z"  # the unfinished one of this job resumes
    assert prune(root, keep=1) == ["20260102T000000Z"]
    assert _versions(root) == {"20260101T000000Z", "20260103T000000Z", "20260104T000000Z"}
