"""`ray job submit --address http://HEAD:DASHBOARD -- embedpipe run job.yaml` works unchanged: the job
file has no cluster.address, and the run joins the cluster it was submitted to (its worker actors are
the cluster's) instead of starting a second Ray of its own on the head node.

A loopback head with the dashboard (the job server) in its own process group and temp dir; stopped by
process group in a finally (`ray stop` would also stop every other Ray on the machine).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import requests

from embedpipe.cluster.connect import submitted_job_address
from tests.conftest import free_port, write_job
from tests.test_cluster_join import _stop_head

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture
def ray_head_with_jobs(tmp_path):
    """A Ray head on 127.0.0.1 with its job server: the dashboard's address (http://127.0.0.1:PORT)."""
    temp = tempfile.mkdtemp(prefix="ep_jobs_", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    home = tmp_path / "home"  # no ~/.ray/auth_token: `ray start` would turn token auth on by itself
    home.mkdir()
    dashboard = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env |= {"HOME": str(home), "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": str(ROOT)}  # the entrypoint and the workers run this checkout's embedpipe
    cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--port={free_port()}", "--node-ip-address=127.0.0.1",
           "--num-cpus=2", "--num-gpus=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
           f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
           f"--temp-dir={temp}", "--disable-usage-stats"]
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if requests.get(f"{address}/api/version", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            assert head.poll() is None, f"ray start exited: {(tmp_path / 'head.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no job server at {address}; see the dashboard log under {temp}"
            time.sleep(1)
        yield address, env
    finally:
        _stop_head(temp)  # the head's process group: GCS, raylet, dashboard, its workers and the job's driver
        head.wait(timeout=60)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


# Ray's job server answers this (HTTP 500) when the head's dashboard agent has not registered within its 10 s
# (ray.dashboard.consts.WAIT_AVAILABLE_AGENT_TIMEOUT); on two loaded cores the agent can come up after the job server
NO_AGENT_YET = "No available agent to submit job, please try again later"


def _submit(cmd: list[str], *, env: dict, cwd: Path, within_s: float = 120) -> subprocess.CompletedProcess:
    """`ray job submit`, submitted again while the head's job agent is still starting (no job is made then)."""
    deadline = time.monotonic() + within_s
    while True:
        submit = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env, cwd=cwd)
        if NO_AGENT_YET not in submit.stdout + submit.stderr or time.monotonic() > deadline:
            return submit
        time.sleep(2)


@pytest.mark.slow
def test_ray_job_submit_runs_the_job_on_the_cluster(tmp_path, ray_head_with_jobs, quickstart_table):
    address, env = ray_head_with_jobs
    table = quickstart_table.slice(0, 300).select(["id", "text"])
    pq.write_table(table, tmp_path / "corpus.parquet", row_group_size=100)
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "corpus.parquet"), "unit_rows": 100},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, batching={"max_tokens": 4096},
                    output={"path": str(out)}, cluster={"workers": 1, "cpus_per_worker": 1})  # no address

    submit = _submit([str(BIN / "ray"), "job", "submit", "--address", address, "--", "embedpipe", "run", str(job),
                      "--no-progress"], env=env, cwd=tmp_path)
    assert submit.returncode == 0 and "succeeded" in submit.stdout + submit.stderr, submit.stdout + submit.stderr

    ids = ds.dataset(out / "vectors", format="parquet").to_table()["id"].to_pylist()
    assert len(ids) == len(set(ids)) == table.num_rows and set(ids) == set(table["id"].to_pylist())
    actors = requests.get(f"{address}/api/v0/actors", timeout=30, params={
        "filter_keys": "class_name", "filter_predicates": "=", "filter_values": "EmbedWorker", "detail": "false"})
    workers = actors.json()["data"]["result"]["result"]
    assert len(workers) == 1, f"the run's worker was not the cluster's (an embedded Ray of its own?): {workers}"

    # a bad input fails the job: its one `error:` line is in the job's log, `ray job submit` exits non-zero
    (tmp_path / "broken.parquet").write_bytes(b"not a parquet file")
    bad = write_job(tmp_path / "bad.yaml", input={"path": str(tmp_path / "broken.parquet")},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, output={"path": str(tmp_path / "bad")})
    failed = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", address, "--",
                             "embedpipe", "run", str(bad), "--no-progress"],
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    said = failed.stdout + failed.stderr
    errors = {line for line in said.splitlines() if line.startswith("error: ")}  # the log is shown twice
    assert failed.returncode != 0 and "failed with exit code 3" in said and "Traceback" not in said, said
    assert len(errors) == 1 and "broken.parquet" in errors.pop(), said


@pytest.mark.parametrize("env, address", [
    ({"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}", "RAY_ADDRESS": "10.0.0.1:6379"}, "auto"),  # a Ray job's entrypoint
    ({"RAY_ADDRESS": "10.0.0.1:6379"}, ""),  # a shell with RAY_ADDRESS: still an embedded local Ray
    ({}, ""),
])
def test_only_a_ray_job_entrypoint_joins_by_default(monkeypatch, env, address):
    for name in ("RAY_JOB_CONFIG_JSON_ENV_VAR", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert submitted_job_address() == address
