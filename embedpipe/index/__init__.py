"""FAISS outputs: factory choice (auto), sampled training, per-unit shards and merge, recall, search.

    plan.py     what to build: the job's factory string or auto, checked against corpus and model
    factory.py  the factory strings embedpipe builds: parse, check, memory estimates
    parts.py    read vector parts back one unit at a time; the uniform training sample
    ids.py      input ids -> int64 index ids, ids.parquet
    train.py    the trained, empty index
    shard.py    worker side: one unit's vectors into a shard of the trained index
    merge.py    shards -> index, in unit-id order, in memory or on disk
    recall.py   exact neighbours, recall@k, nprobe / efSearch tuning
    build.py    the driver's build step after the embedding pass
    search.py   open_index(output_path).search(texts, k)

Importing this package is cheap: FAISS (and pyarrow) load inside the modules that need them.
"""

from __future__ import annotations

__all__ = ["open_index"]


def __getattr__(name: str):
    if name == "open_index":
        from embedpipe.index.search import open_index

        return open_index
    raise AttributeError(f"module 'embedpipe.index' has no attribute {name!r}")
