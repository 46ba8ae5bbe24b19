"""Start an embedded local Ray, or join a running cluster, and size the worker actors."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

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
    if cfg.address:
        _use_token_if_available()
        ray.init(address=cfg.address, logging_level=logging.WARNING, log_to_driver=True)
    else:
        cpus = os.cpu_count() or 1
        wanted = (cfg.workers or 1) * (cfg.cpus_per_worker or 1)
        # "local": always a new embedded instance, never a cluster found through RAY_ADDRESS or `ray start`
        ray.init(address="local", num_cpus=max(cpus, wanted), include_dashboard=False,
                 logging_level=logging.WARNING)
    return True


def _use_token_if_available() -> None:
    """Send Ray's auth token when joining a cluster, as the cluster's own processes do.

    A cluster started with `ray start` enables token auth when this machine has a token
    (``~/.ray/auth_token``, ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``), but a client that
    joins by address does not send it unless ``RAY_AUTH_MODE=token``: the join then fails with
    InvalidAuthToken. A token sent to a cluster without auth is ignored, so sending it is safe.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # Ray reads its config when imported: refresh it, as ray.init does for local clusters
            from ray._raylet import Config

            Config.initialize("")
        except (ImportError, AttributeError):  # older Ray without token auth
            pass


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
