"""Start an embedded local Ray, or join a running cluster, and size the worker actors."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import ray

from embedpipe.config import ClusterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlan:
    workers: int
    cpus_per_worker: int
    gpus_per_worker: int  # 1 on GPU nodes, else 0


def connect(cfg: ClusterConfig) -> bool:
    """Make sure Ray is up; returns True when this call started it (so the caller shuts it down)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    with _keep_signal_handlers():
        _init(cfg)
    return True


def disconnect(started: bool) -> None:
    """Shut Ray down when ``connect`` started it (the embedded local Ray); a joined cluster is left as it is.

    Ray's shutdown stops its processes one by one, each given 1 s to exit on SIGTERM before a SIGKILL. It stops the
    GCS before the autoscaler's monitor, whose SIGTERM handler then reports its "failure" to that GCS and waits on
    it until the SIGKILL comes: 1 s of every embedded run's wall (Ray 2.60; docs/performance.md, session 22). The
    monitor has nothing to scale on one machine: the embedded start runs none (_no_autoscaler_monitor), and one
    started all the same is sent the SIGKILL first, while the rest of the shutdown stays Ray's own (SIGTERM first,
    the raylet reaping its workers)."""
    if not started:
        return
    _kill_autoscaler_monitor()
    ray.shutdown()


def _kill_autoscaler_monitor() -> None:
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


@contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """ray.init replaces SIGTERM's handler (sys.exit, behind a C++ stack dump, exit 134 or 15): a SIGTERM or
    SIGINT handler the driver set from Python (run_job's interrupt) is put back, so a signal stops the run
    cleanly. Handlers nobody set (the defaults) are left as Ray set them."""
    ours = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in ours.items():
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(signum, handler)


# Ray's notices about itself on an embedded Ray (its token-auth notice on every start, among them): shown only
# with -v (embedpipe's loggers at INFO or below); errors always show.
RAY_NOTICE_LOGGERS = ("ray._private.authentication",)


def ray_logging_level() -> int:
    """Ray's own level from embedpipe's: WARNING with -v (or lower), else ERROR."""
    return logging.WARNING if logging.getLogger("embedpipe").isEnabledFor(logging.INFO) else logging.ERROR


def _init(cfg: ClusterConfig) -> None:
    address = cfg.address or submitted_job_address()
    level = ray_logging_level()
    for name in RAY_NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(level)
    if address:
        address = _use_token_if_available(address)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    else:
        cpus = os.cpu_count() or 1
        wanted = (cfg.workers or 1) * (cfg.cpus_per_worker or 1)
        # "local": a new embedded instance, never a cluster found through RAY_ADDRESS or `ray start`
        with _registration_polled(), _no_dashboard_head(), _no_autoscaler_monitor():
            ray.init(address="local", num_cpus=max(cpus, wanted), include_dashboard=False, logging_level=level,
                     _system_config=local_system_config())


# The embedded Ray's start asks its GCS for the new node 0.1 s after it starts the raylet, and the C++ lookup behind
# that ask (GlobalStateAccessor::GetNode) sleeps a whole second between asks. The raylet registers once its dashboard
# agent has written its ports: 0.9-1.3 s after that first ask on two Zen 4 cores, so Ray's lookup found the node at
# its second ask (1.0 s) or, in 4 starts of 12, at its third (2.0 s) (Ray 2.60; docs/performance.md, session 28).
# _registration_polled asks the GCS every REGISTRATION_POLL_EVERY_S first, for at most REGISTRATION_POLL_FOR_S; Ray's
# own lookup then runs as before, and finds the node at its first ask.
REGISTRATION_POLL_EVERY_S = 0.02
REGISTRATION_POLL_FOR_S = 10.0  # then Ray's own lookup waits on, as long as Ray allows (30 s in Node.__init__, 2.60)
REGISTRATION_ASK_TIMEOUT_S = 5.0  # one ask; a GCS that does not answer in it leaves the wait to Ray


@contextmanager
def _registration_polled() -> Iterator[None]:
    """While the embedded Ray starts, its lookup of the new node (``ray._private.services.get_node``) first polls
    the GCS until the node is registered. Where this Ray's internals lay it out otherwise, nothing is wrapped and the
    start waits as Ray's own code says; whatever the poll meets, Ray's own lookup still runs and answers."""
    try:
        from ray._private import services

        lookup = services.get_node
    except (ImportError, AttributeError):
        yield
        return

    def get_node(gcs_address: str, node_id: str, *args, **kwargs):
        if isinstance(node_id, str):  # the hex id Ray 2.60 passes; anything else is left to Ray's lookup alone
            _wait_registered(gcs_address=gcs_address, node_id=node_id)
        return lookup(gcs_address, node_id, *args, **kwargs)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = lookup


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


