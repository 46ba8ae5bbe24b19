"""Ray started on a thread while the driver resolves the model (embedpipe/cluster/connect.py: start_early): the
next connect takes it over, Ray answers from the main thread long after the start (its processes die with the
thread that started them, so the thread is kept), shutdown ends it, and a start nobody took over is shut down.
Each case in a fresh interpreter: the test session's own Ray must not be up there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

CODE = """
import json, threading, time, ray
from embedpipe.cluster import connect as c
from embedpipe.config import ClusterConfig
cfg = ClusterConfig(workers=1, cpus_per_worker=1)
out = {}
c.start_early(cfg)
c.start_early(cfg)  # a second call while one is under way: nothing
out["starts"] = len(c._EARLY)
if MODE == "take over":
    out["started"] = c.connect(cfg)
    time.sleep(2)  # a thread that had ended would have taken Ray's processes with it by now
    out["answer"] = ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=60)
    c.shutdown()
else:
    c.abandon_early()
out["up"] = ray.is_initialized()
out["threads"] = [t.name for t in threading.enumerate() if t.name == "embedpipe-ray-start"]
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["take over", "abandon"])
def test_an_early_start_is_taken_over_or_shut_down(mode):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", f"MODE = {mode!r}\n" + CODE], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["starts"] == 1 and out["up"] is False and out["threads"] == []
    if mode == "take over":
        assert out["started"] is True and out["answer"] == 42
