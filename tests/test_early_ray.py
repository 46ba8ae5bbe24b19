"""Ray's start and the model's shipping beside preflight's duplicate-id scan (embedpipe/cluster/early.py)."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedpipe.cluster.driver import _expects_work
from embedpipe.config import parse_job

pytestmark = pytest.mark.slow

MODEL = "sentence-transformers/all-MiniLM-L6-v2"

# In a fresh interpreter (no Ray of the test session's): check_job, then scan_beside_ray on the job given as JSON
# with the given alone_s. connect is watched (the real one runs) to tell whether and where Ray was started.
BESIDE = """
import json, os, signal, sys, threading, time
import ray
import embedpipe.cluster.early as early
from embedpipe.config import parse_job
from embedpipe.io.manifest import model_fingerprint
from embedpipe.preflight import check_job, preflight

job = parse_job(json.loads(sys.argv[1]))
seen = {"scan threads": [], "SIGINT at start": repr(signal.getsignal(signal.SIGINT)),
        "blocked at start": sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, [])))}
connect, scan_ids = early.connect, early.scan_ids

INTERRUPT = sys.argv[3] == "interrupt"  # a SIGINT once Ray is up, the scan held until it is asked to stop
if INTERRUPT:  # a Ctrl-C's premise, whatever this process inherited: a run keeps an ignored SIGINT ignored (nohup)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
WORKERS = sys.argv[3] == "workers"  # the run's workers asked for beside the scan, as run_job asks for them


def scan_alive():
    return any(t.name == "embedpipe-id-scan" and t.is_alive() for t in threading.enumerate())


asked = threading.Event()


def start_workers(model):
    from embedpipe.cluster.driver import _workers_asked
    seen["scan alive when workers asked"] = scan_alive()
    try:
        return _workers_asked(job, model=model, units=len(checked.units))
    finally:
        asked.set()


def watched_disconnect(started):  # the workers' actors when Ray is shut down: ended first, or not
    from ray._private.state import actors  # the GCS's table (the embedded Ray serves no state API)
    deadline = time.monotonic() + 20
    while True:
        states = [a["State"] for a in actors().values() if a["ActorClassName"] == "EmbedWorker"]
        if all(state == "DEAD" for state in states) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    seen["worker actors at disconnect"] = states
    return disconnect(started)

def watched_connect(cfg):
    seen["connect on main thread"] = threading.current_thread() is threading.main_thread()
    seen["started"] = connect(cfg)
    if INTERRUPT:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
    return seen["started"]

def watched_scan(checked, **kwargs):
    seen["scan threads"].append(threading.current_thread().name)
    if INTERRUPT:  # a scan still at its start when the interrupt comes; on at once if it is never asked to stop
        seen["scan asked to stop"] = kwargs["stop"].wait(30)
    if WORKERS:  # a scan that outlasts the workers' asking
        asked.wait(120)
    try:
        return scan_ids(checked, **kwargs)
    except BaseException as exc:
        seen["scan ended by"] = type(exc).__name__
        raise

early.connect, early.scan_ids = watched_connect, watched_scan
disconnect = early.disconnect
if WORKERS:
    early.disconnect = watched_disconnect
checked = check_job(job, workers=2)
try:
    plan, up = early.scan_beside_ray(checked, alone_s=float(sys.argv[2]),
                                     start_workers=start_workers if WORKERS else None)
except BaseException as exc:
    seen["error"] = f"{type(exc).__name__}: {exc}"
    seen["scan alive"] = scan_alive()
else:
    alone = preflight(job, workers=2)
    seen["same plan"] = (plan.units == alone.units and plan.duplicate_rows == alone.duplicate_rows
                         and plan.model == alone.model and plan.files == alone.files)
    seen["ray up"] = ray.is_initialized()
    if up is not None:
        seen["early started"] = up.started
        seen["model shipped"] = up.model.sha256 == model_fingerprint(plan.model.dir)
        seen["chunks readable"] = ray.get(up.model.chunks[0][0])[:1] != b""
        if up.workers is not None:
            seen["workers asked"] = [slot.index for slot in up.workers._slots if slot.actor is not None]
        up.close()
