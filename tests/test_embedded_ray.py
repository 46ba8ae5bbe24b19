"""The embedded local Ray: started by connect (its start trimmed by cluster/embedded.py), stopped by disconnect."""

import json
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

STOP = """
import json, time
import ray
from ray._private import ray_constants, worker
from embedpipe.cluster.connect import connect, disconnect
from embedpipe.config import ClusterConfig

@ray.remote(num_cpus=1)
class Echo:
    def ping(self):
        return "pong"

import embedpipe.cluster.embedded as embedded
from ray._private import services
from ray._private.node import Node
lookup, polls, wait_registered = services.get_node, [], embedded._wait_registered
start_api_server, start_monitor = Node.start_api_server, Node.start_monitor

def watched_wait(*args, **kwargs):  # what the poll answered during the start
    polls.append(wait_registered(*args, **kwargs))
    return polls[-1]

embedded._wait_registered = watched_wait
assert connect(ClusterConfig()), "connect started no Ray of its own"
assert ray.get(Echo.remote().ping.remote(), timeout=60) == "pong"
from ray._raylet import Config  # this driver's copy of the running Ray's system config
retries = [Config.raylet_client_connect_timeout_milliseconds(), Config.raylet_client_num_connect_attempts()]
from ray._private.state import state  # the system config the GCS holds: what the node's processes run with
task_events = state.get_system_config().get("task_events_report_interval_ms")
node = worker._global_node
processes = {kind: [i.process for i in infos] for kind, infos in node.all_processes.items()}
seen = {"connect retries": retries, "task events every": task_events, "registration polls": polls,
        "lookup restored": services.get_node is lookup, "processes": sorted(processes),
        "dashboard start restored": Node.start_api_server is start_api_server,
        "monitor start restored": Node.start_monitor is start_monitor,
        "dashboard address": (ray.experimental.internal_kv._internal_kv_get(
            ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD) or b"").decode()}
time.sleep(1.5)  # the node's dashboard agent looks for the head's address once a second from its start
with open(node.get_session_dir_path() + "/logs/dashboard_agent.log") as agent_log:
    seen["agent lookup failed"] = "Get dashboard http address failed" in agent_log.read()
began = time.perf_counter()
disconnect(True)
seen["seconds"] = round(time.perf_counter() - began, 3)
seen["ray up after"] = ray.is_initialized()
seen["alive after"] = sorted(kind for kind, ps in processes.items() for p in ps if p.poll() is None)
print("RESULT " + json.dumps(seen))
"""


