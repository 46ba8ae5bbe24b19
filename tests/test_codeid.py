"""A worker running other embedpipe code than its driver's fails the run (cluster/codeid.py): the identity itself,
the scheduler's refusal to retry it (real Ray actors), the run's other Ray work (the int8 calibration's sample on a
worker, the incremental diff's tasks, the index's shard workers) checking it too, and the real CLI started from a
folder holding another embedpipe/ package, which Ray puts first on its workers' import path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import embedpipe
from embedpipe.cluster.codeid import CodeId, CodeMismatch, check_same_code, code_id, this_code
from embedpipe.cluster.scheduler import Liveness, Scheduler, worker_actor
from embedpipe.units import Unit
from tests.conftest import write_job

PACKAGE = Path(embedpipe.__file__).resolve().parent
ray_pickle = pytest.importorskip("ray.cloudpickle")
ray_pickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import this test module


def _copy(folder: Path) -> Path:
    copy = folder / "embedpipe"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_same_sources_in_another_folder_are_the_same_code(tmp_path):
    copy = code_id(_copy(tmp_path), version="1.0")
    assert copy.digest == code_id(PACKAGE, version="1.0").digest and copy.where != str(PACKAGE)
    check_same_code(CodeId(version=this_code().version, digest=this_code().digest, where=str(tmp_path)),
                    who="worker 0", node="n")  # where it lies is not what it is


@pytest.mark.parametrize("change", ["a byte", "a new file", "a renamed file"])
def test_any_change_to_the_sources_is_other_code(tmp_path, change):
    copy = _copy(tmp_path)
    before = code_id(copy, version="1.0").digest
    if change == "a byte":
        with (copy / "cluster" / "worker.py").open("a") as f:
            f.write("\n")
    elif change == "a new file":
        (copy / "extra.py").write_text("")
    else:
        (copy / "units.py").rename(copy / "units2.py")
    assert code_id(copy, version="1.0").digest != before


def test_a_mismatch_names_both_installs_the_node_and_the_fix():
    other = CodeId(version="0.0.9", digest="0123456789ab", where="/elsewhere/embedpipe")
    with pytest.raises(CodeMismatch) as raised:
        check_same_code(other, who="worker 3", node="10.0.0.7/abcdef12")
    line = raised.value.line()
    assert raised.value.exit_code == 4
    for part in ("worker 3 on node 10.0.0.7/abcdef12", this_code().describe(), other.describe(),
                 "install the same embedpipe on every node", "working directory"):
        assert part in line, (part, line)
    version_only = CodeId(version="0.0.9", digest=this_code().digest, where=this_code().where)
    with pytest.raises(CodeMismatch):  # another version of the same sources is still another install
        check_same_code(version_only, who="worker 0", node="n")
    check_same_code(None, who="worker 0", node="n")  # None: not checked


class CheckingWorker:
    """The embedding worker's check, alone: process() checks the driver's code first, as EmbedWorker does, and logs
    each call it gets."""

    def __init__(self, log: str, code: CodeId):
        self.log, self.code = Path(log), code

    def process(self, unit: Unit, ahead: Unit | None = None) -> str:
        with self.log.open("a") as f:
            f.write(json.dumps({"unit": unit.id, "pid": os.getpid()}) + "\n")
        check_same_code(self.code, who="worker 0", node="test")
        return unit.id


@pytest.mark.slow
def test_the_scheduler_never_retries_a_worker_running_other_code(tmp_path, ray_session):
    log = tmp_path / "calls.jsonl"
    other = CodeId(version=this_code().version, digest="0" * 12, where="/elsewhere/embedpipe")
    actor_cls = worker_actor(CheckingWorker).options(num_cpus=0, max_restarts=0)
    scheduler = Scheduler(make_actor=lambda slot: actor_cls.remote(str(log), other), workers=1, max_attempts=3,
                          liveness=Liveness(unit_timeout_s=60, startup_timeout_s=60, placement_timeout_s=30))
    units = [Unit(id=f"00000-{i:05d}", file="corpus.parquet", row_groups=(i,), num_rows=10) for i in range(3)]
    with pytest.raises(CodeMismatch, match="/elsewhere/embedpipe"):
        list(scheduler.run(units))
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len({c["pid"] for c in calls}) == 1 and calls[0]["unit"] == units[0].id  # one worker, no replacement
    assert scheduler.retries == []


def _other_code() -> CodeId:
    return CodeId(version=this_code().version, digest="0" * 12, where="/elsewhere/embedpipe")


def _calibration(tmp_path: Path, corpus: Path, units: list) -> None:
    from embedpipe.cluster.calibrate import fit
    from embedpipe.cluster.connect import WorkerPlan
    from embedpipe.cluster.driver import _embed_on_workers, _worker_pool
    from embedpipe.config import load_job

    job = load_job(write_job(tmp_path / "job.yaml", input={"path": str(corpus)},
                             model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                             output={"path": str(tmp_path / "out"), "dtype": "int8"}))
    pool = _worker_pool(job, model=None, workers=WorkerPlan(workers=1, cpus_per_worker=1, gpus_per_worker=0),
                        code=_other_code(), count=1)  # the run's workers, as the driver makes them
    try:
        fit(job, units, embed=lambda texts: _embed_on_workers(pool, texts))
    finally:
        pool.stop()


def _diff(tmp_path: Path, corpus: Path, units: list) -> None:
    from embedpipe.cluster.diff import diff_on_ray
    from embedpipe.config import load_job

    job = load_job(write_job(tmp_path / "job.yaml", input={"path": str(corpus)},
                             model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                             output={"path": str(tmp_path / "out")}))
    diff_on_ray(job, units, parts=(), previous={}, code=_other_code())


def _shards(tmp_path: Path, corpus: Path, units: list) -> None:
    import faiss
    import numpy as np

    from embedpipe.cluster.connect import WorkerPlan
    from embedpipe.cluster.shards import shard_runner
    from embedpipe.config import ClusterConfig
    from embedpipe.index.ids import IdPlan
    from embedpipe.index.parts import Part
    from embedpipe.index.shard import ShardContext

    vectors = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(8), 8, 2)
    index.train(vectors)
    context = ShardContext(trained=faiss.serialize_index(index), ids=IdPlan(native=False, offsets={}),
                           queries=vectors[:4], width=2, metric="l2", shard_dir=str(tmp_path / "shards"))
    run = shard_runner(ClusterConfig(), WorkerPlan(workers=1, cpus_per_worker=1, gpus_per_worker=0),
                       code=_other_code())
    list(run(context, [Part(unit_id=u.id, path=str(tmp_path / f"{u.id}.parquet"), rows=u.num_rows) for u in units]))


@pytest.mark.slow
@pytest.mark.parametrize("work, who", [(_calibration, "the int8 calibration on worker 0"),
                                       (_diff, "an incremental diff task"), (_shards, "index shard worker 0")])
def test_the_runs_other_ray_work_checks_the_drivers_code(tmp_path, small_corpus, ray_session, work, who):
    """The calibration's ranges quantize every part, the diff decides which rows are reused, a shard is part of the
    index: each runs on a Ray worker, and each refuses other code than the driver's, in its own one line."""
    from embedpipe.units import plan_units

    _, corpus = small_corpus
    units = plan_units([str(corpus)], unit_rows=100)
    with pytest.raises(CodeMismatch) as raised:
        work(tmp_path, corpus, units)
    line = str(raised.value)
    assert line.startswith(f"{who} on node "), line  # its own words: not Ray's traceback
    assert "/elsewhere/embedpipe" in line and "Traceback" not in line, line
    assert [f for f in tmp_path.rglob("*") if f.is_file() and f.name != "job.yaml"] == []  # nothing written