seen["ray up after"] = ray.is_initialized()
print("RESULT " + json.dumps(seen))
"""


def _beside(raw: dict, *, alone_s: float = 0.0, interrupt: bool = False, workers: bool = False) -> dict:
    """What scan_beside_ray did; ``alone_s`` 0: Ray is started beside any scan, however short. ``workers``: the
    run's workers asked for beside the scan, which waits for them."""
    mode = "interrupt" if interrupt else "workers" if workers else "-"
    return _result(BESIDE, json.dumps(raw), str(alone_s), mode, timeout=240)


def _result(script: str, *args: str, timeout: float) -> dict:
    """What ``script`` saw, run in a fresh interpreter with ``args``: its ``RESULT {json}`` line."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def _corpus(tmp_path, *files: list[str]) -> str:
    tmp_path.mkdir(exist_ok=True)
    for i, ids in enumerate(files):
        pq.write_table(pa.table({"id": ids, "text": [f"paragraph {i} {x}" for x in ids]}), tmp_path / f"{i}.parquet")
    return str(tmp_path / "*.parquet")


def _raw(tmp_path, data: str, **input_options) -> dict:
    return {"input": {"path": data, **input_options}, "model": {"path": MODEL},
            "output": {"path": str(tmp_path / "out")}, "cluster": {"workers": 2}}


def test_the_scan_runs_beside_ray_and_gives_preflights_plan(tmp_path):
    """A scan that outlasts alone_s (0 here): Ray is started on the main thread while the scan runs on its own; the
    plan is preflight's own, keep_first's dropped rows included, and the model is in the object store, under its
    fingerprint."""
    data = _corpus(tmp_path, ["a", "b", "c"], ["d", "b", "e"])
    seen = _beside(_raw(tmp_path, data, on_duplicate_id="keep_first"))
    assert "error" not in seen, seen
    assert seen["scan threads"] == ["embedpipe-id-scan"] and seen["connect on main thread"], seen
    assert seen["started"] is True and seen["early started"] is True and seen["ray up"], seen
    assert seen["same plan"] and seen["model shipped"] and seen["chunks readable"], seen
    assert seen["ray up after"] is False, seen


def test_a_failed_scan_shuts_the_ray_it_started_down_and_raises_its_own_error(tmp_path):
    """Duplicate ids under on_duplicate_id: error: preflight's one line, after the Ray started beside the scan is
    shut down."""
    data = _corpus(tmp_path, ["a", "b", "c"], ["d", "b", "a"])
    seen = _beside(_raw(tmp_path, data))
    assert seen["started"] is True, seen  # Ray was up beside the scan
    assert seen["error"].startswith("InputError: 2 rows repeat an id seen earlier"), seen
    assert "on_duplicate_id: keep_first" in seen["error"], seen
    assert seen["ray up after"] is False, seen


def test_an_interrupt_beside_the_scan_stops_the_scan_and_shuts_ray_down_before_it_goes_on(tmp_path):
    """A Ctrl-C once Ray is up and the scan still runs: the scan stops at its next unit and has ended, Ray is shut
    down, then the KeyboardInterrupt goes on (no thread left reading while the interpreter exits: it exits 0 here,
    where a reading thread at exit had aborted the CLI with 134)."""
    data = _corpus(tmp_path, ["a", "b", "c"], ["d", "e"])
    seen = _beside(_raw(tmp_path, data), interrupt=True)
    assert seen["started"] is True and seen.get("error", "").startswith("KeyboardInterrupt"), seen
    assert seen["scan ended by"] == "ScanStopped" and seen["scan alive"] is False, seen
    assert seen["ray up after"] is False, seen


def test_the_runs_workers_are_asked_for_beside_the_scan_and_ended_when_it_fails(tmp_path):
    """With start_workers: the run's workers (one per planned worker, none beyond the units) are asked for while
    the scan still runs (held here until they are), and handed over with Ray. A scan that fails ends them before
    Ray is shut down."""
    good = _corpus(tmp_path / "good", ["a", "b", "c"], ["d", "e"])
    seen = _beside(_raw(tmp_path, good), workers=True)
    assert "error" not in seen and seen["same plan"], seen
    assert seen["scan alive when workers asked"] is True and seen["workers asked"] == [0, 1], seen
    assert seen["worker actors at disconnect"] == ["DEAD", "DEAD"], seen  # close() ended them, then Ray
    bad = _corpus(tmp_path / "bad", ["a", "b"], ["b"])
    seen = _beside(_raw(tmp_path / "bad", bad), workers=True)
    assert seen["error"].startswith("InputError: 1 rows repeat an id"), seen
    assert seen["scan alive when workers asked"] is True, seen
    assert seen["worker actors at disconnect"] == ["DEAD", "DEAD"], seen
    assert seen["ray up after"] is False, seen


def test_a_short_scan_starts_nothing_beside_it_and_fails_as_fast_as_before(tmp_path):
    """A scan done within alone_s: no Ray started (the run connects itself, as it did before), and a bad input's
    error comes without a Ray started for it."""
    good = _corpus(tmp_path / "good", ["a", "b", "c"], ["d", "e"])
    seen = _beside(_raw(tmp_path, good), alone_s=60.0)
    assert "started" not in seen and seen["same plan"] and not seen["ray up"], seen
    bad = _corpus(tmp_path / "bad", ["a", "b"], ["b"])
    seen = _beside(_raw(tmp_path, bad), alone_s=60.0)
    assert "started" not in seen and seen["error"].startswith("InputError: 1 rows repeat an id"), seen


def test_ray_is_started_beside_the_scan_only_where_the_run_will_want_it(tmp_path):
    """A new output, an unfinished one, an overwrite and every versioned run: yes. A finished output (its
    report.json written) run again finds nothing to do: no Ray for it."""
    out, data = tmp_path / "out", _corpus(tmp_path, ["a"])
    job = parse_job({"input": {"path": data}, "model": {"path": MODEL}, "output": {"path": str(out)}})
    assert _expects_work(job, overwrite=False)  # no output yet
    out.mkdir()
    (out / "_manifest").mkdir()
    assert _expects_work(job, overwrite=False)  # a run to resume: no report yet
    (out / "report.json").write_text("{}")
    assert not _expects_work(job, overwrite=False)
    assert _expects_work(job, overwrite=True)
    versioned = parse_job({"input": {"path": data}, "model": {"path": MODEL},
                           "output": {"path": str(out), "versioned": True}})
    assert _expects_work(versioned, overwrite=False)


# In a fresh interpreter: run_job on the job given as JSON, its id scan held until the run's workers have been asked
# for beside it ("early"), or as it comes ("plain": a scan this short starts nothing beside it).
RUN = """
import json, sys, threading
import embedpipe.cluster.driver as driver
import embedpipe.cluster.early as early
from embedpipe.config import parse_job

