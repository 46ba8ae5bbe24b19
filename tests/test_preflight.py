"""Bad files and bad models: each a clear error before any worker starts or any model runs."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.config import parse_job
from embedpipe.preflight import ModelError, preflight
from embedpipe.units import InputError
from tests.conftest import write_job

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _job(tmp_path, data, **sections):
    raw = {"input": {"path": str(data), **sections.pop("input", {})}, "model": {"path": MODEL, **sections.pop("model", {})},
           "output": {"path": str(tmp_path / "out")}}
    return parse_job(raw)


def _table(ids, texts=None):
    return pa.table({"id": ids, "text": texts if texts is not None else [f"text {i}" for i in range(len(ids))]})


def test_corrupt_file_is_named(tmp_path):
    (tmp_path / "data").mkdir()
    pq.write_table(_table(["a"]), tmp_path / "data" / "good.parquet")
    (tmp_path / "data" / "torn.parquet").write_bytes(b"PAR1 and then nothing")
    with pytest.raises(InputError, match="torn.parquet.*replace or remove"):
        preflight(_job(tmp_path, tmp_path / "data"))


def test_missing_column_names_the_field(tmp_path):
    pq.write_table(pa.table({"id": ["a"], "body": ["x"]}), tmp_path / "d.parquet")
    with pytest.raises(InputError, match="no column 'text'.*input.text_column"):
        preflight(_job(tmp_path, tmp_path / "d.parquet"))
    with pytest.raises(InputError, match="no column 'doc_id'.*input.id_column"):
        preflight(_job(tmp_path, tmp_path / "d.parquet", input={"text_column": "body", "id_column": "doc_id"}))


def test_non_text_column_is_an_error_unless_rows_are_skipped(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b"], "text": [1, 2]}), tmp_path / "d.parquet")
    with pytest.raises(InputError, match="holds int64, not text"):
        preflight(_job(tmp_path, tmp_path / "d.parquet"))
    preflight(_job(tmp_path, tmp_path / "d.parquet", input={"on_bad_row": "skip"}))


def test_duplicate_ids_error_names_them(tmp_path):
    pq.write_table(_table(["a", "b", "c"]), tmp_path / "1.parquet")
    pq.write_table(_table(["d", "b", "a"]), tmp_path / "2.parquet")
    with pytest.raises(InputError, match=r"2 rows repeat an id.*'b'.*'a'.*on_duplicate_id: keep_first"):
        preflight(_job(tmp_path, tmp_path / "*.parquet"))


def test_duplicate_ids_keep_first_marks_later_rows(tmp_path):
    pq.write_table(_table([7, 8, 7], ), tmp_path / "1.parquet", row_group_size=2)
    pq.write_table(_table([8, 9]), tmp_path / "2.parquet")
    plan = preflight(_job(tmp_path, tmp_path / "*.parquet", input={"on_duplicate_id": "keep_first", "unit_rows": 2}))
    assert [(u.id, u.drop_rows) for u in plan.units] == [("00000-00000", ()), ("00000-00001", (0,)),
                                                         ("00001-00000", (0,))]
    assert plan.duplicate_rows == 2


@pytest.fixture
def model_copy(tmp_path, minilm_dir):
    target = tmp_path / "model"
    shutil.copytree(minilm_dir, target)
    return target


def test_model_missing_tokenizer(tmp_path, model_copy):
    pq.write_table(_table(["a"]), tmp_path / "d.parquet")
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="no tokenizer.json"):
        preflight(_job(tmp_path, tmp_path / "d.parquet", model={"path": str(model_copy)}))


def test_pickle_only_model_needs_the_opt_in(tmp_path, model_copy):
    pq.write_table(_table(["a"]), tmp_path / "d.parquet")
    (model_copy / "model.safetensors").rename(model_copy / "pytorch_model.bin")
    with pytest.raises(ModelError, match="only pickled weights.*model.allow_pickle: true"):
        preflight(_job(tmp_path, tmp_path / "d.parquet", model={"path": str(model_copy)}))


def test_code_in_a_model_directory_is_refused(tmp_path, model_copy):
    pq.write_table(_table(["a"]), tmp_path / "d.parquet")
    (model_copy / "custom.py").write_text("raise SystemExit('model code ran')\n")
    modules = json.loads((model_copy / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "", "type": "custom.Evil"})
    (model_copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelError, match="custom.Evil.*not supported"):
        preflight(_job(tmp_path, tmp_path / "d.parquet", model={"path": str(model_copy)}))


def test_cli_reports_bad_input_before_any_worker(tmp_path, monkeypatch):
    import embedpipe.cluster.driver as driver

    monkeypatch.setattr(driver, "connect", lambda cfg: pytest.fail("Ray was started for a bad input"))
    pq.write_table(_table(["a", "a"]), tmp_path / "d.parquet")
    job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "d.parquet")}, model={"path": MODEL},
                    output={"path": str(tmp_path / "out")})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 3 and "repeat an id" in result.output


@pytest.mark.slow
def test_the_model_is_resolved_once_per_run(tmp_path, ray_session, quickstart_table, monkeypatch):
    """One resolution of model.path in the driver per run (preflight's), whatever the run does after:
    output.dim checked against the model, a sharded FAISS index (plan, shard workers, report FLOPs),
    and an int8 run (calibration and its record). Workers (the calibration's sample too) are other processes."""
    from embedpipe.cluster.driver import run_job
    from embedpipe.config import load_job
    from embedpipe.models import resolve

    calls = []
    real = resolve.resolve_model_path

    def counting(name, **options):
        calls.append(name)
        return real(name, **options)

    monkeypatch.setattr(resolve, "resolve_model_path", counting)
    data = tmp_path / "data.parquet"
    pq.write_table(quickstart_table.slice(0, 120), data, row_group_size=60)
    common = dict(input={"path": str(data), "unit_rows": 60}, model={"path": MODEL, "max_seq_len": 32},
                  batching={"max_tokens": 1024}, cluster={"workers": 1, "cpus_per_worker": 1})
    for name, output in (("faiss", {"format": "both", "index": "IVF2,Flat", "dim": 128}),
                         ("int8", {"dtype": "int8", "calibration_rows": 40})):
        calls.clear()
        job = load_job(write_job(tmp_path / f"{name}.yaml", output={"path": str(tmp_path / name), **output}, **common))
        report = run_job(job, progress=False).report
        assert report["rows"] == 120 and report["flops_per_token"] > 0  # the plan's config.json fed the FLOPs
        assert calls == [MODEL], f"{name} run: model.path resolved {len(calls)} times in the driver: {calls}"
    assert (tmp_path / "faiss" / "index" / "index.faiss").is_file() and (tmp_path / "int8" / "quantization.json").is_file()


def test_the_run_plan_holds_the_model_and_index_facts(tmp_path, minilm_dir):
    """Preflight's RunPlan: the resolved model directory, its config.json and dimension, FLOPs per token
    by the family's rule, the output root, and the index plan (None for parquet)."""
    from embedpipe.report.flops import flops_per_token_from_config, read_model_config

    pq.write_table(_table(list(range(100))), tmp_path / "d.parquet")
    raw = {"input": {"path": str(tmp_path / "d.parquet")}, "model": {"path": MODEL},
           "output": {"path": str(tmp_path / "out"), "format": "faiss", "index": "Flat", "dim": 128}}
    plan = preflight(parse_job(raw))
    assert plan.model.dir == minilm_dir.resolve() and plan.model_dir == plan.model.dir
    assert plan.model.config == read_model_config(minilm_dir) and plan.model.config["model_type"] == "bert"
    assert (plan.model.dim, plan.model.vector_dim, plan.model.normalize) == (384, 128, True)
    assert plan.model.flops_per_token(64) == flops_per_token_from_config(plan.model.config, 64) > 0
    assert plan.output == tmp_path / "out" and plan.rows == 100
    assert plan.index.candidates[0].factory == "Flat" and plan.index.dim == 128 and plan.index.metric == "inner_product"
    assert preflight(parse_job({**raw, "output": {"path": str(tmp_path / "out")}})).index is None
