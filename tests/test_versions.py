"""Nightly reindex: versioned outputs, incremental re-embedding, an atomic CURRENT pointer."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.runtime import Encoder
from embedpipe.versions import CURRENT, VALIDATED, prune
from tests.conftest import write_job

pytestmark = pytest.mark.slow
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _vectors(version_dir: Path) -> dict:
    table = ds.dataset(version_dir / "vectors", format="parquet").to_table()
    return dict(zip(table["id"].to_pylist(), np.asarray(table["embedding"].to_pylist(), dtype=np.float32)))


def _current(root: Path) -> str:
    return (root / CURRENT).read_text().strip()


def test_two_nights_reencode_only_changes_and_current_moves_after_success(tmp_path, quickstart_table, ray_session):
    rng = np.random.default_rng(0)
    base = quickstart_table.slice(0, 200).select(["id", "text"])
    data, root = tmp_path / "corpus.parquet", tmp_path / "index"
    pq.write_table(base, data, row_group_size=20)
    job = write_job(tmp_path / "nightly.yaml", input={"path": str(data), "unit_rows": 40},
                    model={"path": MODEL}, batching={"max_tokens": 2048},
                    output={"path": str(root), "versioned": True, "incremental": True, "keep_versions": 2},
                    cluster={"workers": 1})
    first = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert first.exit_code == 0, first.output
    night1 = _current(root)
    r1 = json.loads((root / "versions" / night1 / "report.json").read_text())
    assert r1["incremental"] == {"reused": 0, "encoded": 200, "dropped": 0, "usd_saved": 0.0}  # nothing reused

    # Between nights: 10% of rows change, 5% are deleted, 5% are added.
    ids, texts = base["id"].to_pylist(), base["text"].to_pylist()
    order = rng.permutation(200)
    changed, deleted = set(order[:20].tolist()), set(order[20:30].tolist())
    new_texts = {ids[i]: (texts[i] + " (revised)" if i in changed else texts[i]) for i in range(200) if i not in deleted}
    added = quickstart_table.slice(200, 10)
    new_texts.update(zip(added["id"].to_pylist(), added["text"].to_pylist()))
    pq.write_table(pa.table({"id": list(new_texts), "text": list(new_texts.values())}), data, row_group_size=20)

    second = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert second.exit_code == 0, second.output
    night2 = _current(root)
    assert night2 != night1
    r2 = json.loads((root / "versions" / night2 / "report.json").read_text())
    assert r2["incremental"]["reused"] == 170 and r2["incremental"]["encoded"] == 30
    assert r2["incremental"]["dropped"] == 10 and r2["rows"] == 200
    # reused rows at this night's cost per encoded row (the report's cost section)
    assert r2["incremental"]["usd_saved"] == pytest.approx(170 * r2["cost"]["total_usd"] / 30)
    got = _vectors(root / "versions" / night2)
    assert set(got) == set(new_texts)  # deleted rows are gone
    encoder = Encoder.from_options(MODEL)
    full = encoder.embed(list(new_texts.values()))  # a full recompute of the same corpus
    np.testing.assert_allclose(np.stack([got[i] for i in new_texts]), full, atol=2e-6)
    assert (root / "versions" / night1 / VALIDATED).exists()  # kept: keep_versions is 2

    # Night 3 is killed half-way: CURRENT stays on night 2; the same command then resumes it.
    pq.write_table(quickstart_table.slice(0, 600).select(["id", "text"]), data, row_group_size=20)
    cmd = [str(Path(sys.executable).parent / "embedpipe"), "run", str(job), "--no-progress"]
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while _night3_records(root, {night1, night2}) < 2:
        assert driver.poll() is None, "night 3 finished before it could be killed"
        assert time.time() < deadline, "night 3 made no progress"
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert _current(root) == night2
    [night3] = {p.name for p in (root / "versions").iterdir()} - {night1, night2}
    assert not (root / "versions" / night3 / VALIDATED).exists()

    resumed = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
    assert _current(root) == night3  # the unfinished version was resumed, not restarted
    r3 = json.loads((root / "versions" / night3 / "report.json").read_text())
    assert r3["units"]["skipped_as_done"] >= 2 and r3["rows"] == 600
    assert r3["version"]["pruned"] == [night1]  # keep_versions: 2 keeps nights 2 and 3
    assert sorted(p.name for p in (root / "versions").iterdir()) == [night2, night3]


def _night3_records(root: Path, old: set) -> int:
    return sum(1 for p in root.glob("versions/*/_manifest/units/*.json") if p.parts[-4] not in old)


def test_failed_validation_leaves_current(tmp_path, quickstart_table, ray_session, monkeypatch):
    import embedpipe.versions as versions

    data, root = tmp_path / "corpus.parquet", tmp_path / "index"
    pq.write_table(quickstart_table.slice(0, 30).select(["id", "text"]), data)
    job = write_job(tmp_path / "job.yaml", input={"path": str(data)}, model={"path": MODEL},
                    output={"path": str(root), "versioned": True}, cluster={"workers": 1})
    assert CliRunner().invoke(app, ["run", str(job), "--no-progress"]).exit_code == 0
    before = _current(root)
    pq.write_table(quickstart_table.slice(0, 40).select(["id", "text"]), data)
    real = versions.validate
    monkeypatch.setattr(versions, "validate", lambda d, r, expected_rows: real(d, r, expected_rows=expected_rows + 1))
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 4 and "did not validate" in result.output and "CURRENT still points" in result.output
    assert _current(root) == before


def test_prune_never_removes_current(tmp_path):
    for name in ("20260101T000000Z", "20260102T000000Z", "20260103T000000Z"):
        (tmp_path / "versions" / name).mkdir(parents=True)
        (tmp_path / "versions" / name / VALIDATED).write_text("")
    (tmp_path / CURRENT).write_text("20260101T000000Z\n")  # rolled back to the oldest
    assert prune(tmp_path, keep=1) == ["20260102T000000Z"]
    assert sorted(p.name for p in (tmp_path / "versions").iterdir()) == ["20260101T000000Z", "20260103T000000Z"]
