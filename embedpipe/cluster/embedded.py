"""The embedded local Ray's own start and stop, less Ray's fixed waits and the processes one machine has no use for.

Each trim wraps a piece of Ray's internals (Ray 2.60) for the embedded start alone and puts it back after; where a
Ray lays its internals out otherwise, that trim does nothing, and the start is Ray's own.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import time
from contextlib import ExitStack, contextmanager
from typing import Callable, ContextManager, Iterator

log = logging.getLogger(__name__)


@contextmanager
def trimmed_start() -> Iterator[None]:
    """Around the embedded ``ray.init``: its node's registration polled, no dashboard head, no autoscaler monitor."""
    with ExitStack() as stack:
        for trim in (_registration_polled, _no_dashboard_head, _no_autoscaler_monitor):
            stack.enter_context(trim())
        yield


@contextmanager
def _swapped(module: str, path: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Inside the block, Ray's ``module.path`` (a function, or ``Class.method``) is ``wrap(original)``; after it, the
    original again. Where this Ray has no such thing, or ``wrap`` cannot be built, nothing is swapped."""
    *owners, name = path.split(".")
    try:
        owner = importlib.import_module(module)
        for part in owners:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        replacement = wrap(original)
    except (ImportError, AttributeError):
        yield
        return
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def kill_autoscaler_monitor() -> None:
    """SIGKILL the embedded Ray's autoscaler monitor. Where this Ray's node table has none, or lays it out otherwise,
    nothing is killed, and ray.shutdown takes its 1 s as before."""
    try:
        from ray._private import ray_constants, worker

        infos = worker._global_node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, [])
    except (ImportError, AttributeError):  # no node of this process's own, or another Ray's internals
        return
    for info in infos:
        process = info.process
        if process.poll() is None:
            process.kill()
            try:
                process.wait(timeout=1)  # reaped here: ray.shutdown skips a process that has exited
            except subprocess.TimeoutExpired:  # stuck in the kernel: ray.shutdown waits on it as it always did
                pass


# The embedded Ray's start asks its GCS for the new node 0.1 s after it starts the raylet, and the C++ lookup behind
# that ask (GlobalStateAccessor::GetNode) sleeps a whole second between asks. The raylet registers once its dashboard
# agent has written its ports: 0.9-1.3 s after that first ask on two Zen 4 cores, so Ray's lookup found the node at
# its second ask (1.0 s) or, in 4 starts of 12, at its third (2.0 s) (Ray 2.60; docs/performance.md, session 28).
# _registration_polled asks the GCS every REGISTRATION_POLL_EVERY_S first, for at most REGISTRATION_POLL_FOR_S; Ray's
# own lookup then runs as before, and finds the node at its first ask.
REGISTRATION_POLL_EVERY_S = 0.02
REGISTRATION_POLL_FOR_S = 10.0  # then Ray's own lookup waits on, as long as Ray allows (30 s in Node.__init__, 2.60)
REGISTRATION_ASK_TIMEOUT_S = 5.0  # one ask; a GCS that does not answer in it leaves the wait to Ray


def _registration_polled() -> ContextManager[None]:
    """While the embedded Ray starts, its lookup of the new node (``ray._private.services.get_node``) first polls
    the GCS until the node is registered. Where this Ray's internals lay it out otherwise, nothing is wrapped and the
    start waits as Ray's own code says; whatever the poll meets, Ray's own lookup still runs and answers."""

    def polled_first(lookup: Callable) -> Callable:
        def get_node(gcs_address: str, node_id: str, *args, **kwargs):
            if isinstance(node_id, str):  # the hex id Ray 2.60 passes; anything else is left to Ray's lookup alone
                _wait_registered(gcs_address=gcs_address, node_id=node_id)
            return lookup(gcs_address, node_id, *args, **kwargs)

        return get_node

    return _swapped("ray._private.services", "get_node", polled_first)


def _wait_registered(*, gcs_address: str, node_id: str) -> bool:
    """Poll the GCS at ``gcs_address`` until it lists ``node_id`` (hex); True when it did. False when the poll timed
    out or failed (another Ray's client, the GCS not answering): the caller's own wait takes over."""
    deadline = time.monotonic() + REGISTRATION_POLL_FOR_S
    try:
        from ray._raylet import GcsClient

        client = GcsClient(address=gcs_address)
        while time.monotonic() < deadline:
            if node_id in {found.hex() for found in client.get_all_node_info(timeout=REGISTRATION_ASK_TIMEOUT_S)}:
                return True
            time.sleep(REGISTRATION_POLL_EVERY_S)
    except Exception as exc:  # noqa: BLE001 - any failure of this shortcut leaves the lookup to Ray as it was
        log.debug("polling the GCS for the new node failed, Ray's own lookup waits instead: %s", exc)
    return False


# Asked for no dashboard (include_dashboard=False), Ray 2.60 still starts its dashboard head: a Python process that
# loads one module (usage stats, which ray.init turns off for a local Ray), serves no HTTP, and publishes the address
# of its unserved HTTP port. The embedded start waits for that address before it starts the raylet: 0.9-1.0 s of every
# start, and a process importing on the workers' cores (docs/performance.md, session 29). _no_dashboard_head starts
# none, and publishes an address nothing can listen on (port 0) where Ray's agents look for the head's; without it,
# the node's dashboard agent logs a failed lookup every second for the whole run.
NO_DASHBOARD_ADDRESS = b"127.0.0.1:0"


def _no_dashboard_head() -> ContextManager[None]:
    """While the embedded Ray starts, its head starts no dashboard process. Where this Ray's internals lay it out
    otherwise, nothing is wrapped; where publishing the address fails, Ray starts its dashboard head as it always
    did."""

    def address_only(start: Callable) -> Callable:
        from ray._private import ray_constants

        key, namespace = ray_constants.DASHBOARD_ADDRESS.encode(), ray_constants.KV_NAMESPACE_DASHBOARD

        def start_api_server(self, *args, **kwargs):
            try:
                self.get_gcs_client().internal_kv_put(key, NO_DASHBOARD_ADDRESS, True, namespace)
            except Exception as exc:  # noqa: BLE001 - any failure of this shortcut leaves the start to Ray as it was
                log.debug("publishing no dashboard failed, Ray starts its dashboard head instead: %s", exc)
                return start(self, *args, **kwargs)

        return start_api_server

    return _swapped("ray._private.node", "Node.start_api_server", address_only)


# The autoscaler's monitor has nothing to scale on one machine: a Python process importing Ray's autoscaler (0.55
# CPU-seconds) on the workers' two cores while the embedded Ray starts, for 0.3-0.4 s of the start's wall (two Zen 3
# cores; docs/performance.md, session 29). `ray start --no-monitor` skips it; ray.init has no such option.
def _no_autoscaler_monitor() -> ContextManager[None]:
    """While the embedded Ray starts, its head starts no autoscaler monitor (as ``ray start --no-monitor``). Where
    this Ray's internals lay it out otherwise, nothing is wrapped, and Ray starts its monitor (which disconnect then
    kills first)."""
    return _swapped("ray._private.node", "Node.start_monitor", lambda start: lambda self, *args, **kwargs: None)


# Ray's IPC connects (the raylet's to its own object store among them) retry every
# raylet_client_connect_timeout_milliseconds, raylet_client_num_connect_attempts times (Ray 2.60: 1,000 ms, 10). The
# raylet's first connect to its store races the store's own thread, and when it loses, the embedded Ray's start
# waits a whole second (4 of 8 quickstarts on 2 cores; docs/performance.md, session 22). Every 100 ms, 100 times:
# the same 10 s of patience, a tenth of the wait.
# Task events (every task's and actor's state changes, which each worker and the driver send to the GCS) feed only
# the dashboard and Ray's state API, both served by the dashboard head that the embedded start does not run
# (_no_dashboard_head). The driver's shutdown flushed them all the same: 0.34 s of every embedded run's wall, 0.09 s
# with none recorded (an interval of 0; Ray 2.60, 2 Zen 4 cores; docs/performance.md, session 36).
LOCAL_SYSTEM_CONFIG = {"raylet_client_connect_timeout_milliseconds": 100, "raylet_client_num_connect_attempts": 100,
                       "task_events_report_interval_ms": 0}


def local_system_config() -> dict[str, int]:
    """The embedded Ray's system config: LOCAL_SYSTEM_CONFIG, less what the environment sets itself (RAY_<name>)."""
    return {name: value for name, value in LOCAL_SYSTEM_CONFIG.items() if f"RAY_{name}" not in os.environ}
