"""CLI conventions through the real `embedpipe` command: --version, -q/-v on every command, plain help, an
embedded run that prints no Ray or FAISS warning at the default level (their notices show with -v), and a warning
written on a line of its own above the progress bar."""

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import embedpipe
from embedpipe.cli import _logging
from embedpipe.cluster.progress import progress_bar
from tests.conftest import QUICKSTART, ROOT, write_job
from tests.model_helpers import save_tiny_text_model

COMMANDS = ("run", "validate", "search", "report")
RAY_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(WARNING|INFO|ERROR)")  # Ray's own logger format


def _embedpipe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env |= {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "embedpipe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_version():
    result = _embedpipe("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"embedpipe {embedpipe.__version__}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_quiet_and_verbose_and_its_help_has_no_placeholders(command):
    result = _embedpipe(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "-q, --quiet" in result.stdout and "-v, --verbose" in result.stdout
    assert "<bool>" not in result.stdout


@pytest.fixture(scope="module")
def small_job(tmp_path_factory) -> Path:
    """300 real rows, a tiny model, and an index whose k-means has too few points (FAISS warns about it)."""
    folder = tmp_path_factory.mktemp("flags")
    corpus = folder / "small.parquet"
    pq.write_table(pq.read_table(QUICKSTART).slice(0, 300).select(["id", "text"]), corpus)
    model = save_tiny_text_model(folder / "tiny")
    return write_job(folder / "job.yaml", input={"path": str(corpus)}, model={"path": str(model)},
                     output={"path": str(folder / "out"), "format": "both", "index": "IVF16,PQ8x4"},
                     cluster={"workers": 1, "cpus_per_worker": 1})


def _noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if RAY_LOG_LINE.match(line) or "Token authentication" in line or "WARNING clustering" in line]


@pytest.mark.slow
def test_an_embedded_run_prints_no_ray_or_faiss_warning_unless_verbose(small_job, tmp_path):
    quiet = _embedpipe("run", str(small_job), "--no-progress", "--overwrite", timeout=600)
    assert quiet.returncode == 0, quiet.stderr
    assert _noise(quiet.stderr) == [], quiet.stderr
    loud = _embedpipe("run", str(small_job), "--no-progress", "--overwrite", "-v", timeout=600)
    assert loud.returncode == 0, loud.stderr
    assert any("WARNING clustering" in line for line in _noise(loud.stderr)), loud.stderr  # the probe sees them
    assert "INFO embedpipe" in loud.stderr  # embedpipe's own info lines


def test_quiet_still_prints_the_error(tmp_path, small_job):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("mine")
    job = write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)}, model={"path": str(small_job.parent / "tiny")},
                    output={"path": str(tmp_path / "out")})
    result = _embedpipe("run", str(job), "-q", "--no-progress")
    assert result.returncode == 5 and result.stderr.startswith("error: "), result.stderr


def test_a_warning_during_a_run_is_a_line_above_the_progress_bar_not_in_it(capsys):
    _logging(verbose=0, quiet=False)
    with progress_bar(total=3, desc="quickstart", enabled=True) as bar:  # the driver's bar (stderr)
        bar.update(1)
        logging.getLogger("embedpipe.cluster.scheduler").warning("worker 0 failed to start (1 of 3 in a row)")
    pieces = re.split(r"[\r\n]", capsys.readouterr().err)  # what a terminal shows: \r returns to the line's start
    assert "worker 0 failed to start (1 of 3 in a row)" in pieces, pieces  # its own line, not after the bar's text


def test_a_run_keeps_stdout_for_its_report(small_job, ray_session, capsys):
    """What Ray prints on the driver's stdout while a job runs (a worker's own stdout, the raylet's "A worker died"
    errors) goes to stderr with the run's other diagnostics: stdout holds the report alone. A chattering actor of
    this driver's Ray job stands in for them (Ray forwards its lines to sys.stdout as it is when they arrive)."""
    import threading

    from typer.testing import CliRunner

    from embedpipe.cli import app

    @ray_session.remote(num_cpus=0, max_concurrency=2)
    class Chatter:
        def __init__(self) -> None:
            self.quiet = threading.Event()

        def talk(self) -> None:
            while not self.quiet.wait(0.05):
                print("chatter from a worker of this job", flush=True)  # digit-free: Ray's dedup drops digits

        def stop(self) -> None:
            self.quiet.set()

    chatter = Chatter.remote()
    talking = chatter.talk.remote()
    deadline = time.monotonic() + 60
    while "chatter from a worker" not in capsys.readouterr().out:  # Ray forwards its lines before the run starts
        assert time.monotonic() < deadline, "Ray forwarded no line of the actor's in 60 s"
        time.sleep(0.05)
    try:
        result = CliRunner().invoke(app, ["run", str(small_job), "--no-progress", "--overwrite"])
    finally:
        ray_session.get(chatter.stop.remote())
        ray_session.get(talking)
        ray_session.kill(chatter)  # its worker process goes back: the session's Ray outlives this test
    assert result.exit_code == 0, result.output
    assert "chatter from a worker" in result.stderr, result.stdout  # during the run: stderr, not stdout
    # then the report. Lines that reach this shared Ray's driver once run_job has returned still go to stdout, the
    # actor's last ones among them (an embedded Ray is shut down by then: a plain `embedpipe run` has none)
    report = [line for line in result.stdout.splitlines() if "chatter from a worker" not in line]
    assert report[0].startswith("300 rows, ") and report[-1].startswith("report: "), result.stdout
