"""Index outputs end to end: the real CLI on a real local Ray, the real model, real text.

Flat, IVF-PQ, HNSW and auto each build from a run; the index holds exactly the corpus' ids; a corpus
text as query finds its own row; the reported recall equals one recomputed here from the vectors;
an IVF built by 2 workers equals one built by 1 worker; bad settings fail before any worker starts.
"""

import json

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import embedpipe
from embedpipe.cli import app
from tests.conftest import split_corpus, write_job
from tests.index_helpers import assert_same_neighbours, recompute_recall

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_faiss_thread")]

ROWS = 320  # 2 files x 2 row groups: 4 work units of 80 short texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, quickstart_table):
    t = quickstart_table
    t = t.filter(pc.less(pc.utf8_length(t["text"]), 150))
    _, first = np.unique(np.array(t["text"].to_pylist(), dtype=object), return_index=True)
    t = t.take(np.sort(first)[:ROWS])  # unique texts: a text's nearest row is its own
    folder = tmp_path_factory.mktemp("index-corpus")
    split_corpus(t, folder, files=2, row_group_size=ROWS // 4)
    return t, folder


def run(tmp_path, folder, *, name, workers=1, **output):
    job = write_job(tmp_path / f"{name}.yaml", input={"path": str(folder), "unit_rows": ROWS // 4},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2", "max_seq_len": 64},
                    batching={"max_tokens": 2048},
                    output={"path": str(tmp_path / name), **output},
                    cluster={"workers": workers, "cpus_per_worker": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    out = tmp_path / name
    return out, json.loads((out / "report.json").read_text())["index"], result.output


def index_ids_of(out) -> tuple[list, np.ndarray]:
    ids = pq.read_table(out / "index" / "ids.parquet")
    return ids["id"].to_pylist(), np.array(ids["index_id"].to_pylist())


@pytest.fixture(scope="module")
def flat(tmp_path_factory, corpus, ray_session, minilm_dir):
    """Flat, format both: the vectors stay and are the reference for the other runs."""
    tmp = tmp_path_factory.mktemp("flat")
    out, report, printed = run(tmp, corpus[1], name="flat", format="both", index="Flat")
    table = ds.dataset(out / "vectors", format="parquet").to_table()
    vectors = dict(zip(table["id"].to_pylist(), np.asarray(table["embedding"].to_pylist(), dtype=np.float32)))
    return out, report, printed, vectors


@pytest.fixture(scope="module")
def ivfpq_two_workers(tmp_path_factory, corpus, ray_session):
    tmp = tmp_path_factory.mktemp("ivfpq2")
    return run(tmp, corpus[1], name="ivfpq", workers=2, format="faiss", index="IVF8,PQ16x4")


def check_recall(out, report, vectors):
    ids, index_ids = index_ids_of(out)
    matrix = np.stack([vectors[i] for i in ids])
    r10, r1, stored, exact = recompute_recall(out / "index", index_ids, matrix)
    assert_same_neighbours(stored, exact)
    assert (report["recall_at_10"], report["recall_at_1"]) == (r10, r1)


def test_flat_exact_index(flat, corpus):
    table, _ = corpus
    out, report, printed, vectors = flat
    ids, _ = index_ids_of(out)
    assert sorted(ids) == sorted(table["id"].to_pylist()) and report["ntotal"] == ROWS
    assert report["factory"] == "Flat" and report["recall_at_10"] == report["recall_at_1"] == 1.0
    assert report["target_reached"]
    assert report["bytes"] == (out / "index" / "index.faiss").stat().st_size and report["build_seconds"] > 0
    assert "index: Flat" in printed and "target 0.95 reached" in printed
    check_recall(out, report, vectors)
    text, own = table["text"][123].as_py(), table["id"][123].as_py()
    hits = embedpipe.open_index(out).search([text, table["text"][5].as_py()], k=10)
    assert len(hits) == 2 and hits[0][0][0] == own and hits[0][0][1] == pytest.approx(1.0, abs=1e-4)
    assert hits[1][0][0] == table["id"][5].as_py()
    assert [s for _, s in hits[0]] == sorted((s for _, s in hits[0]), reverse=True)
    meta = json.loads((out / "index" / "index.json").read_text())
    assert meta["job"]["model"]["max_seq_len"] == 64 and meta["metric"] == "inner_product"


def test_search_command_prints_ids_scores_and_text(flat, corpus):
    table, _ = corpus
    out = flat[0]
    text, own = table["text"][42].as_py(), table["id"][42].as_py()
    result = CliRunner().invoke(app, ["search", str(out), text, "-k", "3"])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0].split(None, 3)
    assert first[0] == "1" and float(first[1]) == pytest.approx(1.0, abs=1e-3) and first[2] == own
    assert first[3] == " ".join(text.split())[:120] and len(result.output.splitlines()) == 3
    missing = CliRunner().invoke(app, ["search", str(out / "nowhere"), "x"])
    assert missing.exit_code == 2 and "no index" in missing.output


def test_ivf_pq_index(ivfpq_two_workers, flat, corpus):
    table, _ = corpus
    out, report, printed = ivfpq_two_workers
    ids, _ = index_ids_of(out)
    assert sorted(ids) == sorted(table["id"].to_pylist()) and report["ntotal"] == ROWS
    assert "nprobe" in report["search_params"] and len(list((out / "vectors").glob("*.parquet"))) == 4
    check_recall(out, report, flat[3])
    opened = embedpipe.open_index(out)
    for row in (7, 200):
        hits = opened.search(table["text"][row].as_py(), k=10)[0]
        assert table["id"][row].as_py() in [i for i, _ in hits]
    if not report["target_reached"]:  # PQ16x4 on 384 dimensions is a heavy compression: say so
        assert "warning: index IVF8,PQ16x4 reaches recall@10" in printed and "RFlat" in printed


def test_two_workers_build_the_same_index_as_one(ivfpq_two_workers, tmp_path, corpus, ray_session):
    two = ivfpq_two_workers[0]
    one, report, _ = run(tmp_path, corpus[1], name="ivfpq1", workers=1, format="faiss", index="IVF8,PQ16x4")
    assert report["ntotal"] == ROWS
    assert pq.read_table(one / "index" / "ids.parquet").equals(pq.read_table(two / "index" / "ids.parquet"))
    a, b = (faiss.read_index(str(p / "index" / "index.faiss")) for p in (one, two))
    ivf_a, ivf_b = faiss.extract_index_ivf(a), faiss.extract_index_ivf(b)
    for lst in range(ivf_a.nlist):
        n = ivf_a.invlists.list_size(lst)
        assert n == ivf_b.invlists.list_size(lst)
        ids_a = faiss.rev_swig_ptr(ivf_a.invlists.get_ids(lst), n).copy()
        ids_b = faiss.rev_swig_ptr(ivf_b.invlists.get_ids(lst), n).copy()
        codes_a = faiss.rev_swig_ptr(ivf_a.invlists.get_codes(lst), n * ivf_a.code_size).copy()
        codes_b = faiss.rev_swig_ptr(ivf_b.invlists.get_codes(lst), n * ivf_b.code_size).copy()
        assert np.array_equal(ids_a, ids_b) and np.array_equal(codes_a, codes_b)
    assert (one / "index" / "index.faiss").read_bytes() == (two / "index" / "index.faiss").read_bytes()


def test_hnsw_index(tmp_path, corpus, flat, ray_session):
    table, folder = corpus
    out, report, _ = run(tmp_path, folder, name="hnsw", format="faiss", index="HNSW32")
    ids, _ = index_ids_of(out)
    assert sorted(ids) == sorted(table["id"].to_pylist())
    assert "efSearch" in report["search_params"] and report["target_reached"]
    check_recall(out, report, flat[3])
    hits = embedpipe.open_index(out).search(table["text"][300].as_py(), k=10)[0]
    assert table["id"][300].as_py() in [i for i, _ in hits]


def test_changing_only_the_index_reuses_every_unit(tmp_path, corpus, flat, ray_session):
    """Index settings are not part of the job fingerprint: the rerun embeds nothing and rebuilds the index."""
    import shutil

    table, folder = corpus
    shutil.copytree(flat[0], tmp_path / "reindex")
    out, report, _ = run(tmp_path, folder, name="reindex", format="faiss", index="HNSW32", target_recall=0.9)
    whole = json.loads((out / "report.json").read_text())
    assert whole["units"]["skipped_as_done"] == whole["units"]["total"] == 4 and whole["units"]["encoded"] == 0
    assert report["factory"] == "HNSW32" and report["ntotal"] == ROWS
    check_recall(out, report, flat[3])


def test_a_sharded_index_alone_runs_on_the_drivers_workers(tmp_path, corpus, flat, ray_session):
    """Nothing left to embed and an IVF index: the shards are added by workers the driver hands the
    build (embedpipe/cluster/shards.py), on the Ray the driver connected; the index holds every row."""
    import shutil

    table, folder = corpus
    shutil.copytree(flat[0], tmp_path / "reshard")
    out, report, _ = run(tmp_path, folder, name="reshard", format="faiss", index="IVF4,Flat", target_recall=0.9)
    whole = json.loads((out / "report.json").read_text())
    assert whole["units"]["encoded"] == 0 and report["factory"] == "IVF4,Flat" and report["ntotal"] == ROWS
    assert report["kind"] == "ivf" and "merge" in report["stages"]  # added as per-unit shards, then merged
    check_recall(out, report, flat[3])


def test_auto_index_under_a_tight_budget(tmp_path, corpus, flat, ray_session):
    """0.4 MB holds no flat copy of 320 x 384 floats (0.51 MB with ids; the size model has no fixed allowance
    since #18, which is why this budget was 1.4 MB before): auto compresses, and proves it."""
    table, folder = corpus
    out, report, _ = run(tmp_path, folder, name="auto", format="faiss", index="auto", index_memory_gb=0.0004)
    assert report["auto"] and report["factory"] == "IVF8,SQfp16" and report["target_reached"]
    assert report["bytes"] <= 0.0004e9
    ids, _ = index_ids_of(out)
    assert sorted(ids) == sorted(table["id"].to_pylist())
    check_recall(out, report, flat[3])
    hits = embedpipe.open_index(out).search(table["text"][17].as_py(), k=10)[0]
    assert table["id"][17].as_py() in [i for i, _ in hits]


def test_matryoshka_float16_index_with_a_document_prompt(tmp_path, corpus, ray_session, minilm_dir):
    """output.dim sizes the index; float16 parts feed it; queries get the query prompt (here none),
    never the documents' model.prompt."""
    from embedpipe.runtime import Encoder

    table, folder = corpus
    job = write_job(tmp_path / "job.yaml", input={"path": str(folder), "unit_rows": ROWS // 2},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2", "max_seq_len": 64, "prompt": "passage: "},
                    batching={"max_tokens": 2048},
                    output={"path": str(tmp_path / "o"), "format": "both", "index": "Flat", "dim": 128,
                            "dtype": "float16"},
                    cluster={"workers": 1})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "o"
    part = pq.read_table(sorted((out / "vectors").glob("*.parquet"))[0])
    assert part.schema.field("embedding").type == pa.list_(pa.float16(), 128)
    index = faiss.read_index(str(out / "index" / "index.faiss"))
    assert index.d == 128 and index.ntotal == ROWS
    opened = embedpipe.open_index(out)
    texts = [table["text"][i].as_py() for i in (3, 250)]
    want = Encoder.from_options(str(minilm_dir), max_seq_len=64, dim=128, prompt="").embed(texts)
    np.testing.assert_allclose(opened.embed(texts), want, atol=1e-6)
    passage = embedpipe.open_index(out, query_prompt="passage: ")
    hits = passage.search(texts, k=3)
    assert [h[0][0] for h in hits] == [table["id"][3].as_py(), table["id"][250].as_py()]
    assert hits[0][0][1] == pytest.approx(1.0, abs=2e-3)  # the stored float16 copy of the same vector


@pytest.mark.parametrize("output, field, words", [
    ({"index": "IVF8,PQ36"}, "output.index", "does not divide the dimension 384"),
    ({"index": "IVF8,PQ"}, "output.index", "must be followed by how vectors are stored"),
    ({"index": "IVF4096,Flat"}, "output.index", "at least 4,096 vectors"),
    ({"index_memory_gb": 0.00005}, "output.index_memory_gb", "too small for any index"),  # IVF8,SQ4 takes 84 kB
    ({"dtype": "int8"}, "output.dtype", "FAISS compresses vectors itself"),
    ({"dtype": "binary", "index": "Flat"}, "output.dtype", "'HNSW32,SQ8'"),
])
def test_bad_index_settings_fail_at_validation(tmp_path, corpus, output, field, words):
    job = write_job(tmp_path / "job.yaml", input={"path": str(corpus[1])},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"},
                    output={"path": str(tmp_path / "o"), "format": "faiss", **output})
    for command in (["validate", str(job)], ["run", str(job), "--no-progress"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        assert field in result.output and words in result.output and "fix:" in result.output
    made = {p.name for p in (tmp_path / "o").iterdir()} if (tmp_path / "o").exists() else set()
    assert not made & {"vectors", "index", "_manifest", "report.json"}  # failed before any worker or output
