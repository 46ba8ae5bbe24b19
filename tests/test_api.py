"""The Python API: embed() in process gives the CLI's vectors; Job runs and submits jobs."""

import dataclasses
import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

import embedpipe
from embedpipe.api.options import job_for_options, option_names
from embedpipe.config import SECTIONS, JobError
from embedpipe.units import InputError
from tests.conftest import QUICKSTART, ROOT, assert_same_vectors, write_job

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.mark.slow
def test_embed_list_dataframe_dataset_and_table_give_the_cli_vectors(small_corpus, parquet_cli_vectors):
    pd = pytest.importorskip("pandas")
    datasets = pytest.importorskip("datasets")
    table, _ = small_corpus
    want = np.stack([parquet_cli_vectors[i] for i in table["id"].to_pylist()])

    from_list = embedpipe.embed(table["text"].to_pylist(), model=MODEL)
    assert from_list.shape == (300, 384) and from_list.dtype == np.float32
    assert_same_vectors(from_list, want)
    assert_same_vectors(embedpipe.embed(table.to_pandas(), model=MODEL), want)
    dataset = datasets.Dataset(table)
    assert_same_vectors(embedpipe.embed(dataset, model=MODEL), want)

    # add_column and row order, on a few rows
    few, want_few = table.slice(0, 40), want[:40]
    frame = few.to_pandas()
    with_column = embedpipe.embed(frame, model=MODEL, add_column="embedding")
    assert list(with_column.columns) == [*frame.columns, "embedding"] and "embedding" not in frame.columns
    assert_same_vectors(np.stack(with_column["embedding"]), want_few)
    shuffled = datasets.Dataset(few).shuffle(seed=0)  # an indices mapping: rows come back in the dataset's order
    order = [few["id"].to_pylist().index(i) for i in shuffled["id"]]
    with_column = embedpipe.embed(shuffled, model=MODEL, add_column="e")
    assert_same_vectors(np.asarray(with_column["e"]), want_few[order])
    arrow = embedpipe.embed(few, model=MODEL, add_column="embedding")
    assert arrow.column_names == [*few.column_names, "embedding"]
    assert arrow.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert_same_vectors(np.asarray(arrow["embedding"].to_pylist()), want_few)

    one = embedpipe.embed(table["text"][0].as_py(), model=MODEL)
    assert one.shape == (384,)
    assert_same_vectors(one[None], want[:1])


def test_embed_options_are_the_job_schema_fields(minilm_dir):
    texts = ["a short text", "a somewhat longer text that truncation at eight tokens will cut"]
    from embedpipe.runtime import Encoder

    want = Encoder.from_options(str(minilm_dir), max_seq_len=8, pooling="cls", normalize=False).embed(texts)
    got = embedpipe.embed(texts, model=str(minilm_dir), max_seq_len=8, pooling="cls", normalize=False)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.abs(got - embedpipe.embed(texts, model=str(minilm_dir))).max() > 1e-2  # the options did something

    names = option_names()
    model_fields = {f.name for f in dataclasses.fields(SECTIONS["model"])} - {"path"}
    assert {k for k, (s, _) in names.items() if s == "model"} == model_fields  # every model.* field
    assert names["dtype"] == ("model", "dtype") and names["device"] == ("runtime", "device")
    output_fields = {f.name for f in dataclasses.fields(SECTIONS["output"])}
    assert {f for s, f in names.values() if s == "output"} == {"dim", "dtype", "calibration_rows",
                                                                "calibration_seed", "document_vectors"} & output_fields
    assert {f for s, f in names.values() if s == "input"} == {"on_bad_row", "chunking"}
    job = job_for_options(MODEL, {"max_seq_len": 64, "dtype": "bfloat16", "max_tokens": 1024, "device": "cpu"})
    assert (job.model.max_seq_len, job.model.dtype, job.batching.max_tokens, job.runtime.device) == (64, "bfloat16", 1024, "cpu")