job, mode = parse_job(json.loads(sys.argv[1])), sys.argv[2]
seen = {"pools": 0}
asked = threading.Event()
workers_asked, worker_pool, scan_ids = driver._workers_asked, driver._worker_pool, early.scan_ids

def watched_asked(*args, **kwargs):
    seen["scan alive when workers asked"] = any(t.name == "embedpipe-id-scan" and t.is_alive()
                                                for t in threading.enumerate())
    try:
        return workers_asked(*args, **kwargs)
    finally:
        asked.set()

def counted_pool(*args, **kwargs):
    seen["pools"] += 1
    return worker_pool(*args, **kwargs)

def held_scan(checked, **kwargs):
    asked.wait(120)
    return scan_ids(checked, **kwargs)

driver._worker_pool = counted_pool
if mode == "early":
    driver._workers_asked, early.scan_ids = watched_asked, held_scan
result = driver.run_job(job, progress=False)
seen["rows"], seen["workers"] = result.report["rows"], result.report["workers"]
seen["failed starts"] = result.report["units"]["failed_starts"]
seen["incremental"] = result.report.get("incremental")
print("RESULT " + json.dumps(seen))
"""


def _run(raw: dict, mode: str) -> dict:
    return _result(RUN, json.dumps(raw), mode, timeout=300)


def _vectors(out) -> pa.Table:
    return pq.read_table(out / "vectors" if (out / "vectors").exists() else out).sort_by("id")


@pytest.mark.parametrize("output", [{}, {"versioned": True}, {"dtype": "int8", "calibration_rows": 60}],
                         ids=["plain", "versioned", "int8"])
def test_a_run_whose_workers_started_beside_the_scan_writes_what_a_run_without_them_writes(tmp_path, output):
    """The run takes the workers asked for beside its scan (no second pool), gives them its settings, and writes
    the same vectors, bit for bit, as a run that started its workers after the scan: into the version's folder
    when versioned; int8 with the same calibration, its sample embedded by those workers."""
    versioned = output.get("versioned", False)
    data = _corpus(tmp_path / "in", [f"a{i}" for i in range(40)], [f"b{i}" for i in range(40)],
                   [f"c{i}" for i in range(40)])
    outputs = {}
    for mode in ("early", "plain"):
        raw = _raw(tmp_path, data)
        raw["output"] = {"path": str(tmp_path / mode), **output}
        seen = _run(raw, mode)
        assert seen["rows"] == 120 and seen["workers"] == 2 and seen["failed starts"] == [], seen
        assert seen["pools"] == 1, seen  # the early run used the workers asked for beside its scan
        if mode == "early":
            assert seen["scan alive when workers asked"] is True, seen
        else:
            assert "scan alive when workers asked" not in seen, seen
        root = tmp_path / mode
        outputs[mode] = _vectors(root / "versions" / (root / "CURRENT").read_text().strip() if versioned else root)
    assert outputs["early"].num_rows == 120 and outputs["early"].equals(outputs["plain"])
    if "dtype" in output:
        records = [json.loads((tmp_path / mode / "quantization.json").read_text()) for mode in ("early", "plain")]
        assert records[0]["calibration"]["rows"] == 60 and records[0] == records[1], records


def test_an_incremental_night_runs_its_diff_beside_the_workers_asked_for_beside_its_scan(tmp_path):
    """Night 2 of an incremental output: its workers, asked for beside the scan, hold the embedded Ray's CPUs (2
    workers splitting them: every CPU on an even count, as on CI's two cores) until their first unit, and the
    night's diff runs its Ray tasks on those CPUs meanwhile (they ask for none; asking for one they would never be
    placed, and the run would hang). It reuses and encodes what a night whose workers started after its scan does,
    and writes the same vectors."""
    folder = tmp_path / "in"
    ids = [[f"{name}{i}" for i in range(40)] for name in "abc"]
    data = _corpus(folder, *ids)
    raw = {mode: {**_raw(tmp_path, data), "output": {"path": str(tmp_path / mode), "versioned": True,
                                                     "incremental": True}} for mode in ("early", "plain")}
    for mode in ("early", "plain"):
        assert _run(raw[mode], mode)["rows"] == 120
    revised = [f"paragraph 1 {x}" + (" (revised)" if i % 2 else "") for i, x in enumerate(ids[1])]
    pq.write_table(pa.table({"id": ids[1], "text": revised}), folder / "1.parquet")
    outputs, nights = {}, {}
    for mode in ("early", "plain"):
        seen = _run(raw[mode], mode)
        assert seen["rows"] == 120 and seen["pools"] == 1 and seen["failed starts"] == [], seen
        assert seen.get("scan alive when workers asked") is (True if mode == "early" else None), seen
        nights[mode] = {k: seen["incremental"][k] for k in ("reused", "encoded", "dropped")}
        assert seen["incremental"]["diff"]["looked_up"] == 120, seen
        root = tmp_path / mode
        outputs[mode] = _vectors(root / "versions" / (root / "CURRENT").read_text().strip())
    assert nights["early"] == nights["plain"] == {"reused": 100, "encoded": 20, "dropped": 0}, nights
    assert outputs["early"].num_rows == 120 and outputs["early"].equals(outputs["plain"])
