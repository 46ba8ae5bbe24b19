"""Several Ray nodes (``ray.cluster_utils.Cluster``, all on this machine): the model reaches every node
through the object store, and a node lost mid-run costs its units' attempts, never a row.

One cluster for the module: a head with 1 CPU and two 1-CPU nodes, each node with its own model cache
(``EMBEDPIPE_CACHE_DIR`` set per raylet). It runs in a subprocess (this module is also the script:
``python -m tests.test_multinode WORK``), never beside the session's ``ray_session`` Ray. Two jobs run
through the real CLI with ``cluster.address`` set to the cluster's address:

- A (float32): the model is a copy of MiniLM in a tmp folder; a hook renames that folder away as soon
  as the driver has put it in the object store, so a worker that read ``model.path`` would fail.
- B (int8: a worker embeds the calibration's sample, with the model's folder renamed away as well): once two
  units are done, the node of the worker about to be handed the next unit is removed, and the
  unit handed to its dead worker (from the driver's loop).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tests.conftest import ROOT, free_port, write_job
from tests.test_reliability import corpus  # noqa: F401 - the same fixture: 600 rows, 2 files, 20 units of 30

pytestmark = pytest.mark.slow
MOVED = ".shipped"  # the suffix the hook renames a model folder to, once the driver has shipped it


def _job(work: Path, name: str, folder: Path, model: Path, **output) -> Path:
    return write_job(work / f"{name}.yaml", name=name, input={"path": str(folder), "unit_rows": 30},
                     model={"path": str(model)}, batching={"max_tokens": 2048},
                     # pinned: the vectors are compared bit for bit with the reference's, and these "machines" are
                     # raylets with caches of their own on one busy machine, where cpu_linears: auto could measure
                     # differently on each
                     runtime={"cpu_linears": "onednn"},
                     output={"path": str(work / f"out_{name}"), **output},
                     cluster={"address": "ADDRESS", "workers": 2, "cpus_per_worker": 1, "placement_timeout_s": 30})


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, corpus, minilm_dir):  # noqa: F811 - the imported fixture
    """Run both jobs on one 3-node cluster in a subprocess; its JSON answer, the work folder."""
    _, folder = corpus
    work = tmp_path_factory.mktemp("multinode")
    for name in ("a", "b"):
        shutil.copytree(minilm_dir, work / f"model_{name}")  # a folder only the driver has
    _job(work, "a", folder, work / "model_a")
    _job(work, "b", folder, work / "model_b", dtype="int8")
    cmd = [sys.executable, "-m", "tests.test_multinode", str(work)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EMBEDPIPE_CACHE_DIR": str(work / "cache" / "driver")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the driver and its Ray nodes
        out, err = proc.communicate()
        pytest.fail(f"the multi-node run hung; stderr tail: {err[-3000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"no answer (rc {proc.returncode}); stderr tail: {err[-3000:]}"
    answer = json.loads(lines[-1])
    for name in ("a", "b"):
        assert answer[name]["exit_code"] == 0, answer[name]["output"] + err[-3000:]
    assert answer["b"]["removed"], "job B finished before a node could be removed"
    return answer, work


def _reference(folder: Path, model: Path, work: Path) -> dict:
    """{id: float32 vector} of a local run: each 30-row unit embedded alone with the workers' settings
    (same texts per call, one thread), so the vectors are the workers' bit for bit."""
    import torch

    from embedpipe.config import load_job
    from embedpipe.runtime import Encoder

    threads = torch.get_num_threads()
    encoder = Encoder.from_job(load_job(_job(work, "ref", folder, model)), threads=1)
    out = {}
    try:
        for path in sorted(folder.glob("*.parquet")):
            file = pq.ParquetFile(path)
            for g in range(file.num_row_groups):
                unit = file.read_row_group(g, columns=["id", "text"])
                out.update(zip(unit["id"].to_pylist(), encoder.embed(unit["text"].to_pylist())))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def reference(corpus, minilm_dir, tmp_path_factory):  # noqa: F811
    return _reference(corpus[1], minilm_dir, tmp_path_factory.mktemp("reference"))


def _vectors(out: Path) -> tuple[list, np.ndarray]:
    table = ds.dataset(out / "vectors", format="parquet").to_table()
    values = table["embedding"].combine_chunks().flatten().to_numpy()  # the stored type: float32, int8
    return table["id"].to_pylist(), values.reshape(table.num_rows, -1)


def test_the_model_is_shipped_and_workers_on_two_nodes_match_a_local_run(scenario, reference):
    answer, work = scenario
    a = answer["a"]
    assert a["moved"] == [str((work / "model_a").resolve())] and not (work / "model_a").exists()  # gone mid-run
    report = json.loads((work / "out_a" / "report.json").read_text())
    nodes = {w["node"] for w in report["per_worker"]}
    assert len(nodes) == 2 and nodes <= set(answer["caches"]), nodes  # two workers, two nodes, both named
    assert all(w["units"] > 0 for w in report["per_worker"])
    assert "ray node" in (work / "out_a" / "report.md").read_text()
    for node in nodes:  # each worker's node has the model in its own cache, under the model's content hash
        models = Path(answer["caches"][node]) / "models"
        (folder,) = [p for p in models.iterdir() if not p.name.startswith(".")]
        assert folder.name == answer["model_sha256"] and (folder / "model.safetensors").is_file()
    # the manifest names the model the workers were sent, not what model.path holds once the model is shipped
    assert json.loads((work / "out_a" / "_manifest" / "job.json").read_text())["model"] == answer["model_sha256"]
    ids, got = _vectors(work / "out_a")
    assert len(ids) == len(set(ids)) == len(reference) == 600
    want = np.stack([reference[i] for i in ids])
    assert got.dtype == np.float32 and np.array_equal(got, want)  # bit for bit


