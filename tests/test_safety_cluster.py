"""Scheduler liveness and failure messages: a stopped worker and a lost node with no spare CPU on
a real Ray (never a hang), the deadline derivation and the disk-error message as plain unit tests.

The lost-node runs need their own multi-node Ray (``ray.cluster_utils.Cluster``), so they run in a
subprocess: this module is also the script (``python -m tests.test_safety_cluster``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import ray.exceptions as rex

from embedpipe.cluster.scheduler import Liveness, disk_problem, failure_message, unit_deadline
from embedpipe.config import ClusterConfig
from embedpipe.errors import remote_message
from embedpipe.units import InputError
from tests.conftest import ROOT, free_port, write_job
from tests.test_reliability import corpus  # noqa: F401 - the same fixture: 600 rows, 20 units of 30

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


# --------------------------------------------------------------------------- the deadline (no Ray)

def test_unit_deadline_derivation():
    lv = Liveness(unit_timeout_s=None, startup_timeout_s=50.0, placement_timeout_s=5.0, floor_s=2.0, factor=4.0)
    assert unit_deadline(lv, rows=100, slowest_s_per_row=None) == 50.0  # nothing finished yet: the startup bound
    assert unit_deadline(lv, rows=100, slowest_s_per_row=0.01) == pytest.approx(4.0)  # 4 x 0.01 s/row x 100 rows
    assert unit_deadline(lv, rows=1000, slowest_s_per_row=0.01) == pytest.approx(40.0)  # scales with the rows
    assert unit_deadline(lv, rows=10, slowest_s_per_row=0.01) == 2.0  # never below the floor
    fixed = replace(lv, unit_timeout_s=7.0)  # the override wins, observed or not
    assert unit_deadline(fixed, rows=100, slowest_s_per_row=None) == 7.0
    assert unit_deadline(fixed, rows=9, slowest_s_per_row=1.0) == 7.0


def test_liveness_defaults_come_from_the_job_schema():
    lv = Liveness.from_config(ClusterConfig())
    assert (lv.unit_timeout_s, lv.startup_timeout_s, lv.placement_timeout_s) == (None, 1800.0, 60.0)
    assert unit_deadline(lv, rows=10_000, slowest_s_per_row=0.005) == pytest.approx(200.0)  # 4 x 50 s
    assert unit_deadline(lv, rows=100, slowest_s_per_row=0.005) == 120.0  # the 120 s floor


# --------------------------------------------------------------------------- the failure message (no Ray)

def _as_ray_task_error(exc: BaseException) -> BaseException:
    """The worker's exception as the driver receives it: RayTaskError subclassing its type."""
    try:
        raise exc
    except type(exc) as raised:
        return rex.RayTaskError("process", traceback.format_exc(), raised).as_instanceof_cause()


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "is full"), (errno.EDQUOT, "over its quota"),
                                         (errno.EROFS, "is read-only")])
def test_disk_errors_say_free_space_and_rerun(code, words):
    part = "/data/out/vectors/.part-00003.parquet.tmp"
    for exc in (OSError(code, os.strerror(code), part), _as_ray_task_error(OSError(code, os.strerror(code), part))):
        message = disk_problem(exc)
        assert message is not None and words in message and part in message
        assert "rerun the same command to resume" in message
        assert "skip_unit" not in message and "remove that file" not in message


def test_disk_full_read_from_the_message_when_the_cause_is_lost():
    line = "OSError: [Errno 28] No space left on device: '/data/out/vectors/.part-1.tmp'"
    message = disk_problem(RuntimeError(f"Traceback (most recent call last):\n  ...\n{line}"))
    assert message is not None and "is full" in message and "rerun the same command" in message