@contextmanager
def _no_dashboard_head() -> Iterator[None]:
    """While the embedded Ray starts, its head starts no dashboard process. Where this Ray's internals lay it out
    otherwise, nothing is wrapped; where publishing the address fails, Ray starts its dashboard head as it always did."""
    try:
        from ray._private import ray_constants
        from ray._private.node import Node

        start = Node.start_api_server
        key, namespace = ray_constants.DASHBOARD_ADDRESS.encode(), ray_constants.KV_NAMESPACE_DASHBOARD
    except (ImportError, AttributeError):
        yield
        return

    def start_api_server(self, *args, **kwargs):
        try:
            self.get_gcs_client().internal_kv_put(key, NO_DASHBOARD_ADDRESS, True, namespace)
        except Exception as exc:  # noqa: BLE001 - any failure of this shortcut leaves the start to Ray as it was
            log.debug("publishing no dashboard failed, Ray starts its dashboard head instead: %s", exc)
            return start(self, *args, **kwargs)

    Node.start_api_server = start_api_server
    try:
        yield
    finally:
        Node.start_api_server = start


# The autoscaler's monitor has nothing to scale on one machine: a Python process importing Ray's autoscaler (0.55
# CPU-seconds) on the workers' two cores while the embedded Ray starts, for 0.3 s of the start's wall (session 29).
# `ray start --no-monitor` skips it; ray.init has no such option, so _no_autoscaler_monitor does what it does.


@contextmanager
def _no_autoscaler_monitor() -> Iterator[None]:
    """While the embedded Ray starts, its head starts no autoscaler monitor (as ``ray start --no-monitor``). Where
    this Ray's internals lay it out otherwise, nothing is wrapped, and Ray starts its monitor (which disconnect then
    kills first)."""
    try:
        from ray._private.node import Node

        start = Node.start_monitor
    except (ImportError, AttributeError):
        yield
        return
    Node.start_monitor = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        Node.start_monitor = start


# Ray's IPC connects (the raylet's to its own object store among them) retry every
# raylet_client_connect_timeout_milliseconds, raylet_client_num_connect_attempts times (Ray 2.60: 1,000 ms, 10). The
# raylet's first connect to its store races the store's own thread, and when it loses, the embedded Ray's start
# waits a whole second (4 of 8 quickstarts on 2 cores; docs/performance.md, session 22). Every 100 ms, 100 times:
# the same 10 s of patience, a tenth of the wait.
LOCAL_SYSTEM_CONFIG = {"raylet_client_connect_timeout_milliseconds": 100, "raylet_client_num_connect_attempts": 100}


def local_system_config() -> dict[str, int]:
    """The embedded Ray's system config: LOCAL_SYSTEM_CONFIG, less what the environment sets itself (RAY_<name>)."""
    return {name: value for name, value in LOCAL_SYSTEM_CONFIG.items() if f"RAY_{name}" not in os.environ}


def submitted_job_address() -> str:
    """``auto`` when this process is the entrypoint of a Ray job (``ray job submit -- embedpipe run job.yaml``),
    else "" (an embedded local Ray).

    The job server starts the entrypoint with RAY_JOB_CONFIG_JSON_ENV_VAR (the job's id and runtime_env) and
    RAY_ADDRESS (the cluster's GCS); such a run joins the cluster it was submitted to instead of starting a
    second Ray of its own on the head node. A plain shell's RAY_ADDRESS alone changes nothing: an empty
    cluster.address stays an embedded local Ray there."""
    submitted = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ and bool(os.environ.get("RAY_ADDRESS"))
    return "auto" if submitted else ""


PROBE_SECONDS = 10.0  # how long the join waits for the head's answer to "do you ask for a token?"


