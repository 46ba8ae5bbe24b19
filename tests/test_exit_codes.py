"""The CLI's error contract (docs/operations.md): one exit code per kind of failure, one `error:` or
`interrupted:` line on stderr, never a traceback; the real CLI in a subprocess."""

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
from typer.testing import CliRunner

from embedpipe import errors
from embedpipe.cli import app
from embedpipe.cluster.codeid import CodeMismatch
from embedpipe.cluster.scheduler import NoWorkerPlaced, NoWorkerStarted, UnitFailed
from embedpipe.config import JobError
from embedpipe.index.factory import FactoryError
from embedpipe.index.search import IndexNotFound
from embedpipe.io.lock import OutputBusy, OutputLock
from embedpipe.io.ownership import ManifestMismatch, OutputNotOwned
from embedpipe.models.resolve import ModelNotFound
from embedpipe.preflight import ModelError
from embedpipe.runtime import Encoder
from embedpipe.runtime.warmup import WarmupDivergence
from embedpipe.units import InputError, StorageError
from embedpipe.versions import RunFailed
from tests.conftest import free_port, split_corpus, write_job
from tests.model_helpers import save_tiny_text_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _embedpipe(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real CLI in a fresh process, as a scheduler runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "embedpipe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _one_line(stderr: str, prefix: str) -> str:
    """Exactly one `error:`/`interrupted:` line, the given one, and no traceback or signal dump."""
    lines = [line for line in stderr.splitlines() if line.startswith(("error:", "interrupted:"))]
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    assert "Traceback" not in stderr and "received at time" not in stderr, stderr
    return lines[0]


def _job(tmp_path: Path, input_path: str, **sections) -> Path:
    return write_job(tmp_path / "job.yaml", **{"input": {"path": input_path}, "model": {"path": MODEL},
                                               "output": {"path": str(tmp_path / "out")},
                                               "cluster": {"workers": 1, "cpus_per_worker": 1}, **sections})


# --------------------------------------------------------------------------- one code per kind

@pytest.mark.parametrize("cls, code, builtin", [
    (JobError, 2, ValueError), (ModelError, 2, ValueError), (ModelNotFound, 2, FileNotFoundError),
    (FactoryError, 2, ValueError), (IndexNotFound, 2, FileNotFoundError), (ManifestMismatch, 2, RuntimeError),
    (InputError, 3, ValueError), (StorageError, 3, ValueError),
    (UnitFailed, 4, RuntimeError), (NoWorkerPlaced, 4, RuntimeError), (NoWorkerStarted, 4, RuntimeError),
    (RunFailed, 4, RuntimeError),
    (WarmupDivergence, 4, RuntimeError), (CodeMismatch, 4, RuntimeError),
    (OutputBusy, 5, RuntimeError), (OutputNotOwned, 5, ManifestMismatch),
])
def test_every_error_carries_its_documented_code_and_keeps_its_base(cls, code, builtin):
    assert issubclass(cls, errors.EmbedpipeError) and issubclass(cls, builtin)
    assert cls.exit_code == code


def test_errors_is_the_bottom_layer():
    tree = ast.parse((ROOT / "embedpipe" / "errors.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.split(".")[0] == "embedpipe"]


@pytest.mark.parametrize("section, value", [("batching", {"max_tokens": -1}),
                                            ("model", {"path": "/nonexistent/model-folder"})])
def test_bad_job_exits_2(tmp_path, small_corpus, section, value):
    _, corpus = small_corpus
    result = _embedpipe("run", str(_job(tmp_path, str(corpus), **{section: value})), "--no-progress")
    assert result.returncode == 2, result.stderr
    _one_line(result.stderr, "error:")


def test_unreadable_local_input_exits_3(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"not a parquet file at all")
    result = _embedpipe("run", str(_job(tmp_path, str(tmp_path / "broken.parquet"))), "--no-progress")
    assert result.returncode == 3, result.stderr
    assert "broken.parquet" in _one_line(result.stderr, "error:")


def test_a_bad_row_found_by_a_worker_exits_3_in_its_own_words(tmp_path, ray_session):
    """Screened in the worker (preflight reads no texts): Ray's dotted type name does not lead the line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["hello world", None, "x"]}), tmp_path / "in.parquet")
    result = CliRunner().invoke(app, ["run", str(_job(tmp_path, str(tmp_path / "in.parquet"))), "--no-progress"])
    assert result.exit_code == 3, result.output
    line = _one_line(result.output, "error:")
    assert line.startswith(f"error: {tmp_path / 'in.parquet'} (unit ") and "id 'b' has a bad text (null)" in line, line
    assert "InputError" not in line, line


def test_unreachable_s3_endpoint_exits_3_naming_the_url_and_the_endpoint(tmp_path):
    pytest.importorskip("s3fs")
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "dummy",
           "AWS_SECRET_ACCESS_KEY": "dummy", "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard",
           "AWS_EC2_METADATA_DISABLED": "true"}
    started = time.monotonic()
    result = _embedpipe("run", str(_job(tmp_path, "s3://bucket/x.parquet")), "--no-progress", env=env)
    assert result.returncode == 3, result.stderr
    line = _one_line(result.stderr, "error: s3://bucket/x.parquet: cannot reach the store")
    assert "AWS_ENDPOINT_URL" in line
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("protocol, package", [("gs", "gcsfs"), ("az", "adlfs")])
def test_missing_fsspec_backend_exits_3_naming_the_package(tmp_path, protocol, package):
    try:
        __import__(package)
        pytest.skip(f"{package} is installed here: {protocol}:// has its backend")
    except ImportError:
        pass
    url = f"{protocol}://bucket/x.parquet"
    result = _embedpipe("run", str(_job(tmp_path, url)), "--no-progress")
    assert result.returncode == 3, result.stderr
    assert f"pip install {package}" in _one_line(result.stderr, f"error: {url}:")


def test_output_not_embedpipes_exits_5(tmp_path, small_corpus):
    _, corpus = small_corpus
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("mine")
    result = _embedpipe("run", str(_job(tmp_path, str(corpus))), "--no-progress")
    assert result.returncode == 5, result.stderr
    _one_line(result.stderr, "error:")
    assert (tmp_path / "out" / "thesis.tex").read_text() == "mine"


def test_output_held_by_a_live_run_exits_5(tmp_path, small_corpus):
    _, corpus = small_corpus
    with OutputLock(tmp_path / "out"):  # this live process holds it
        result = _embedpipe("run", str(_job(tmp_path, str(corpus))), "--no-progress")
    assert result.returncode == 5, result.stderr
    _one_line(result.stderr, "error:")


# --------------------------------------------------------------------------- signals mid-run

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def many_units(tmp_path_factory, quickstart_table):
    table = quickstart_table.slice(0, 600).select(["id", "text"])
    folder = tmp_path_factory.mktemp("signal_corpus")
    split_corpus(table, folder, files=2, row_group_size=10)  # 60 units of 10 rows: the run is long enough to stop
    return table, folder


def _records(out: Path) -> int:
    return len(list((out / "_manifest" / "units").glob("*.json")))


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, group, progress", [
    pytest.param(signal.SIGTERM, 143, False, "--no-progress", id="SIGTERM"),  # Kubernetes: to the container's process
    # Ctrl-C: to the whole group, its local Ray included; a terminal's user, with the progress bar shown (the driver's
    # stdout and stderr write above it until the signal stops the run: cluster/progress.py)
    pytest.param(signal.SIGINT, 130, True, "--progress", id="SIGINT"),
])
def test_a_signal_mid_run_stops_cleanly_and_the_rerun_resumes(tmp_path, many_units, tiny_model, ray_session,
                                                              signum, code, group, progress):
    table, folder = many_units
    out = tmp_path / "out"
    job = _job(tmp_path, str(folder), input={"path": str(folder), "unit_rows": 10}, model={"path": str(tiny_model)},
               batching={"max_tokens": 2048})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen([sys.executable, "-m", "embedpipe.cli", "run", str(job), progress], cwd=ROOT,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    deadline = time.time() + 300
    while _records(out) < 1 and time.time() < deadline and driver.poll() is None:
        time.sleep(0.05)
    assert driver.poll() is None, "the driver finished before it could be stopped"
    if group:
        os.killpg(driver.pid, signum)  # start_new_session: the driver leads its own group
    else:
        driver.send_signal(signum)
    _, stderr = driver.communicate(timeout=120)

    assert driver.returncode == code, stderr
    assert ("rows/s" in stderr) == (progress == "--progress"), stderr  # the bar was drawn, or not
    line = _one_line(stderr, "interrupted: rerun the same command to resume")
    done, total = map(int, re.search(r"\((\d+) of (\d+) units done\)", line).groups())
    assert total == 60 and 1 <= done == _records(out) < 60
    assert not (out / ".embedpipe.lock").exists()

    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])  # the same command again
    assert result.exit_code == 0, result.output
    assert f"{done} already done" in result.output
    vectors = ds.dataset(out / "vectors", format="parquet").to_table()
    ids = vectors["id"].to_pylist()
    assert len(ids) == len(set(ids)) == table.num_rows and set(ids) == set(table["id"].to_pylist())
    texts = dict(zip(table["id"].to_pylist(), table["text"].to_pylist()))
    want = Encoder.from_options(str(tiny_model)).embed([texts[i] for i in ids])
    np.testing.assert_allclose(np.asarray(vectors["embedding"].to_pylist(), dtype=np.float32), want, atol=2e-6)
