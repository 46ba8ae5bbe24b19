"""End to end through the CLI on the shared local Ray: output.dtype int8 with 2 workers.
The calibration is fitted once by the driver, so every part carries the same ranges; an
incremental night reuses both the ranges and the stored bytes of unchanged rows."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.io.quantize import METADATA_KEY, Calibration, quantize
from embedpipe.cluster.calibrate import sample_texts
from embedpipe.config import InputConfig, load_job
from embedpipe.report.counters import Counters
from embedpipe.runtime import Encoder
from embedpipe.units import list_files, plan_units
from tests.conftest import split_corpus, write_job

pytestmark = pytest.mark.slow


def test_int8_two_workers_share_one_calibration(tmp_path, quickstart_table, ray_session, minilm_dir):
    table = quickstart_table.slice(0, 400)
    folder = tmp_path / "corpus"
    split_corpus(table, folder, files=2, row_group_size=100)  # 4 units
    job = write_job(tmp_path / "job.yaml",
                    input={"path": str(folder), "unit_rows": 100},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2", "prompt": "passage: "},
                    batching={"max_tokens": 2048},
                    output={"path": str(tmp_path / "out"), "dtype": "int8", "dim": 256,
                            "calibration_rows": 150, "calibration_seed": 5},
                    cluster={"workers": 2, "cpus_per_worker": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output

    record = json.loads((tmp_path / "out" / "quantization.json").read_text())
    calibration = Calibration(**record["calibration"])
    assert record["dtype"] == "int8" and record["dim"] == record["width"] == 256
    assert calibration.rows == 150 and calibration.seed == 5 and calibration.input_rows == 400
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["calibration"]["rows"] == 150 and 0 < report["calibration"]["seconds"] < report["wall_seconds"]
    # its pieces are on the workers' timelines (4: two per worker), before any unit
    pieces = [span for w in report["per_worker"] for span in w["timeline"] if span[2] == 0]
    assert len(pieces) == 4 and sum(span[3] for span in pieces) > 0
    assert report["startup_seconds"] == min(span[0] for w in report["per_worker"] for span in w["timeline"])
    assert sum(w["units"] for w in report["per_worker"]) == 4
    parts = sorted((tmp_path / "out" / "vectors").glob("part-*.parquet"))
    assert len(parts) == 4
    for part in parts:  # every part: the very same record as quantization.json
        schema = pq.read_schema(part)
        assert json.loads(schema.metadata[METADATA_KEY]) == record
        assert schema.field("embedding").type == pa.list_(pa.int8(), 256)

    # The ranges are those of the seeded sample, and the stored bytes are the run's floats quantized with them.
    encoder = Encoder.from_options(str(minilm_dir), prompt="passage: ", dim=256)
    units = plan_units(list_files(str(folder)), unit_rows=100)
    sample = sample_texts(InputConfig(path=str(folder)), units, rows=150, seed=5)
    np.testing.assert_allclose(calibration.ranges_array, np.vstack([(v := encoder.embed(sample)).min(0), v.max(0)]),
                               atol=1e-6)
    out = pq.read_table(parts)
    texts = dict(zip(table["id"].to_pylist(), table["text"].to_pylist()))
    counted = Counters()
    floats = encoder.embed([texts[i] for i in out["id"].to_pylist()], counted)
    assert (report["tokens"], report["truncated_rows"]) == (counted.tokens, counted.truncated_rows)  # as if all
    # were embedded by their units: the rows taken from the sample count there
    stored = np.asarray(out["embedding"].to_pylist(), dtype=np.int8)
    want = quantize(floats, dtype="int8", calibration=calibration)
    assert np.abs(stored.astype(int) - want).max() <= 1 and (stored != want).mean() < 1e-3
    # the sample holds 150 of 400 rows: the units took its vectors for those rows instead of embedding them again
    assert report["calibration"]["rows_kept"] == sum(texts[i] in set(sample) for i in out["id"].to_pylist())
    assert report["calibration"]["rows_kept"] >= 150


@pytest.mark.parametrize("incremental", [False, True], ids=["plain", "incremental"])
def test_chunked_int8_fits_its_ranges_on_chunk_vectors_and_keeps_them(tmp_path, quickstart_table, ray_session,
                                                                        incremental):
    """input.chunking split with int8 through the CLI: the ranges are those of the sampled documents' chunk
    vectors (each piece's ``documents_within``), the units take those documents' chunks instead of embedding them
    again, and the stored bytes and the report are as if every document had been embedded by its unit. An
    incremental output's first night too (its units hash each document and store before they write)."""
    from embedpipe.cluster.sampled import documents_within
    from embedpipe.versions import current_path

    table = quickstart_table.slice(0, 300)
    folder = tmp_path / "corpus"
    split_corpus(table, folder, files=1, row_group_size=100)  # 3 units
    job = write_job(tmp_path / "job.yaml",
                    input={"path": str(folder), "unit_rows": 100, "chunking": {"mode": "split", "max_tokens": 32}},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                    output={"path": str(tmp_path / "out"), "dtype": "int8", "calibration_rows": 200,
                            "calibration_seed": 3, "versioned": incremental, "incremental": incremental},
                    cluster={"workers": 2, "cpus_per_worker": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    out_dir = current_path(tmp_path / "out") if incremental else tmp_path / "out"

    encoder = Encoder.from_job(load_job(job))  # the run's own, chunking included
    units = plan_units(list_files(str(folder)), unit_rows=100)
    sample = sample_texts(InputConfig(path=str(folder)), units, rows=200, seed=3)
    bounds = np.linspace(0, len(sample), 5).astype(int)  # two pieces per worker
    fitted, held = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        piece = sample[a:b]
        keep = documents_within(encoder.chunker(piece)[1].per_document_of(len(piece)), rows=len(piece))
        held += [piece[i] for i in keep]
        fitted.append(encoder.embed_chunks([piece[i] for i in keep])[1])
    fitted = np.concatenate(fitted)
    record = json.loads((out_dir / "quantization.json").read_text())
    calibration = Calibration(**record["calibration"])
    report = json.loads((out_dir / "report.json").read_text())
    assert calibration.rows == report["calibration"]["rows"] == len(fitted) <= 200
    np.testing.assert_allclose(calibration.ranges_array, np.vstack([fitted.min(0), fitted.max(0)]), atol=1e-6)

    out = pq.read_table(sorted((out_dir / "vectors").glob("part-*.parquet")))
    counted = Counters()
    chunks, floats = encoder.embed_chunks(table["text"].to_pylist(), counted)  # every document, in input order
    assert out["id"].to_pylist() == table["id"].take(pa.array(chunks.doc)).to_pylist()
    assert out["chunk"].to_pylist() == chunks.chunk.tolist() and out["start"].to_pylist() == chunks.start.tolist()
    stored = np.asarray(out["embedding"].to_pylist(), dtype=np.int8)
    want = quantize(floats, dtype="int8", calibration=calibration)
    assert np.abs(stored.astype(int) - want).max() <= 1 and (stored != want).mean() < 1e-3
    kept = set(held)
    texts = table["text"].to_pylist()
    assert report["calibration"]["rows_kept"] == sum(texts[d] in kept for d in chunks.doc.tolist()) > 0
    assert (report["rows"], report["tokens"]) == (len(chunks), counted.tokens)  # as if all were embedded
    assert report["chunking"]["documents"] == 300 and report["chunking"]["chunks"] == len(chunks)


def test_incremental_int8_reuses_the_calibration_and_the_stored_bytes(tmp_path, quickstart_table, ray_session):
    """Night 2 changes 10 of 100 rows: the other 90 keep night 1's int8 bytes, the fresh 10 are quantized
    with night 1's ranges (one calibration for the whole index), and the calibration is not refitted."""
    import pyarrow.dataset as ds

    from embedpipe.versions import CURRENT

    base = quickstart_table.slice(0, 100).select(["id", "text"])
    data, root = tmp_path / "corpus.parquet", tmp_path / "index"
    pq.write_table(base, data, row_group_size=50)
    job = write_job(tmp_path / "nightly.yaml", input={"path": str(data), "unit_rows": 50},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, batching={"max_tokens": 2048},
                    output={"path": str(root), "versioned": True, "incremental": True, "dtype": "int8",
                            "calibration_rows": 60},
                    cluster={"workers": 1})

    def night(*, fits: bool) -> tuple[dict, dict]:
        result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
        assert result.exit_code == 0, result.output
        folder = root / "versions" / (root / CURRENT).read_text().strip()
        table = ds.dataset(folder / "vectors", format="parquet").to_table()
        stored = dict(zip(table["id"].to_pylist(), np.asarray(table["embedding"].to_pylist(), dtype=np.int8)))
        report = json.loads((folder / "report.json").read_text())  # a fit's rows and seconds: night 1 only
        assert report.get("calibration", {}).get("rows") == (60 if fits else None), report.get("calibration")
        return stored, json.loads((folder / "quantization.json").read_text())

    first, record1 = night(fits=True)
    ids, texts = base["id"].to_pylist(), base["text"].to_pylist()
    texts = [t + " (revised)" if i % 10 == 0 else t for i, t in enumerate(texts)]
    pq.write_table(pa.table({"id": ids, "text": texts}), data, row_group_size=50)
    second, record2 = night(fits=False)

    assert record2 == record1  # the ranges of night 1, not a new fit
    calibration = Calibration(**record1["calibration"])
    for i, row_id in enumerate(ids):
        if i % 10:
            np.testing.assert_array_equal(second[row_id], first[row_id])
    encoder = Encoder.from_options("sentence-transformers/all-MiniLM-L6-v2")
    fresh = quantize(encoder.embed(texts[::10]), dtype="int8", calibration=calibration)
    got = np.stack([second[row_id] for row_id in ids[::10]])
    assert np.abs(got.astype(int) - fresh).max() <= 1 and (got != fresh).mean() < 1e-3