def test_embedded_ray_start_and_stop():
    """connect starts the embedded Ray with LOCAL_SYSTEM_CONFIG (its IPC connects retried every 100 ms, no task
    events), its node's registration polled every 20 ms instead of Ray's 1 s, and neither a dashboard head nor an
    autoscaler monitor.
    disconnect is Ray's own shutdown, and every process it started exits."""
    from ray._private import ray_constants

    done = subprocess.run([sys.executable, "-c", STOP], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert seen["ray up after"] is False and seen["alive after"] == [], seen
    assert "autoscaler failed" not in done.stderr.lower() + done.stdout.lower()  # no "failure" reported
    assert seen["connect retries"] == [100, 100], seen  # the embedded Ray runs with LOCAL_SYSTEM_CONFIG
    assert seen["task events every"] == 0, seen  # none recorded: nothing of an embedded Ray could read them
    # the start's lookup of its node polled the GCS and found it there; Ray's own lookup is back in place after
    assert seen["registration polls"] == [True] and seen["lookup restored"], seen
    # no dashboard head: its address is one nobody serves, as the head's own is with no dashboard; the node's agent
    # finds it, and logs no failed lookup
    assert ray_constants.PROCESS_TYPE_DASHBOARD not in seen["processes"], seen
    assert ray_constants.PROCESS_TYPE_MONITOR not in seen["processes"] and seen["monitor start restored"], seen
    assert {"raylet", "gcs_server", "log_monitor"} <= set(seen["processes"]), seen
    assert seen["dashboard address"] == "127.0.0.1:0" and seen["dashboard start restored"], seen
    assert seen["agent lookup failed"] is False, seen


def test_disconnect_kills_a_monitor_first(ray_session):
    """A monitor started all the same (this Ray's internals laid out otherwise) is SIGKILLed before Ray's shutdown:
    Ray stops the GCS before it, and its SIGTERM handler then waits on the dead GCS for the 1 s Ray gives it. Here,
    on the session Ray's own monitor (started by a plain ray.init; nothing of a test needs it)."""
    from ray._private import ray_constants, worker

    from embedpipe.cluster.embedded import kill_autoscaler_monitor

    monitors = [info.process for info in worker._global_node.all_processes[ray_constants.PROCESS_TYPE_MONITOR]]
    assert monitors and all(p.poll() is None for p in monitors)
    kill_autoscaler_monitor()
    assert [p.poll() for p in monitors] == [-9] * len(monitors)
    assert ray_session.is_initialized()


def test_local_system_config_leaves_what_the_environment_sets(monkeypatch):
    """Ray's own RAY_<name> environment variables keep their say: such a key is not passed as system config."""
    from embedpipe.cluster.embedded import LOCAL_SYSTEM_CONFIG, local_system_config

    for name in LOCAL_SYSTEM_CONFIG:
        monkeypatch.delenv(f"RAY_{name}", raising=False)
    monkeypatch.setenv("RAY_raylet_client_connect_timeout_milliseconds", "250")
    assert local_system_config() == {"raylet_client_num_connect_attempts": 100, "task_events_report_interval_ms": 0}
    monkeypatch.delenv("RAY_raylet_client_connect_timeout_milliseconds")
    assert local_system_config() == LOCAL_SYSTEM_CONFIG


def test_disconnect_leaves_a_ray_it_did_not_start(ray_session):
    """A joined cluster (connect returned False) is not this run's to stop: the session's Ray stays up."""
    import ray

    from embedpipe.cluster.connect import connect, disconnect
    from embedpipe.config import ClusterConfig

    assert connect(ClusterConfig()) is False  # Ray is up already
    disconnect(False)
    assert ray.is_initialized()


def test_registration_poll_against_a_real_gcs(ray_session, monkeypatch):
    """_wait_registered finds a registered node at once (the session Ray's own); a node the GCS does not list is
    polled for REGISTRATION_POLL_FOR_S and then left to Ray's own wait (False), as is an address Ray's client refuses.
    (A GCS nobody answers holds Ray's client 40 s: not a case of an embedded start, whose GCS has just answered Ray.)"""
    from embedpipe.cluster import embedded

    context = ray_session.get_runtime_context()
    gcs, node = context.gcs_address, context.get_node_id()
    assert embedded._wait_registered(gcs_address=gcs, node_id=node) is True
    monkeypatch.setattr(embedded, "REGISTRATION_POLL_FOR_S", 0.3)
    began = time.perf_counter()
    assert embedded._wait_registered(gcs_address=gcs, node_id="ab" * 28) is False
    assert 0.3 <= time.perf_counter() - began < 5
    assert embedded._wait_registered(gcs_address="not-an-address", node_id=node) is False


def test_no_dashboard_head_falls_back_to_rays_own_start(monkeypatch):
    """Where the address cannot be published, the start is Ray's own (its dashboard head started), and Ray's method is
    back in place after the embedded start: the shortcut never costs a start."""
    from ray._private.node import Node

    from embedpipe.cluster.embedded import _no_dashboard_head

    started = []
    monkeypatch.setattr(Node, "start_api_server", lambda self, **kwargs: started.append(kwargs))
    rays_own = Node.start_api_server

    class NoGcsYet:  # a node whose GCS client is not there
        def get_gcs_client(self):
            raise ConnectionError("no GCS")

    with _no_dashboard_head():
        assert Node.start_api_server is not rays_own
        Node.start_api_server(NoGcsYet(), include_dashboard=False, raise_on_failure=False)
    assert started == [{"include_dashboard": False, "raise_on_failure": False}]
    assert Node.start_api_server is rays_own
