from pathlib import Path

import pytest

from embedpipe.config import JobError, load_job, render_reference, resolve_dtype
from tests.conftest import QUICKSTART, ROOT, write_job


def _job(tmp_path: Path, **over):
    sections = {
        "input": {"path": str(QUICKSTART)},
        "model": {"path": "sentence-transformers/all-MiniLM-L6-v2"},
        "output": {"path": str(tmp_path / "out")},
    }
    for key, value in over.items():
        if value is None:
            sections.pop(key)
        else:
            sections[key] = {**sections.get(key, {}), **value} if isinstance(value, dict) else value
    return write_job(tmp_path / "job.yaml", **sections)


def test_valid_job_has_defaults(tmp_path):
    job = load_job(_job(tmp_path))
    assert job.input.text_column == "text" and job.batching.max_tokens == 8192
    assert resolve_dtype(job.model.dtype, device="cpu") == "float32"  # model.dtype auto: float32 on CPU
    assert job.cluster.address == "" and job.cluster.workers is None


def test_relative_paths_resolve_against_the_job_file(tmp_path):
    job = load_job(ROOT / "examples" / "quickstart.yaml")
    assert Path(job.input.path) == QUICKSTART
    assert job.model.path == "sentence-transformers/all-MiniLM-L6-v2"  # a hub name stays a name


def test_set_overrides_any_field(tmp_path):
    job = load_job(_job(tmp_path), overrides=["batching.max_tokens=1024", "model.dtype=bfloat16",
                                               "cluster.workers=3", "output.path=rel/out"])
    assert job.batching.max_tokens == 1024 and job.model.dtype == "bfloat16" and job.cluster.workers == 3
    assert job.output.path == str(Path.cwd() / "rel" / "out")


@pytest.mark.parametrize("over, field, words", [
    ({"inptu": {"path": "x"}}, "inptu", "unknown section"),
    ({"model": {"dtyp": "float32"}}, "model.dtyp", "did you mean model.dtype"),
    ({"batching": {"max_tokens": "many"}}, "batching.max_tokens", "is not an integer"),
    ({"model": {"dtype": "fp32"}}, "model.dtype", "not one of float32, bfloat16, float16"),
    ({"model": {"normalize": "yes"}}, "model.normalize", "true/false or one of auto"),
    ({"batching": {"max_tokens": 0}}, "batching.max_tokens", "must be positive"),
    ({"output": None}, "output.path", "is required"),
    ({"input": {"path": "/nonexistent/corpus.parquet"}}, "input.path", "does not exist"),
    ({"cluster": ["workers", 2]}, "cluster", "must be a mapping"),
])
def test_each_bad_job_names_the_field(tmp_path, over, field, words):
    with pytest.raises(JobError) as err:
        load_job(_job(tmp_path, **over))
    assert err.value.field_path == field
    assert words in str(err.value) and "fix:" in str(err.value)


@pytest.mark.parametrize("item, field", [
    ("batching.max_tokens", "--set"), ("nosuch.field=1", "nosuch.field"), ("model.nosuch=1", "model.nosuch"),
])
def test_bad_override_names_the_field(tmp_path, item, field):
    with pytest.raises(JobError) as err:
        load_job(_job(tmp_path), overrides=[item])
    assert err.value.field_path == field


def test_invalid_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("input: [unclosed\n")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(bad)
    with pytest.raises(JobError, match="does not exist"):
        load_job(tmp_path / "missing.yaml")


def test_job_reference_doc_matches_schema():
    doc = (ROOT / "docs" / "job-reference.md").read_text()
    assert doc == render_reference(), "regenerate: python -m embedpipe.config > docs/job-reference.md"


def test_shipped_job_files_validate():
    for path in [*sorted((ROOT / "jobs").glob("*.yaml")), ROOT / "examples" / "quickstart.yaml"]:
        load_job(path)


def test_chunking_is_a_nested_section_off_by_default(tmp_path):
    job = load_job(_job(tmp_path))
    assert job.input.chunking.mode == "off" and job.input.chunking.max_tokens is None
    job = load_job(_job(tmp_path, input={"path": str(QUICKSTART), "chunking": {"mode": "split", "overlap": 16}}),
                   overrides=["input.chunking.max_tokens=128"])
    assert (job.input.chunking.mode, job.input.chunking.max_tokens, job.input.chunking.overlap) == ("split", 128, 16)
    assert job.to_dict()["input"]["chunking"]["max_tokens"] == 128


@pytest.mark.parametrize("over, field, words", [
    ({"input": {"chunking": {"mode": "chunks"}}}, "input.chunking.mode", "not one of off, split, late"),
    ({"input": {"chunking": {"overlp": 3}}}, "input.chunking.overlp", "did you mean input.chunking.overlap"),
    ({"input": {"chunking": {"max_tokens": 64, "overlap": 64}}}, "input.chunking.overlap", "is not below"),
    ({"input": {"chunking": {"overlap": -1}}}, "input.chunking.overlap", "is negative"),
    ({"input": {"chunking": 5}}, "input.chunking", "must be a mapping"),
    ({"output": {"document_vectors": "mean"}}, "output.document_vectors", "needs chunked documents"),
    ({"input": {"chunking": {"mode": "split"}}, "output": {"document_vectors": "mean", "dtype": "int8"}},
     "output.document_vectors", "needs float vectors"),
])
def test_each_bad_chunking_field_is_named(tmp_path, over, field, words):
    over = {k: {**({"path": str(QUICKSTART)} if k == "input" else {"path": str(tmp_path / "out")}), **v}
            for k, v in over.items()}
    with pytest.raises(JobError) as err:
        load_job(_job(tmp_path, **over))
    assert err.value.field_path == field
    assert words in str(err.value) and "fix:" in str(err.value)
