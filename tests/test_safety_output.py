"""Data safety of the output: a changed model is detected, embedpipe touches only what it wrote,
corrupt parts and records are redone, no temporary file outlives a run. On a real local Ray with a
tiny random BERT (MiniLM's tokenizer), so a run takes seconds."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.io.manifest import HashCache, model_fingerprint
from embedpipe.io.ownership import MARKER, OutputNotOwned, check_output
from tests.conftest import write_job
from tests.model_helpers import save_tiny_text_model

ROWS, UNIT_ROWS = 120, 40  # three units


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """Two random BERTs of the same config: equal in every file but the weights' values."""
    root = tmp_path_factory.mktemp("models")
    return save_tiny_text_model(root / "a", seed=0), save_tiny_text_model(root / "b", seed=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, quickstart_table) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.parquet"
    pq.write_table(quickstart_table.slice(0, ROWS).select(["id", "text"]), path, row_group_size=UNIT_ROWS)
    return path


def _job(folder: Path, *, corpus: Path, model: Path, out: Path, **output) -> Path:
    return write_job(folder / f"job-{len(list(folder.glob('job-*.yaml')))}.yaml",
                     input={"path": str(corpus), "unit_rows": UNIT_ROWS}, model={"path": str(model)},
                     batching={"max_tokens": 2048}, output={"path": str(out), **output},
                     cluster={"workers": 1, "cpus_per_worker": 1})


def _run(job: Path, *extra: str):
    return CliRunner().invoke(app, ["run", str(job), "--no-progress", *extra])


def _error_line(result) -> str:
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


def _tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (links not followed) with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _vectors(out: Path) -> dict:
    table = ds.dataset(out / "vectors", format="parquet").to_table()
    return dict(zip(table["id"].to_pylist(), np.asarray(table["embedding"].to_pylist(), dtype=np.float32)))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, models, corpus, ray_session) -> Path:
    """A finished output of model A; tests copy it."""
    folder = tmp_path_factory.mktemp("finished")
    result = _run(_job(folder, corpus=corpus, model=models[0], out=folder / "out"))
    assert result.exit_code == 0, result.output
    return folder / "out"