@pytest.mark.slow
def test_a_run_started_beside_another_embedpipe_fails_before_writing_a_part(tmp_path, small_corpus):
    """The console script's driver imports the installed embedpipe; Ray puts the working directory, which holds
    a changed copy, first on its workers' path. The run stops at the first unit with exit code 4 and one line."""
    script = Path(sys.executable).with_name("embedpipe")
    if not script.exists():
        pytest.skip("no embedpipe console script beside this python")
    here = tmp_path / "here"
    here.mkdir()
    with (_copy(here) / "units.py").open("a") as f:
        f.write("# another tree\n")
    _, corpus = small_corpus
    job = write_job(tmp_path / "job.yaml", input={"path": str(corpus)},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                    output={"path": str(tmp_path / "out")}, cluster={"workers": 1, "cpus_per_worker": 1})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(script), "run", str(job), "--no-progress"], capture_output=True, text=True,
                          timeout=300, cwd=here, env=env)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 4 and len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("error: worker 0 on node "), errors[0]  # its own words: no type name, no traceback
    assert f"from {here.resolve() / 'embedpipe'} (code" in errors[0], errors[0]
    driver = f"the driver embedpipe {this_code().version} from "  # the console script's install, this tree's code
    assert driver in errors[0] and f"(code {this_code().digest})" in errors[0].split(driver)[1], errors[0]
    assert "Traceback" not in done.stderr
    assert not list((tmp_path / "out").rglob("*.parquet*"))  # no part, not even a temporary one