def test_other_errors_keep_naming_the_file():
    missing = _as_ray_task_error(FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/in/a.parquet"))
    assert disk_problem(missing) is None
    text = failure_message("unit 00001 (/data/in/a.parquet, rows 0..29)", attempts=3, cause="error",
                           error="FileNotFoundError: [Errno 2] No such file or directory: '/data/in/a.parquet'")
    assert "/data/in/a.parquet" in text and "fix or remove that file" in text and "cluster.on_error: skip_unit" in text
    stalled = failure_message("unit 00001", attempts=3, cause="timeout",
                              error="its worker did not finish it within 9 s")
    assert "cluster.unit_timeout_s" in stalled and "remove that file" not in stalled


def test_an_input_error_raised_in_a_worker_keeps_its_own_words():
    line = "bad row 3 of /data/in/a.parquet: empty text; set input.on_bad_row: skip"
    assert remote_message(_as_ray_task_error(InputError(line))) == line  # not "embedpipe.errors.InputError: ..."
    assert remote_message(_as_ray_task_error(ValueError("x"))) == "ValueError: x"  # others keep their type's name


def test_a_failed_start_keeps_its_own_words_from_rays_text():
    """An actor's ``__init__`` error reaches the driver as Ray's ActorDiedError, which keeps only its text (the
    scheduler's ``worker_actor`` hands its own workers' errors over whole; this is the text-only case)."""
    from embedpipe.models.cache import ModelCacheError

    line = "model cache /c/models/ab: cannot write the model there: point EMBEDPIPE_CACHE_DIR at a writable disk"

    def died_starting(exc: BaseException) -> rex.ActorDiedError:
        try:
            raise exc
        except type(exc) as raised:
            return rex.ActorDiedError.from_task_error(rex.RayTaskError("__init__", traceback.format_exc(), raised,
                                                                       actor_id="ab" * 16))

    died = died_starting(ModelCacheError(line))
    assert died.actor_init_failed and getattr(died, "cause", None) is None  # the text is all there is
    assert remote_message(died) == line  # not "embedpipe.models.cache.ModelCacheError: ..."
    assert remote_message(died_starting(OSError("disk"))) == "OSError: disk"  # others keep their type's name


def test_a_dead_workers_line_says_what_happened_without_rays_general_advice(ray_session):
    """A worker killed mid-call: Ray's ActorDiedError, whose text goes on with advice for any Ray cluster (its OOM
    killer and ``--enable-resource-isolation`` paragraph); the driver's line keeps what happened."""

    @ray_session.remote(num_cpus=0)
    class Sleeper:
        def pid(self) -> int:
            return os.getpid()

        def sleep(self) -> None:
            time.sleep(60)

    sleeper = Sleeper.remote()
    pid = ray_session.get(sleeper.pid.remote())
    call = sleeper.sleep.remote()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(rex.ActorDiedError) as died:
        ray_session.get(call, timeout=60)
    assert "Some common causes include" in str(died.value)  # Ray's own text, as of Ray 2.60: what is cut
    line = remote_message(died.value)
    assert line.startswith("The actor is dead because its worker process has died.") and "Worker exit type" in line
    assert "common causes" not in line and "resource-isolation" not in line and "\n" not in line


# --------------------------------------------------------------------------- a stopped worker (local Ray)

@pytest.fixture(scope="module")
def encoder():
    from embedpipe.runtime import Encoder

    return Encoder.from_options(MODEL)


def _job(tmp_path: Path, folder: Path, **cluster) -> Path:
    return write_job(tmp_path / "job.yaml", input={"path": str(folder), "unit_rows": 30}, model={"path": MODEL},
                     batching={"max_tokens": 2048}, output={"path": str(tmp_path / "out")},
                     cluster={"workers": 2, "cpus_per_worker": 1, **cluster})


@pytest.mark.slow
def test_sigstopped_worker_is_replaced(tmp_path, corpus, ray_session, encoder, caplog):
    from embedpipe.config import load_job
    from tests.test_reliability import _assert_exact, _run_and_signal_a_worker

    table, folder = corpus
    caplog.set_level(logging.WARNING, logger="embedpipe.cluster.scheduler")
    runner, outcome, victim = _run_and_signal_a_worker(load_job(_job(tmp_path, folder, unit_timeout_s=10)),
                                                       tmp_path / "out", signal.SIGSTOP)
    try:
        runner.join(timeout=180)
        assert not runner.is_alive(), "the run waits on the stopped worker"
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):  # never leave a stopped process behind
            try:
                os.kill(victim, sig)
            except ProcessLookupError:
                pass
        runner.join(timeout=120)
    report = outcome["result"].report
    assert report["units"]["retried"] >= 1 and report["units"]["failed"] == 0
    assert report["units"]["encoded"] == report["units"]["total"] == 20
    assert "worker stalled" in caplog.text
    _assert_exact(tmp_path / "out", table, encoder)


