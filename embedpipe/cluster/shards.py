"""The index build's shard tasks on the run's workers: the driver hands ``shard_runner(...)`` to
``IndexBuild`` (embedpipe/index/build.py), on the Ray the driver already connected, so the index
package never starts or joins Ray itself.

One ShardWorker actor per worker slot (no model, the trained index once through the object store),
under the cluster Scheduler: a dead worker's unit is retried. Each checks, before every shard, that it runs the
driver's embedpipe (cluster/codeid.py): a shard built by other code would make another index than the run's.
"""

from __future__ import annotations

from typing import Iterator

import ray

from embedpipe.cluster.codeid import CodeId, check_same_code
from embedpipe.cluster.connect import WorkerPlan
from embedpipe.cluster.nodes import node_name
from embedpipe.cluster.scheduler import Liveness, Scheduler, worker_actor
from embedpipe.config import ClusterConfig
from embedpipe.index.build import RunShards
from embedpipe.index.parts import Part
from embedpipe.index.shard import ShardContext, ShardResult, ShardWorker


def shard_runner(cluster: ClusterConfig, workers: WorkerPlan, *, code: CodeId | None) -> RunShards:
    """``run_shards(context, parts)`` for IndexBuild: shard results as the workers finish them. ``code``: the
    driver's, checked by every shard worker (None: not checked)."""

    def run_shards(context: ShardContext, parts: list[Part]) -> Iterator[ShardResult]:
        ref = ray.put(context)
        actor_cls = worker_actor(CheckedShardWorker).options(num_cpus=workers.cpus_per_worker, max_restarts=0)
        scheduler = Scheduler(make_actor=lambda slot: actor_cls.remote(ref, index=slot, code=code),
                              workers=min(workers.workers, len(parts)),
                              max_attempts=cluster.max_attempts, on_error="fail",  # a lost shard = a wrong index
                              liveness=Liveness.from_config(cluster), resources={"CPU": workers.cpus_per_worker})
        yield from scheduler.run(parts)

    return run_shards


class CheckedShardWorker(ShardWorker):
    """A ShardWorker that checks, before each shard, that it runs the driver's code (``code``; None: not checked)."""

    def __init__(self, context: ShardContext, *, index: int, code: CodeId | None):
        super().__init__(context)
        self.index, self.code, self.node = index, code, node_name()

    def process(self, part: Part) -> ShardResult:
        check_same_code(self.code, who=f"index shard worker {self.index}", node=self.node)
        return super().process(part)
