"""Joining an existing cluster: a Ray head started with `ray start --head` on loopback."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port, write_job

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


TOKEN = "0123456789abcdef" * 4  # this head's own auth token, independent of ~/.ray/auth_token


@pytest.fixture(scope="module")
def ray_head():
    """One token-auth head for the module: a refused join changes nothing on it."""
    port, temp = free_port(), f"/tmp/ep_head_{os.getpid()}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
    cmd = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
           "--num-cpus=2", "--include-dashboard=false", f"--dashboard-port={free_port()}",
           f"--ray-client-server-port={free_port()}", f"--temp-dir={temp}", "--disable-usage-stats"]
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


JOIN = """
import os, sys
import ray
from embedpipe.cluster.connect import connect
from embedpipe.config import ClusterConfig

@ray.remote(num_cpus=1)
class Echo:
    def ping(self):
        return "pong"

connect(ClusterConfig(address=sys.argv[1]))
print(ray.get(Echo.remote().ping.remote(), timeout=60))
"""


@pytest.fixture(scope="module")
def plain_head(tmp_path_factory):
    """A head without token auth, on a machine whose user has a Ray token (~/.ray/auth_token)."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(TOKEN)
    port, temp = free_port(), f"/tmp/ep_plain_head_{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env |= {"HOME": str(home), "RAY_AUTH_MODE": "disabled"}  # `ray start` would turn token auth on by itself
    cmd = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
           "--num-cpus=1", "--include-dashboard=false", f"--dashboard-port={free_port()}",
           f"--ray-client-server-port={free_port()}", f"--temp-dir={temp}", "--disable-usage-stats"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120, start_new_session=True, env=env)
        yield f"127.0.0.1:{port}", home
    finally:
        _stop_head(temp)


@pytest.mark.parametrize("how", ["address", "auto"])
def test_join_a_cluster_without_token_auth_while_a_token_exists(plain_head, how):
    address, home = plain_head
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env |= {"HOME": str(home), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if how == "auto":  # `address: auto` finds the head through RAY_ADDRESS, as on a cluster node
        env["RAY_ADDRESS"] = address
    run = subprocess.run([sys.executable, "-c", JOIN, address if how == "address" else "auto"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("pong"), run.stdout + run.stderr[-3000:]


def test_join_a_token_cluster_without_a_token_names_the_fix(tmp_path, ray_head):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env |= {"HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # no ~/.ray/auth_token
    run = subprocess.run([sys.executable, "-c", JOIN, ray_head], capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode != 0 and "requires token auth and this machine has no Ray token" in run.stderr, run.stderr


def test_run_joins_an_existing_cluster(tmp_path, ray_head, small_corpus):
    table, corpus = small_corpus  # 300 rows: joining is what is tested, not the encode
    job = write_job(tmp_path / "job.yaml", input={"path": str(corpus), "unit_rows": 100},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                    output={"path": str(tmp_path / "out")},
                    cluster={"address": "auto", "workers": 1})
    # No RAY_AUTH_MODE: embedpipe must send the machine's token by itself, as a user's shell would.
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {"RAY_AUTH_TOKEN": TOKEN}
    run = subprocess.run([str(BIN / "embedpipe"), "run", str(job), "--set", f"cluster.address={ray_head}",
                          "--no-progress"], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["rows"] == table.num_rows and report["workers"] == 1
    assert "300 rows" in run.stdout