# --------------------------------------------------------------------------- a lost node (multi-node Ray)

@pytest.fixture(scope="module")
def lost_nodes(tmp_path_factory, corpus):  # noqa: F811 - the imported fixture
    """Both lost-node runs on one cluster (a head without CPUs and two one-CPU nodes), in a subprocess, bounded:
    "survivor" (2 workers, a node removed mid-run: it finishes on the other), then "last" (1 worker on the node
    left, removed mid-run: nothing can be placed). {name: its JSON answer plus the stderr, its work folder}."""
    _, folder = corpus
    work = {name: tmp_path_factory.mktemp(name) for name in ("survivor", "last")}
    jobs = [_job(work["survivor"], folder, workers=2, placement_timeout_s=5),
            _job(work["last"], folder, workers=1, placement_timeout_s=5)]
    cmd = [sys.executable, "-m", "tests.test_safety_cluster", *map(str, jobs)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the driver and its Ray nodes
        out, err = proc.communicate()
        pytest.fail(f"a run hung after its node was removed; stderr tail: {err[-3000:]}")
    answers = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    assert len(answers) == 2, f"no answer (rc {proc.returncode}); stderr tail: {err[-3000:]}"
    return {name: ({**answer, "stderr": err}, work[name]) for name, answer in zip(("survivor", "last"), answers)}


@pytest.mark.slow
def test_lost_node_without_spare_cpu_finishes_on_the_survivor(lost_nodes, corpus, encoder):  # noqa: F811
    from tests.test_reliability import _assert_exact

    table, _ = corpus
    answer, work = lost_nodes["survivor"]
    assert answer["exit_code"] == 0, answer["output"] + answer["stderr"][-3000:]
    report = json.loads((work / "out" / "report.json").read_text())
    assert report["units"]["encoded"] == report["units"]["total"] == 20 and report["units"]["failed"] == 0
    assert "given up: Ray could not place it within 5 s" in answer["output"] + answer["stderr"]  # the CLI's log lines
    _assert_exact(work / "out", table, encoder)


@pytest.mark.slow
def test_lost_last_node_fails_naming_the_resources(lost_nodes):
    answer, _ = lost_nodes["last"]
    assert answer["exit_code"] == 4, answer["output"] + answer["stderr"][-3000:]
    assert "no worker could be placed for 5 s: the cluster has 0 CPUs / 0 GPUs free" in answer["output"]
    assert "each worker needs 1 CPU (cluster.cpus_per_worker=1)" in answer["output"]


def _main(job_files: list[str]) -> None:
    """Head without CPUs plus one one-CPU node per job; run the jobs through the CLI one after the other, each
    removing one node once two of its units are done; print {exit_code, output} per job, each on its own line."""
    import ray
    from ray.cluster_utils import Cluster
    from typer.testing import CliRunner

    from embedpipe.cli import app
    from embedpipe.config import load_job
    from tests.test_reliability import _records

    logging.basicConfig(level=logging.WARNING)
    cluster = Cluster(initialize_head=True, head_node_args={  # a free dashboard port: the other test process's Ray
        "num_cpus": 0, "dashboard_port": free_port(),
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    workers = [cluster.add_node(num_cpus=1) for _ in job_files]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    try:
        for job_file in job_files:
            out = Path(load_job(Path(job_file)).output.path)

            def remove_a_node(out: Path = out) -> None:
                while _records(out) < 2:
                    time.sleep(0.05)
                cluster.remove_node(workers.pop(), allow_graceful=False)

            remover = threading.Thread(target=remove_a_node, daemon=True)
            remover.start()
            result = CliRunner().invoke(app, ["run", job_file, "--no-progress"])
            remover.join(timeout=60)
            print(json.dumps({"exit_code": result.exit_code, "output": result.output}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    _main(sys.argv[1:])
