"""Start an embedded local Ray, or join a running cluster, and size the worker actors."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray

from embedpipe.cluster.embedded import kill_autoscaler_monitor, local_system_config, trimmed_start
from embedpipe.cluster.signals import python_handlers_kept
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
    with python_handlers_kept():  # ray.init replaces SIGTERM's: a run's own handler (run_job's interrupt) stays
        _init(cfg)
    return True


def disconnect(started: bool) -> None:
    """Shut Ray down when ``connect`` started it (the embedded local Ray); a joined cluster is left as it is.

    Ray's shutdown stops its processes one by one, each given 1 s to exit on SIGTERM before a SIGKILL. It stops the
    GCS before the autoscaler's monitor, whose SIGTERM handler then reports its "failure" to that GCS and waits on
    it until the SIGKILL comes: 1 s of every embedded run's wall (Ray 2.60; docs/performance.md, session 22). The
    monitor has nothing to scale on one machine: the embedded start runs none (embedded.py), and one started all
    the same is sent the SIGKILL first, while the rest of the shutdown stays Ray's own (SIGTERM first, the raylet
    reaping its workers)."""
    if not started:
        return
    kill_autoscaler_monitor()
    ray.shutdown()


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
        with trimmed_start():
            ray.init(address="local", num_cpus=max(cpus, wanted), include_dashboard=False, logging_level=level,
                     _system_config=local_system_config())


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
