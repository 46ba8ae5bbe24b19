"""Joining an existing cluster: a Ray head started with `ray start --head` on loopback."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import QUICKSTART, write_job

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TOKEN = "0123456789abcdef" * 4  # this head's own auth token, independent of ~/.ray/auth_token


@pytest.fixture
def ray_head():
    port, temp = _free_port(), f"/tmp/ep_head_{os.getpid()}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
    cmd = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
           "--num-cpus=2", "--include-dashboard=false", f"--ray-client-server-port={_free_port()}",
           f"--temp-dir={temp}", "--disable-usage-stats"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120, start_new_session=True, env=env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        _stop_head(temp)


def _stop_head(temp: str) -> None:
    """Stop only this head's processes (`ray stop` would also stop the test session's Ray)."""
    groups = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and temp in (proc / "cmdline").read_bytes().decode(errors="ignore"):
                groups.add(os.getpgid(int(proc.name)))
        except (OSError, ProcessLookupError):
            continue
    groups.discard(os.getpgrp())  # the head runs in its own session; never signal ours
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass
        time.sleep(1)


def test_run_joins_an_existing_cluster(tmp_path, ray_head, quickstart_table):
    job = write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART), "unit_rows": 1000},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                    output={"path": str(tmp_path / "out")},
                    cluster={"address": "auto", "workers": 1})
    # No RAY_AUTH_MODE: embedpipe must send the machine's token by itself, as a user's shell would.
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {"RAY_AUTH_TOKEN": TOKEN}
    run = subprocess.run([str(BIN / "embedpipe"), "run", str(job), "--set", f"cluster.address={ray_head}",
                          "--no-progress"], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["rows"] == quickstart_table.num_rows and report["workers"] == 1
    assert "3,000 rows" in run.stdout
