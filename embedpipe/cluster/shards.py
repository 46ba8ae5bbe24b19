"""The index build's shard tasks on the run's workers: the driver hands ``shard_runner(...)`` to
``IndexBuild`` (embedpipe/index/build.py), on the Ray the driver already connected, so the index
package never starts or joins Ray itself.

One ShardWorker actor per worker slot (no model, the trained index once through the object store),
under the cluster Scheduler: a dead worker's unit is retried.
"""

from __future__ import annotations

from typing import Iterator

import ray

from embedpipe.cluster.connect import WorkerPlan
from embedpipe.cluster.scheduler import Liveness, Scheduler
from embedpipe.config import ClusterConfig
from embedpipe.index.build import RunShards
from embedpipe.index.parts import Part
from embedpipe.index.shard import ShardContext, ShardResult, ShardWorker


def shard_runner(cluster: ClusterConfig, workers: WorkerPlan) -> RunShards:
    """``run_shards(context, parts)`` for IndexBuild: shard results as the workers finish them."""

    def run_shards(context: ShardContext, parts: list[Part]) -> Iterator[ShardResult]:
        ref = ray.put(context)
        actor_cls = ray.remote(ShardWorker).options(num_cpus=workers.cpus_per_worker, max_restarts=0)
        scheduler = Scheduler(make_actor=lambda slot: actor_cls.remote(ref), workers=min(workers.workers, len(parts)),
                              max_attempts=cluster.max_attempts, on_error="fail",  # a lost shard = a wrong index
                              liveness=Liveness.from_config(cluster), resources={"CPU": workers.cpus_per_worker})
        yield from scheduler.run(parts)

    return run_shards