def test_embed_warns_once_when_its_dtype_measured_slower_than_float32(minilm_dir, tmp_path, monkeypatch, caplog):
    """The driver's warning in process: the probe's rates (seeded into its cache, as an AVX2-only EPYC measured
    them, then as an AMX Xeon did) decide it, once per encoder; float32, the CPU's auto, probes nothing."""
    from collections import OrderedDict

    import torch

    from embedpipe.api import inprocess
    from embedpipe.report.device import cache_key, cache_path, cpu_model, describe_device

    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(inprocess, "_ENCODERS", OrderedDict())
    embedpipe.embed(["no probe in float32"], model=str(minilm_dir), device="cpu")  # a GPU machine too
    assert not cache_path().exists()

    info = describe_device("cpu", probe=False)
    assert info.name == cpu_model() and info.threads == torch.get_num_threads()

    def seed(rates: dict[str, float]) -> None:
        cache_path().write_text(json.dumps({cache_key(info, dtype): rate for dtype, rate in rates.items()}))
        inprocess._ENCODERS.clear()

    seed({"float32": 1.86e11, "bfloat16": 2.09e10})
    with caplog.at_level("WARNING", logger="embedpipe.api.inprocess"):
        for _ in range(2):
            embedpipe.embed(["a short text"], model=str(minilm_dir), dtype="bfloat16", device="cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "embedpipe.api.inprocess"]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"embed(dtype=...) bfloat16 on {info.name}: its bfloat16 matmul measured 21 GFLOP/s")
    assert 'so embed() is slower than float32' in lines[0] and lines[0].endswith('set dtype="float32" (or "auto") for '
                                                                                   'this machine')
    caplog.clear()
    seed({"float32": 1.4e11, "bfloat16": 1.6e12})
    with caplog.at_level("WARNING", logger="embedpipe.api.inprocess"):
        embedpipe.embed(["a short text"], model=str(minilm_dir), dtype="bfloat16", device="cpu")
    assert not [r for r in caplog.records if r.name == "embedpipe.api.inprocess"]


def test_embed_prompt_dim_and_quantized_outputs(minilm_dir, tmp_path):
    """prompt, dim and output_dtype as the job applies them; int8 ranges fitted on the inputs or
    taken from a job's quantization.json (queries quantized as that job's vectors were)."""
    from embedpipe.io.quantize import Calibration, fit_calibration, quantize
    from embedpipe.runtime import Encoder

    texts = [f"text number {i} about {w}" for i, w in enumerate(["disks", "memory", "scheduling", "ext4"] * 5)]
    floats = Encoder.from_options(str(minilm_dir), prompt="query: ", dim=128).embed(texts)
    got = embedpipe.embed(texts, model=str(minilm_dir), prompt="query: ", dim=128)
    np.testing.assert_allclose(got, floats, rtol=0, atol=1e-6)
    assert np.abs(got - embedpipe.embed(texts, model=str(minilm_dir), dim=128)).max() > 1e-2  # the prompt counts

    half = embedpipe.embed(texts, model=str(minilm_dir), prompt="query: ", dim=128, output_dtype="float16")
    assert half.dtype == np.float16 and np.abs(half.astype(np.float32) - floats).max() < 1e-3
    bits = embedpipe.embed(texts, model=str(minilm_dir), prompt="query: ", dim=128, output_dtype="ubinary")
    np.testing.assert_array_equal(bits, np.packbits(floats > 0, axis=-1))

    own = embedpipe.embed(texts, model=str(minilm_dir), prompt="query: ", dim=128, output_dtype="int8",
                          calibration_rows=10, calibration_seed=3)
    pick = np.sort(np.random.default_rng(3).choice(len(texts), size=10, replace=False))
    mine = fit_calibration(floats[pick], precision="int8", seed=3, input_rows=len(texts))
    np.testing.assert_array_equal(own, quantize(floats, dtype="int8", calibration=mine))

    job_calibration = fit_calibration(floats[::2] * 0.5, precision="int8", seed=0, input_rows=100)
    (tmp_path / "quantization.json").write_text(json.dumps({"dtype": "int8", "dim": 128, "width": 128,
                                                            "calibration": json.loads(job_calibration.to_json())}))
    for given in (job_calibration, tmp_path, tmp_path / "quantization.json"):
        queries = embedpipe.embed(texts[:4], model=str(minilm_dir), prompt="query: ", dim=128, output_dtype="int8",
                                  calibration=given)
        np.testing.assert_array_equal(queries, quantize(floats[:4], dtype="int8", calibration=job_calibration))
    with pytest.raises(ValueError, match="pass output_dtype='int8'"):
        embedpipe.embed(texts[:1], model=str(minilm_dir), dim=128, output_dtype="uint8", calibration=job_calibration)
    with pytest.raises(FileNotFoundError, match="no quantization.json"):
        embedpipe.embed(texts[:1], model=str(minilm_dir), output_dtype="int8", calibration=tmp_path / "nowhere")
    assert isinstance(job_calibration, Calibration)


@pytest.mark.parametrize("options, option, words", [
    ({"dtype": "fp32"}, "dtype", "'fp32' is not one of float32, bfloat16, float16, auto (fix: set dtype to one of them)"),
    ({"max_seqlen": 8}, "max_seqlen", "unknown option (fix: did you mean max_seq_len=?)"),
    ({"max_seq_len": 0}, "max_seq_len", "must be positive"),
    ({"normalize": "yes"}, "normalize", "true/false or one of auto"),
])
def test_bad_embed_options_name_the_option(options, option, words):
    with pytest.raises(JobError) as err:
        embedpipe.embed(["x"], model=MODEL, **options)
    assert err.value.field_path == option and words in str(err.value) and str(err.value).startswith("embed(): ")


@pytest.mark.parametrize("options, option, words", [
    ({"prompt_name": "query"}, "prompt_name", "the model defines no prompts"),
    ({"dim": 512}, "dim", "512 exceeds the model's dimension 384 (fix: set dim to at most 384"),
])
def test_embed_options_checked_against_the_model(options, option, words):
    """The check a job run makes in preflight, before any model is loaded: errors name the option."""
    with pytest.raises(JobError) as err:
        embedpipe.embed(["x"], model=MODEL, **options)
    assert err.value.field_path == option and words in str(err.value) and str(err.value).startswith("embed(): ")


def test_bad_embed_inputs_say_what_to_pass(minilm_dir):
    pd = pytest.importorskip("pandas")
    with pytest.raises(InputError, match=r"inputs\[1\] is 3, not a string"):
        embedpipe.embed(["a", 3], model=MODEL)
    with pytest.raises(InputError, match=r"embed\(\): row 1 has a bad text \(null\).*pass on_bad_row='embed_empty'"):
        embedpipe.embed(["a", None], model=MODEL)
    with pytest.raises(InputError, match="no column 'text' .*pass text_column="):
        embedpipe.embed(pd.DataFrame({"body": ["a"]}), model=MODEL)
    with pytest.raises(InputError, match=r"row 2 has a bad text \(empty\)"):
        embedpipe.embed(pd.DataFrame({"body": ["a", "b", " "]}), model=MODEL, text_column="body")
    with pytest.raises(JobError, match="on_bad_row: 'skip' would leave rows without a vector"):
        embedpipe.embed(["a"], model=MODEL, on_bad_row="skip")
    # embed_empty: a bad row is embedded as "", as a job with input.on_bad_row: embed_empty does
    got = embedpipe.embed(pa.table({"text": ["a", None, ""]}), model=MODEL, on_bad_row="embed_empty")
    from embedpipe.runtime import Encoder

    np.testing.assert_allclose(got, Encoder.from_options(str(minilm_dir)).embed(["a", "", ""]), atol=1e-6)
    with pytest.raises(TypeError, match="pass a string, a list of strings"):
        embedpipe.embed(42, model=MODEL)
    assert embedpipe.embed([], model=MODEL).shape == (0, 384)


def test_embed_with_chunking_gives_chunks_or_document_vectors(minilm_dir):
    """chunking= (a mapping, or the mode alone) returns the chunks as ChunkVectors, in input order, with the
    in-process encoder's offsets and vectors; document_vectors='mean' one vector per row; misuse names the fix."""
    from embedpipe.api.inprocess import ChunkVectors
    from embedpipe.config import BatchingConfig, ChunkingConfig, ModelConfig, RuntimeConfig
    from embedpipe.io.writer import document_means
    from embedpipe.runtime import Encoder

    long = " ".join(f"Sentence {i} of the long text says something about kernels." for i in range(40))
    texts = ["a short text", long, "another short one", long[:300]]
    chunking = {"mode": "split", "max_tokens": 48, "overlap": 4}
    encoder = Encoder(model=ModelConfig(path=str(minilm_dir)), batching=BatchingConfig(), runtime=RuntimeConfig(),
                      chunking=ChunkingConfig(**chunking))
    want_chunks, want = encoder.embed_chunks(texts)
    got = embedpipe.embed(texts, model=str(minilm_dir), chunking=chunking)
    assert isinstance(got, ChunkVectors) and len(got) == len(want_chunks) > len(texts) + 4
    assert got.row.tolist() == want_chunks.doc.tolist() and got.chunk.tolist() == want_chunks.chunk.tolist()
    assert got.start.tolist() == want_chunks.start.tolist() and got.end.tolist() == want_chunks.end.tolist()
    np.testing.assert_allclose(got.vectors, want, atol=1e-6)
    assert sorted(set(got.row.tolist())) == [0, 1, 2, 3] and np.bincount(got.row)[[0, 2]].tolist() == [1, 1]
    table = got.to_arrow()
    assert table.column_names == ["row", "chunk", "start", "end", "embedding"] and table.num_rows == len(got)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    # the mode alone: the other fields' defaults (max_tokens: the model's max_seq_len)
    default = embedpipe.embed(texts, model=str(minilm_dir), chunking="split")
    assert len(texts) < len(default) < len(got)
    # one vector per row: each row's normalised mean of its chunks, float32 or float16 as output_dtype says
    means = embedpipe.embed(texts, model=str(minilm_dir), chunking=chunking, document_vectors="mean")
    assert means.shape == (4, 384) and means.dtype == np.float32
    np.testing.assert_allclose(means, document_means(want, doc=want_chunks.doc, documents=4), atol=1e-6)
    np.testing.assert_allclose(means[[0, 2]], embedpipe.embed([texts[0], texts[2]], model=str(minilm_dir)),
                               atol=1e-6)  # a one-chunk row's mean is its vector
    half = embedpipe.embed(texts, model=str(minilm_dir), chunking=chunking, document_vectors="mean",
                           output_dtype="float16")
    assert half.dtype == np.float16 and np.abs(half.astype(np.float32) - means).max() < 1e-3
    one = embedpipe.embed(long, model=str(minilm_dir), chunking=chunking, document_vectors="mean")
    np.testing.assert_allclose(one, means[1], atol=1e-6)
    frame = embedpipe.embed(pa.table({"text": texts}), model=str(minilm_dir), chunking=chunking,
                            document_vectors="mean", add_column="v")
    np.testing.assert_allclose(np.asarray(frame["v"].to_pylist()), means, atol=1e-6)
    with pytest.raises(TypeError, match="add_column needs one vector per row.*document_vectors='mean'"):
        embedpipe.embed(pa.table({"text": texts}), model=str(minilm_dir), chunking=chunking, add_column="v")
    with pytest.raises(JobError, match="document_vectors.*needs chunked documents"):
        embedpipe.embed(texts, model=str(minilm_dir), document_vectors="mean")
    with pytest.raises(JobError, match="did you mean input.chunking.max_tokens"):
        embedpipe.embed(texts, model=str(minilm_dir), chunking={"mode": "split", "max_token": 8})


def test_embed_starts_no_ray():
    code = ("import sys, embedpipe; v = embedpipe.embed(['x'], model='sentence-transformers/all-MiniLM-L6-v2'); "
            "assert v.shape == (1, 384); assert 'ray' not in sys.modules, 'embed imported ray'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr


@pytest.mark.slow
def test_job_built_in_code_runs_and_reports(tmp_path, small_corpus, parquet_cli_vectors, ray_session):
    table, path = small_corpus
    job = embedpipe.Job(input={"path": str(path), "unit_rows": 100}, model=MODEL, output={"path": "out"},
                        batching={"max_tokens": 4096}, cluster={"workers": 1, "cpus_per_worker": 1},
                        name="api", base=tmp_path)
    assert job.spec.output.path == str(tmp_path / "out")  # relative to base
    result = job.run(progress=False)
    assert result.report["rows"] == 300 and result.report["units"]["total"] == 3
    assert result.output_path == tmp_path / "out" and (result.output_path / "report.json").is_file()
    vectors = ds.dataset(result.vectors_path, format="parquet").to_table()
    got = dict(zip(vectors["id"].to_pylist(), np.asarray(vectors["embedding"].to_pylist())))
    ids = table["id"].to_pylist()
    assert_same_vectors([got[i] for i in ids], [parquet_cli_vectors[i] for i in ids], min_cos=0.999999)


def test_job_from_yaml_errors_and_submit(tmp_path, monkeypatch):
    path = write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)}, model={"path": MODEL},
                     output={"path": "out"})
    job = embedpipe.Job.from_yaml(path, overrides=["batching.max_tokens=1024"])
    assert job.spec.batching.max_tokens == 1024 and job.spec.output.path == str(tmp_path / "out")
    with pytest.raises(JobError, match=r"Job\(\.\.\.\): model.dtype: 'fp8' is not one of"):
        embedpipe.Job(input={"path": str(QUICKSTART)}, model={"path": MODEL, "dtype": "fp8"}, output={"path": "o"})

    seen = []
    monkeypatch.setattr("embedpipe.cluster.driver.run_job",
                        lambda spec, progress, overwrite: seen.append(spec) or "result")
    assert job.submit("ray://head:10001", progress=False) == "result"
    assert seen[0].cluster.address == "ray://head:10001" and seen[0].batching.max_tokens == 1024
    assert job.spec.cluster.address == ""  # submit leaves the job as it was


def test_job_takes_every_section_of_the_schema():
    """Job(...)'s keywords are the schema's sections: cost= (once rejected: they were listed by hand)."""
    job = embedpipe.Job(input={"path": str(QUICKSTART)}, model=MODEL, output={"path": "o"},
                        cost={"gpu_hour_usd": 2.5})
    assert job.spec.cost.gpu_hour_usd == 2.5
    assert set(inspect.signature(embedpipe.Job).parameters) >= set(SECTIONS)
    with pytest.raises(JobError, match=r"Job\(\.\.\.\): costs: unknown section"):
        embedpipe.Job(input={"path": str(QUICKSTART)}, model=MODEL, output={"path": "o"}, costs={})