def _copy(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    return out


# --------------------------------------------------------------------------- the model's content

def test_fingerprint_hashes_the_model_content_once(tmp_path, models):
    a, b = models
    cache = HashCache(tmp_path / "cache.json")
    fa = model_fingerprint(a, cache=cache)
    assert model_fingerprint(b, cache=cache) != fa  # same config, same sizes, other weights
    copy = shutil.copytree(a, tmp_path / "copy")
    assert model_fingerprint(copy, cache=cache) == fa  # the same bytes elsewhere are the same model
    again = HashCache(tmp_path / "cache.json")  # a rerun: nothing hashed again
    assert model_fingerprint(a, cache=again) == fa and again.hashed == 0
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight, same size
    weights.write_bytes(bytes(data))
    changed = HashCache(tmp_path / "cache.json")
    assert model_fingerprint(copy, cache=changed) != fa and changed.hashed == 1


@pytest.mark.slow
def test_resume_with_another_model_is_refused(tmp_path, finished, models, corpus):
    out = _copy(finished, tmp_path)
    records = sorted((out / "_manifest" / "units").glob("*.json"))
    records[-1].unlink()  # as if the driver had been killed before the last unit
    before = _tree(out)
    result = _run(_job(tmp_path, corpus=corpus, model=models[1], out=out))
    assert result.exit_code == 2
    line = _error_line(result)
    assert "changed: model" in line and str(models[1]) in line and "--overwrite" in line
    assert _tree(out) == before  # nothing written, nothing mixed


@pytest.mark.slow
def test_nightly_run_after_a_model_swap_reencodes_every_row(tmp_path, models, corpus, ray_session):
    from embedpipe.runtime import Encoder

    root = tmp_path / "index"
    versioned = {"versioned": True, "incremental": True}
    first = _run(_job(tmp_path, corpus=corpus, model=models[0], out=root, **versioned))
    assert first.exit_code == 0, first.output
    second = _run(_job(tmp_path, corpus=corpus, model=models[1], out=root, **versioned))
    assert second.exit_code == 0, second.output
    night2 = (root / "CURRENT").read_text().strip()
    report = json.loads((root / "versions" / night2 / "report.json").read_text())
    assert report["incremental"]["reused"] == 0 and report["incremental"]["encoded"] == ROWS
    assert "model's files changed" in report["incremental"]["reencoded_all"]
    got = _vectors(root / "versions" / night2)
    texts = dict(zip(*(pq.read_table(corpus)[c].to_pylist() for c in ("id", "text"))))
    want = Encoder.from_options(str(models[1])).embed([texts[i] for i in got])
    np.testing.assert_allclose(np.stack(list(got.values())), want, atol=2e-6)  # all of model B


# --------------------------------------------------------------------------- only what embedpipe wrote

def _decoy(folder: Path) -> Path:
    """A user's folder that looks like an output: CURRENT, versions/1.0/, index/index.html."""
    folder.mkdir(parents=True)
    (folder / "CURRENT").write_text("1.0\n")
    (folder / "versions" / "1.0").mkdir(parents=True)
    (folder / "versions" / "1.0" / "important.txt").write_text("the only copy")
    (folder / "index").mkdir()
    (folder / "index" / "index.html").write_text("<html>my site</html>")
    return folder


@pytest.mark.parametrize("versioned", [False, True])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_embedpipe_did_not_create_is_never_touched(tmp_path, models, corpus, versioned, overwrite):
    decoy = _decoy(tmp_path / "site")
    before = _tree(decoy)
    job = _job(tmp_path, corpus=corpus, model=models[0], out=decoy, versioned=versioned)
    result = _run(job, *(["--overwrite"] if overwrite else []))
    assert result.exit_code == 5
    line = _error_line(result)
    assert str(decoy) in line and "not created by embedpipe" in line and "new or empty output.path" in line
    assert _tree(decoy) == before and sorted(p.name for p in decoy.iterdir()) == ["CURRENT", "index", "versions"]


def test_root_and_home_are_never_outputs(tmp_path):
    for folder in (Path("/"), Path.home(), Path.home().parent):
        with pytest.raises(OutputNotOwned, match="never writes there"):
            check_output(folder)
    check_output(tmp_path / "new")  # a new folder and an empty one are fine
    check_output(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("linked", ["vectors", "_manifest/skipped"])
def test_a_linked_folder_inside_the_output_is_refused(tmp_path, finished, models, corpus, linked):
    out = _copy(finished, tmp_path)
    outside = tmp_path / "elsewhere"
    shutil.copytree(out / linked, outside) if (out / linked).is_dir() else outside.mkdir()
    (outside / "part-mine.parquet").write_bytes(b"a user's file with a part's name")
    (outside / "notes.txt").write_text("keep me")
    shutil.rmtree(out / linked, ignore_errors=True)
    (out / linked).symlink_to(outside, target_is_directory=True)
    records = sorted((out / "_manifest" / "units").glob("*.json"))
    records[-1].unlink()  # a unit left to redo: the rerun would clean
    before = _tree(outside)
    result = _run(_job(tmp_path, corpus=corpus, model=models[0], out=out))
    assert result.exit_code == 5
    assert "symbolic link" in _error_line(result)
    assert _tree(outside) == before


@pytest.mark.slow
def test_overwrite_removes_only_what_embedpipe_wrote(tmp_path, finished, models, corpus):
    out = _copy(finished, tmp_path)
    (out / "notes.txt").write_text("the user's notes beside the output")
    result = _run(_job(tmp_path, corpus=corpus, model=models[0], out=out, dtype="float16"), "--overwrite")
    assert result.exit_code == 0, result.output
    assert (out / "notes.txt").read_text() == "the user's notes beside the output"
    assert (out / MARKER).is_file() and len(_vectors(out)) == ROWS


@pytest.mark.slow
def test_an_output_of_an_earlier_embedpipe_is_still_ours(tmp_path, finished):
    out = _copy(finished, tmp_path)
    (out / MARKER).unlink()  # written before the marker existed: it has its manifest
    check_output(out)


# --------------------------------------------------------------------------- corrupt parts and records

@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped byte", "overwritten footer", "torn record"])
def test_a_corrupt_part_or_record_is_redone(tmp_path, finished, models, corpus, damage, caplog):
    out = _copy(finished, tmp_path)
    want = _vectors(out)
    part = sorted((out / "vectors").glob("part-*.parquet"))[1]
    data = bytearray(part.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x40  # inside the vectors' pages: same size, readable footer
    elif damage == "overwritten footer":
        data[-12:-4] = b"\0" * 8
    if damage == "torn record":
        record = sorted((out / "_manifest" / "units").glob("*.json"))[1]
        record.write_text(record.read_text()[:40])
    else:
        part.write_bytes(bytes(data))
        assert part.stat().st_size == len(data)
    result = _run(_job(tmp_path, corpus=corpus, model=models[0], out=out))
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["units"]["skipped_as_done"] == 2 and report["units"]["encoded"] == 1
    got = _vectors(out)
    assert set(got) == set(want) and len(got) == ROWS  # exactly once
    np.testing.assert_allclose(np.stack([got[i] for i in want]), np.stack(list(want.values())), atol=2e-6)


@pytest.mark.slow
def test_no_temporary_file_outlives_a_run(tmp_path, finished, models, corpus):
    out = _copy(finished, tmp_path)
    leftovers = [out / "report.json.tmp", out / "_manifest" / ".job.json.123.tmp",
                 out / "vectors" / ".part-00000-00001.parquet.123.tmp", out / "_manifest" / "units" / ".x.json.9.tmp"]
    for path in leftovers:
        path.write_bytes(b"half a write")
    (out / "vectors" / "README.txt").write_text("not ours: stays")
    result = _run(_job(tmp_path, corpus=corpus, model=models[0], out=out))  # nothing to do: no worker starts
    assert result.exit_code == 0, result.output
    assert not [p for p in leftovers if p.exists()]
    assert (out / "vectors" / "README.txt").exists()
    assert not any(p.name.endswith(".tmp") for p in out.rglob("*"))


@pytest.mark.slow
def test_run_records_the_model_folder(finished, models):
    job = json.loads((finished / "_manifest" / "job.json").read_text())
    assert job["model_dir"] == str(models[0].resolve()) and len(job["model"]) == 64
    assert os.path.isfile(finished / MARKER)


# --------------------------------------------------------------------------- crashes that must keep holding

def _write_state(out: Path, state: str) -> str:
    """Leave ``out`` as a worker SIGKILLed at one of its four write points leaves it; returns that unit."""
    import pyarrow as pa

    record = sorted((out / "_manifest" / "units").glob("*.json"))[-1]
    unit = record.stem
    part = out / "vectors" / f"part-{unit}.parquet"
    record.unlink()  # in every state the unit's record was never written
    if state == "part half written":
        part.rename(part.with_name(f".{part.name}.4242.tmp"))
        tmp = part.with_name(f".{part.name}.4242.tmp")
        tmp.write_bytes(tmp.read_bytes()[:100])
    elif state == "skipped rows written":
        skipped = out / "_manifest" / "skipped" / f"{unit}.parquet"
        skipped.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": ["ghost"], "reason": ["empty text"]}), skipped)
    elif state == "record half written":
        (out / "_manifest" / "units" / f".{unit}.json.4242.tmp").write_text('{"unit_id": "')
    return unit  # "part renamed": the part is in place, nothing else


@pytest.mark.slow
@pytest.mark.parametrize("state", ["part half written", "part renamed", "skipped rows written", "record half written"])
def test_resume_after_a_worker_killed_at_each_write_point(tmp_path, finished, models, corpus, state):
    out = _copy(finished, tmp_path)
    want = _vectors(out)
    unit = _write_state(out, state)
    result = _run(_job(tmp_path, corpus=corpus, model=models[0], out=out))
    assert result.exit_code == 0, result.output
    got = _vectors(out)
    assert len(got) == ROWS and set(got) == set(want)  # exactly once
    np.testing.assert_allclose(np.stack([got[i] for i in want]), np.stack(list(want.values())), atol=2e-6)
    assert not (out / "skipped.parquet").exists() and not (out / "_manifest" / "skipped" / f"{unit}.parquet").exists()
    assert not any(p.name.endswith(".tmp") for p in out.rglob("*"))


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs of its own (root only; skipped where mounting is not allowed)."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount(8) for a small tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_disk_full_then_resume(tmp_path, finished, small_disk, models, corpus):
    import subprocess

    out = small_disk / "out"
    ballast = small_disk / "ballast"
    part_bytes = max(p.stat().st_size for p in (finished / "vectors").glob("*.parquet"))
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    ballast.write_bytes(b"\0" * (free - 8 * 4096 - part_bytes))  # room for the run's small files and one part
    failed = _run(_job(tmp_path, corpus=corpus, model=models[0], out=out))
    assert failed.exit_code == 4
    line = _error_line(failed)
    assert "No space left" in line and "rerun the same command" in line and "remove that file" not in line
    assert len(list((out / "_manifest" / "units").glob("*.json"))) >= 1  # it failed mid-run, not at the start
    ballast.unlink()  # the operator frees space and reruns the same command
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    resumed = _run(_job(tmp_path, corpus=corpus, model=models[0], out=out))
    assert resumed.exit_code == 0, resumed.output
    assert _vectors(out).keys() == _vectors(finished).keys() and len(_vectors(out)) == ROWS


@pytest.mark.slow
def test_a_read_only_output_fails_with_one_line(tmp_path, finished, small_disk, models, corpus):
    import subprocess

    out = small_disk / "out"
    shutil.copytree(finished, out)
    (sorted((out / "_manifest" / "units").glob("*.json"))[-1]).unlink()
    before = _tree(out)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    result = _run(_job(tmp_path, corpus=corpus, model=models[0], out=out))
    assert result.exit_code == 4
    assert "Read-only file system" in _error_line(result)
    assert _tree(out) == before
