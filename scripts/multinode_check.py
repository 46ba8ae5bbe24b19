"""Multi-node check: the same job on one Ray node and on three, with the model shipped to each.

Starts one ``ray.cluster_utils.Cluster`` on this machine (a head with no CPUs plus ``--nodes`` nodes of
one CPU, each with its own model cache, so every node that runs a worker fetches the model from the
object store), then runs one job through ``run_job`` twice: with one worker (one node) and with one
worker per node. Prints each run's tokens/s (wall: job start to report, start-up and model shipping
included), the summed per-worker tokens/s while processing units, start-up seconds, the Ray node of
each worker, and the ratios 3-node / 1-node; first, what shipping the model costs on the driver (put)
and on a node (a fetch into an empty cache, then a cache hit).

All nodes of this cluster share this machine's cores: on a 2-core machine three one-thread workers
contend for two cores, so the ideal ratio is 2, not 3, and other load on the machine lowers it further.
Real nodes bring their own cores; this checks the mechanism (placement, shipping, the per-node cache)
and what start-up costs, not the scaling of separate machines.

    .venv/bin/python scripts/multinode_check.py               # ~3 minutes on 2 quiet cores
    .venv/bin/python scripts/multinode_check.py --rows 600    # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CORPUS = ROOT / "examples" / "data" / "quickstart.parquet"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1200, help="rows of the quickstart corpus")
    p.add_argument("--unit-rows", type=int, default=100)
    p.add_argument("--nodes", type=int, default=3)
    return p.parse_args()


def run(work: Path, *, address: str, corpus: Path, unit_rows: int, workers: int, name: str) -> dict:
    from embedpipe.cluster.driver import run_job
    from embedpipe.config import parse_job

    job = parse_job({"input": {"path": str(corpus), "unit_rows": unit_rows}, "model": {"path": MODEL},
                     "batching": {"max_tokens": 4096}, "output": {"path": str(work / f"out_{name}")},
                     "cluster": {"address": address, "workers": workers, "cpus_per_worker": 1}}, name=name)
    return run_job(job, progress=False).report


def shipping_cost(cache: Path) -> dict:
    """Seconds to put the model in the object store, to fetch it into an empty node cache, and a cache hit."""
    import os

    from embedpipe.cluster.modelship import open_model, ship_model
    from embedpipe.models.resolve import resolve_model_path

    os.environ["EMBEDPIPE_CACHE_DIR"] = str(cache)  # this process only: a cold cache, then a warm one
    began = time.perf_counter()
    shipped = ship_model(resolve_model_path(MODEL))
    put = time.perf_counter() - began
    times = []
    for _ in range(2):
        began = time.perf_counter()
        open_model(shipped)
        times.append(time.perf_counter() - began)
    del os.environ["EMBEDPIPE_CACHE_DIR"]
    return {"model_mb": round(shipped.size / 1e6, 1), "put_s": round(put, 3), "fetch_cold_s": round(times[0], 3),
            "hit_s": round(times[1], 4)}


def summary(report: dict) -> dict:
    return {"workers": report["workers"], "wall_s": report["wall_seconds"], "startup_s": report["startup_seconds"],
            "tokens_per_s": report["tokens_per_second"],
            "processing_tokens_per_s": round(sum(w["tokens_per_second"] for w in report["per_worker"]), 1),
            "nodes": sorted({w["node"] for w in report["per_worker"]})}


def main() -> None:
    args = parse_args()
    import pyarrow.parquet as pq
    import ray
    from ray.cluster_utils import Cluster

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="embedpipe-multinode-") as tmp:
        work = Path(tmp)
        corpus = work / "corpus.parquet"
        pq.write_table(pq.read_table(CORPUS).slice(0, args.rows), corpus, row_group_size=args.unit_rows)
        started = time.perf_counter()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        try:
            for i in range(args.nodes):
                cluster.add_node(num_cpus=1, env_vars={"EMBEDPIPE_CACHE_DIR": str(work / f"cache{i}")})
            cluster.wait_for_nodes()
            print(f"cluster of {args.nodes} one-CPU nodes up in {time.perf_counter() - started:.1f} s", flush=True)
            ray.init(address=cluster.address, logging_level=logging.WARNING)  # run_job uses this connection
            shipping = shipping_cost(work / "driver_cache")
            one = summary(run(work, address=cluster.address, corpus=corpus, unit_rows=args.unit_rows, workers=1,
                              name="one"))
            many = summary(run(work, address=cluster.address, corpus=corpus, unit_rows=args.unit_rows,
                               workers=args.nodes, name="many"))
        finally:
            ray.shutdown()
            cluster.shutdown()
    print(json.dumps({"rows": args.rows, "shipping": shipping, "one_node": one, f"{args.nodes}_nodes": many}, indent=1))
    print(f"tokens/s {args.nodes} nodes / 1 node: wall {many['tokens_per_s'] / one['tokens_per_s']:.2f}x, "
          f"while processing {many['processing_tokens_per_s'] / one['processing_tokens_per_s']:.2f}x "
          f"(scaling efficiency {many['tokens_per_s'] / one['tokens_per_s'] / args.nodes:.0%} of {args.nodes}x)")


if __name__ == "__main__":
    main()