def _use_token_if_available(address: str) -> str:
    """Send Ray's auth token to a cluster that asks for one, and only then; returns the address to join.

    `ray start` turns token auth on when its machine has a token (``~/.ray/auth_token``,
    ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``), but a client joining by address sends its token
    only with ``RAY_AUTH_MODE=token``; without it the join fails with InvalidAuthToken. A client in
    token mode on a cluster without auth fails too: its actors are cancelled before they start.
    So the head is asked first, with one unauthenticated call (GetClusterId): UNAUTHENTICATED means
    it wants the token. ``auto`` is resolved to the head's address here, as Ray would resolve it,
    because Ray itself switches token mode on for ``auto`` whenever a token exists. An explicit
    ``RAY_AUTH_MODE`` is always respected.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return address
    have_token = _token_available()
    if address.startswith("ray://"):  # Ray Client: its server is not probed; a token is sent when there is one
        if have_token:
            _token_mode()
        return address
    from ray._private.services import canonicalize_bootstrap_address

    try:
        head = canonicalize_bootstrap_address(address)  # `auto` / RAY_ADDRESS -> host:port
    except (ConnectionError, ValueError):
        return address  # no head found: ray.init reports it in its own words
    if head is None or not _asks_for_token(head):
        return head or address
    if not have_token:
        raise ConnectionError(
            f"the Ray cluster at {head} requires token auth and this machine has no Ray token: set RAY_AUTH_TOKEN, "
            f"or copy the head's ~/.ray/auth_token here (or point RAY_AUTH_TOKEN_PATH at it)")
    _token_mode()
    return head


def _token_available() -> bool:
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.isfile(token_file)


def _asks_for_token(head: str) -> bool:
    """True when the head refuses an unauthenticated call; False when it answers or cannot be reached."""
    import grpc
    from ray._private.grpc_utils import init_grpc_channel  # TLS as configured, no token (mode not set yet)
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = init_grpc_channel(head)
    try:
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
            gcs_service_pb2.GetClusterIdRequest(), timeout=PROBE_SECONDS)
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()
    return False


def _token_mode() -> None:
    os.environ["RAY_AUTH_MODE"] = "token"
    try:  # Ray reads its config when imported: refresh it, as ray.init does for local clusters
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):  # older Ray without token auth
        pass


@dataclass(frozen=True)
class ExpectedWorkers:
    workers: int
    source: str  # where the number comes from, for `embedpipe validate`


def expected_workers(cfg: ClusterConfig) -> ExpectedWorkers:
    """How many workers a run will start, known before Ray is (the planner cuts units for them): cluster.workers;
    else, as plan_workers decides, one per GPU (one on CPU) of the Ray already connected or of this machine
    for the embedded Ray. A cluster to join with cluster.workers unset is sized only once joined: 1 is
    assumed, and the run warns when the cluster holds more."""
    if cfg.workers:
        return ExpectedWorkers(cfg.workers, "cluster.workers")
    if ray.is_initialized():
        gpus = int(ray.cluster_resources().get("GPU", 0))
        return ExpectedWorkers(max(gpus, 1), f"one per GPU of the connected Ray ({gpus})" if gpus else "no GPU: one")
    if cfg.address or submitted_job_address():
        return ExpectedWorkers(1, "assumed: the cluster's size is known once joined (set cluster.workers)")
    gpus = local_gpus()
    return ExpectedWorkers(max(gpus, 1), f"one per GPU of this machine ({gpus})" if gpus else "no GPU: one")


# device files a GPU driver creates (NVIDIA's; WSL's GPU paravirtualisation; ROCm's, which torch.cuda also
# reports): where none exists torch finds no GPU, and the driver learns it without importing torch (~2 s)
GPU_DEVICE_FILES: tuple[str, ...] = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def local_gpus() -> int:
    """The GPUs torch sees on this machine; 0 without importing torch where no GPU driver's device file exists."""
    if not any(os.path.exists(path) for path in GPU_DEVICE_FILES):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_workers(cfg: ClusterConfig) -> WorkerPlan:
    """One worker per GPU (else one), each with its share of CPUs; fails early if the cluster is too small."""
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 1))
    workers = cfg.workers or max(gpus, 1)
    per_gpu = 1 if gpus else 0
    cpus_per_worker = cfg.cpus_per_worker or (2 if gpus else max(1, cpus // workers))
    if workers * cpus_per_worker > cpus or workers * per_gpu > gpus:
        raise RuntimeError(
            f"the Ray cluster has {cpus} CPUs and {gpus} GPUs, too few for cluster.workers={workers} "
            f"with cluster.cpus_per_worker={cpus_per_worker}: lower cluster.workers or cluster.cpus_per_worker")
    return WorkerPlan(workers=workers, cpus_per_worker=cpus_per_worker, gpus_per_worker=per_gpu)