def test_a_node_lost_mid_run_loses_no_row_and_lists_the_retried_units(scenario, reference):
    from embedpipe.io.quantize import Calibration, quantize

    answer, work = scenario
    b = answer["b"]
    assert b["moved"] == [str((work / "model_b").resolve())]  # workers (the calibration's sample too): not model.path
    removed = b["removed"]
    assert removed in answer["caches"]
    report = json.loads((work / "out_b" / "report.json").read_text())
    units = report["units"]
    assert units["encoded"] == units["total"] == 20 and units["failed"] == 0
    assert units["retried"] >= 1 and len(units["retried_units"]) == units["retried"]
    lost = units["retried_units"][0]
    assert lost["cause"] == "died" and lost["node"] == removed, units["retried_units"]
    assert f"{lost['unit']} (worker died on {removed})" in (work / "out_b" / "report.md").read_text()
    last_nodes = [w["node"].split(" + ")[-1] for w in report["per_worker"]]
    assert removed not in last_nodes  # each slot's last units ran on a live node
    ids, got = _vectors(work / "out_b")
    assert len(ids) == len(set(ids)) == 600 and set(ids) == set(reference)  # 0 lost, 0 duplicated
    record = json.loads((work / "out_b" / "quantization.json").read_text())
    want = quantize(np.stack([reference[i] for i in ids]), dtype="int8",
                    calibration=Calibration(**record["calibration"]))
    assert got.dtype == np.int8 and np.array_equal(got, want)


# --------------------------------------------------------------------------- the script (its own process)

def _main(work: Path) -> None:
    """Start the cluster, run job A then job B through the CLI; print one JSON line with what happened."""
    from ray.cluster_utils import Cluster
    from typer.testing import CliRunner

    from embedpipe.cli import app
    from embedpipe.cluster import driver, early
    from embedpipe.cluster.nodes import node_label

    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    health = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={  # a free dashboard port: the other test process's Ray
        "num_cpus": 1, "env_vars": {"EMBEDPIPE_CACHE_DIR": str(work / "cache" / "head")}, "_system_config": health,
        "dashboard_port": free_port()})
    nodes = [cluster.add_node(num_cpus=1, env_vars={"EMBEDPIPE_CACHE_DIR": str(work / "cache" / f"node{i}")})
             for i in range(2)]
    cluster.wait_for_nodes()
    cluster_ready = time.perf_counter()
    everyone = [cluster.head_node, *nodes]
    answer: dict = {"cluster_start_s": round(cluster_ready - started, 1),
                    "caches": {node_label(n.node_ip_address, n.node_id): str(work / "cache" / name)
                               for n, name in zip(everyone, ("head", "node0", "node1"))}}
    moved: list[str] = []
    ship = early.ship_model  # the driver's shipping, beside preflight's id scan (driver.ship_model: without it)

    def ship_then_move(model_dir: Path):
        shipped = ship(model_dir)
        model_dir.rename(model_dir.with_name(model_dir.name + MOVED))  # no process can read model.path now
        moved.append(str(model_dir))
        answer["model_sha256"] = shipped.sha256
        return shipped

    early.ship_model = driver.ship_model = ship_then_move
    try:
        for name in ("a", "b"):
            job = work / f"{name}.yaml"
            job.write_text(job.read_text().replace("ADDRESS", cluster.address))
            removed: list[str] = []
            moved.clear()
            began = time.perf_counter()
            with _removing_a_busy_node(cluster, nodes, removed) if name == "b" else contextlib.nullcontext():
                result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
            answer[name] = {"exit_code": result.exit_code, "output": result.output, "moved": list(moved),
                            "removed": removed[0] if removed else None, "seconds": round(time.perf_counter() - began, 1)}
    finally:
        cluster.shutdown()
    print(json.dumps(answer), flush=True)


@contextlib.contextmanager
def _removing_a_busy_node(cluster, nodes: list, removed: list[str], *, dead_within_s: float = 60.0):
    """While inside: once two units are done, the next unit the driver's scheduler hands to a worker on a
    (non-head) node is lost with that node. The node is removed, and the unit's call made only once Ray
    reports the worker dead, so the unit is lost by construction.

    Removing the node right after the call was made raced: with ``depth`` 2 the worker had already read
    and tokenized that unit (it was named ``ahead`` in its previous call), and 30 rows on the tiny model
    could finish before the node went down, leaving nothing to retry."""
    from ray._private import state

    from embedpipe.cluster.nodes import node_label
    from embedpipe.cluster.scheduler import Scheduler

    submit, finished, done = Scheduler._submit, Scheduler._finished, [0]
    by_id = {n.node_id: n for n in nodes}

    def counting(self, slot):
        result = finished(self, slot)
        done[0] += result is not None
        return result

    def remove_then_submit(self, slot):
        if not removed and done[0] >= 2:
            actor_id = slot.actor._actor_id.hex()
            node_id = (state.actors(actor_id).get("Address") or {}).get("NodeID")
            if node_id in by_id:
                victim = by_id[node_id]
                removed.append(node_label(victim.node_ip_address, victim.node_id))
                cluster.remove_node(victim, allow_graceful=False)
                deadline = time.monotonic() + dead_within_s
                while state.actors(actor_id).get("State") != "DEAD":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"Ray did not report the removed node's worker dead in {dead_within_s:g} s")
                    time.sleep(0.05)
        submit(self, slot)

    Scheduler._submit, Scheduler._finished = remove_then_submit, counting
    try:
        yield
    finally:
        Scheduler._submit, Scheduler._finished = submit, finished


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
