"""Errors that used to surface late or with the wrong code: each is exit 2 with one `error:` line,
before any worker starts (bad model types, a rollback to a missing version, bad --set values)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from tests.conftest import QUICKSTART, ROOT, write_job

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture
def corpus(tmp_path, quickstart_table) -> Path:
    path = tmp_path / "corpus.parquet"
    pq.write_table(quickstart_table.slice(0, 8), path)
    return path


def _model_copy(minilm_dir: Path, target: Path) -> Path:
    """The packaged MiniLM as a folder of its own: small files copied (to edit), the weights linked."""
    target.mkdir(parents=True)
    for item in minilm_dir.iterdir():
        if item.suffix == ".safetensors":
            (target / item.name).symlink_to(item)
        elif item.is_dir():
            (target / item.name).mkdir()
            for sub in item.iterdir():
                (target / item.name / sub.name).write_bytes(sub.read_bytes())
        else:
            (target / item.name).write_bytes(item.read_bytes())
    return target


@pytest.fixture
def model_dir(tmp_path, minilm_dir) -> Path:
    return _model_copy(minilm_dir, tmp_path / "model")


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _cli(*args: str):
    result = CliRunner().invoke(app, [*args])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2, result.output
    assert len(errors) == 1, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, Exception), result.output
    return errors[0]


def _job(tmp_path: Path, corpus: Path, *, model: str = MODEL, **output) -> Path:
    return write_job(tmp_path / "job.yaml", input={"path": str(corpus)}, model={"path": model},
                     output={"path": str(tmp_path / "out"), **output}, cluster={"workers": 1, "cpus_per_worker": 1})


def _assert_nothing_started(out: Path) -> None:
    assert not (out / "_manifest").exists() and not (out / "vectors").exists()
    assert not list(out.glob("versions/*/_manifest")), "a version was started"


# --------------------------------------------------------------------------- the model directory

@pytest.mark.parametrize("command", ["validate", "run"])
def test_unknown_model_type_is_refused_in_preflight(tmp_path, corpus, model_dir, command):
    _edit_json(model_dir / "config.json", lambda c: c.update(model_type="nosuchformer"))
    job = _job(tmp_path, corpus, model=str(model_dir))
    line = _cli(command, str(job), *(["--no-progress"] if command == "run" else []))
    assert "config.json model_type 'nosuchformer' is not supported" in line and str(model_dir) in line
    assert "embedpipe implements bert," in line and "use a model of one of these" in line
    _assert_nothing_started(tmp_path / "out")


@pytest.mark.parametrize("bad", ["evil.Pooling", "sentence_transformers_evil.models.Pooling",
                                 "evil.sentence_transformers.models.Pooling", "sentence_transformers.models.pooling"])
def test_module_type_must_be_a_sentence_transformers_name(tmp_path, corpus, model_dir, bad):
    _edit_json(model_dir / "modules.json", lambda modules: modules[1].update(type=bad))
    line = _cli("validate", str(_job(tmp_path, corpus, model=str(model_dir))))
    assert "modules.json" in line and "module '1'" in line and repr(bad) in line
    assert "sentence_transformers.models.Pooling" in line  # names what is accepted


def test_bad_module_with_model_options_set_is_refused_without_a_traceback(tmp_path, corpus, model_dir):
    """output.dim / model.prompt_name read the model while the job loads: a bad module is still one line."""
    _edit_json(model_dir / "modules.json", lambda modules: modules.append(
        {"idx": 3, "name": "3", "path": "", "type": "custom.Evil"}))
    line = _cli("validate", str(_job(tmp_path, corpus, model=str(model_dir))), "--set", "output.dim=64")
    assert "module '3' of type 'custom.Evil' is not supported" in line


def test_module_types_sentence_transformers_writes_are_accepted(tmp_path):
    """Every spelling we accept imports, in the installed sentence-transformers, as the class it names."""
    st_misc = pytest.importorskip("sentence_transformers.util.misc")
    from embedpipe.models.st import MODULE_TYPES

    for type_name, kind in MODULE_TYPES.items():
        cls = st_misc.import_from_string(type_name)
        assert cls.__name__ == kind, type_name


# --------------------------------------------------------------------------- rollback (versioned outputs)

def _versions(out: Path, *, validated: list[str], unfinished: list[str] = (), current: str) -> None:
    for name in [*validated, *unfinished]:
        (out / "versions" / name).mkdir(parents=True)
    for name in validated:
        (out / "versions" / name / "VALIDATED").write_bytes(b"")
    (out / "CURRENT").write_text(current + "\n")


@pytest.mark.parametrize("current, problem", [("20261128T020000Z", "does not exist"),
                                              ("20261129T020000Z", "not VALIDATED")])
def test_rollback_to_a_missing_or_unvalidated_version_is_refused(tmp_path, corpus, current, problem):
    out = tmp_path / "out"
    _versions(out, validated=["20261126T020000Z", "20261127T020000Z"], unfinished=["20261129T020000Z"],
              current=current)
    job = _job(tmp_path, corpus, versioned=True)
    for command in ("validate", "run"):
        line = _cli(command, str(job), *(["--no-progress"] if command == "run" else []))
        assert str(out / "CURRENT") in line and repr(current) in line and problem in line, line
        assert "20261127T020000Z" in line and "20261126T020000Z" in line and "fix:" in line, line
    assert (out / "CURRENT").read_text().strip() == current  # untouched
    assert sorted(p.name for p in (out / "versions").iterdir()) == ["20261126T020000Z", "20261127T020000Z",
                                                                      "20261129T020000Z"]
    _assert_nothing_started(out)


def test_rollback_to_a_validated_version_passes_preflight(tmp_path, corpus):
    from embedpipe.config import load_job
    from embedpipe.preflight import preflight

    out = tmp_path / "out"
    _versions(out, validated=["20261126T020000Z", "20261127T020000Z"], current="20261126T020000Z")
    assert preflight(load_job(_job(tmp_path, corpus, versioned=True))).units


# --------------------------------------------------------------------------- --set

@pytest.mark.parametrize("item, names", [
    ("batching.max_tokens=abc", ["batching.max_tokens", "'abc'"]),
    ("nosuch.field=1", ["nosuch.field", "'nosuch'"]),
    ("model=3", ["'model=3'", "model.path"]),
    ("output.path", ["'output.path'", "--set output.path="]),
    ("batching.buckets=[512,", ["batching.buckets", "'[512,'"]),
    ("model.prompt=@query", ["model.prompt", "'@query'"]),
    ("model.max_seq_len=!!python/name:os.system", ["model.max_seq_len", "!!python/name:os.system"]),
    ("output.path=", ["output.path", "is empty"]),
    ("model.prompt=query: ", ["model.prompt", "quote"]),
    ("model.nosuch=1", ["model.nosuch", "unknown field"]),
])
def test_bad_set_value_is_a_job_error(tmp_path, item, names):
    job = write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)}, model={"path": MODEL},
                    output={"path": str(tmp_path / "out")})
    line = _cli("validate", str(job), "--set", item)
    assert "fix:" in line, line
    for name in names:
        assert name in line, line


def test_quoted_set_values_are_strings(tmp_path):
    from embedpipe.config import load_job

    job = write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)}, model={"path": MODEL},
                    output={"path": str(tmp_path / "out")})
    spec = load_job(job, overrides=['model.prompt="query: "', "model.prompt_name=null", "batching.max_tokens=1e4"])
    assert spec.model.prompt == "query: " and spec.batching.max_tokens == 10_000


# --------------------------------------------------------------------------- no worker, no Ray

FAIL_ALL = """
import json, sys
import ray
from typer.testing import CliRunner
from embedpipe.cli import app
codes = [CliRunner().invoke(app, ["run", job, "--no-progress"]).exit_code for job in sys.argv[1:]]
print(json.dumps({"codes": codes, "ray": ray.is_initialized()}))
"""


@pytest.mark.slow
def test_preflight_refusals_never_start_ray(tmp_path, corpus, minilm_dir):
    """The three preflight refusals through `embedpipe run` in a fresh process: Ray is never initialised."""
    unknown_type = _model_copy(minilm_dir, tmp_path / "a" / "model")
    _edit_json(unknown_type / "config.json", lambda c: c.update(model_type="nosuchformer"))
    evil_module = _model_copy(minilm_dir, tmp_path / "b" / "model")
    _edit_json(evil_module / "modules.json", lambda m: m[1].update(type="evil.Pooling"))
    (tmp_path / "c").mkdir()
    _versions(tmp_path / "c" / "out", validated=["20261127T020000Z"], current="20261128T020000Z")
    jobs = [_job(tmp_path / "a", corpus, model=str(unknown_type)), _job(tmp_path / "b", corpus, model=str(evil_module)),
            _job(tmp_path / "c", corpus, versioned=True)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", FAIL_ALL, *map(str, jobs)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"codes": [2, 2, 2], "ray": False}, run.stderr[-3000:]
