"""Measure what compression costs: recall of FAISS factory strings on a run's own vectors.

    .venv/bin/python scripts/index_recall.py OUT_DIR "IVF256,SQ8" "IVF256,PQ16" "HNSW32" ...

OUT_DIR is the output.path of a run with output.format: parquet or both (its vectors/ parts).
Each index is trained on a uniform sample, filled, and tuned to --target exactly as a build does
(embedpipe/index/recall.py), on --queries hold-out queries. Loads all vectors: a benchmark, not
a pipeline stage.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def main() -> None:
    import faiss

    from embedpipe.index.build import search_sweeps
    from embedpipe.index.factory import parse_factory
    from embedpipe.index.parts import read_vectors
    from embedpipe.index.recall import TIE_SLACK, ExactNeighbours, tune
    from embedpipe.index.train import train_index

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("factories", nargs="+")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=0, help="FAISS threads (0: all)")
    args = ap.parse_args()
    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    x = np.concatenate([read_vectors(p)[1] for p in sorted((args.out_dir / "vectors").glob("part-*.parquet"))])
    n, d = x.shape
    rng = np.random.default_rng(0)
    qpos = np.sort(rng.choice(n, min(args.queries, n), replace=False))
    ids = np.arange(n, dtype=np.int64)
    exact = ExactNeighbours(x[qpos], width=11 + TIE_SLACK, metric="inner_product")(x, ids)
    print(f"{n:,} vectors of dimension {d}, {len(qpos)} hold-out queries, target {args.target}")
    print("| index | MB | 10-recall@10 | 1-recall@1 | search setting | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for factory in args.factories:
        spec = parse_factory(factory)
        started = time.perf_counter()
        index = train_index(spec, x[rng.permutation(n)[: spec.training_rows(n)]], dim=d, metric="inner_product")
        index.add_with_ids(x, ids)
        t = tune(index, sweeps=search_sweeps(spec, k=10), queries=x[qpos], query_ids=qpos.astype(np.int64),
                 exact=exact, k=10, target=args.target)
        m = t.chosen
        setting = ", ".join(f"{k} {v}" for k, v in m.params.items()) or "exhaustive"
        print(f"| `{factory}` | {len(faiss.serialize_index(index)) / 1e6:.1f} | {m.recall_at_10:.3f}"
              f"{'' if t.reached else ' max'} | {m.recall_at_1:.3f} | {setting} | "
              f"{time.perf_counter() - started:.1f} |", flush=True)


if __name__ == "__main__":
    main()
