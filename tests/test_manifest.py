import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedpipe.config import parse_job
from embedpipe.io.manifest import Manifest, ManifestMismatch, job_fingerprint


def _fp(tmp_path, minilm_dir, output=None, **model):
    data = tmp_path / "in.parquet"
    if not data.exists():
        pq.write_table(pa.table({"id": ["a"], "text": ["t"]}), data)
    job = parse_job({"input": {"path": str(data)}, "model": {"path": str(minilm_dir), **model},
                     "output": {"path": str(tmp_path / "out"), **(output or {})}})
    return job_fingerprint(job, files=[str(data)], model_dir=minilm_dir)


def test_fingerprint_tracks_settings_inputs_and_model(tmp_path, minilm_dir):
    base = _fp(tmp_path, minilm_dir)
    assert _fp(tmp_path, minilm_dir)["sha256"] == base["sha256"]
    assert _fp(tmp_path, minilm_dir, max_seq_len=64)["sha256"] != base["sha256"]
    for changed in ({"dim": 128}, {"dtype": "float16"}, {"prompt": "query: "}):  # the stored vectors change
        section = {"output": changed} if "prompt" not in changed else {}
        assert _fp(tmp_path, minilm_dir, **section, **({} if section else changed))["sha256"] != base["sha256"]
    # how the index is built from the parts does not change them: a rerun reuses every unit
    index_only = {"format": "both", "index": "HNSW32", "index_memory_gb": 2.0, "target_recall": 0.9}
    assert _fp(tmp_path, minilm_dir, output=index_only)["sha256"] == base["sha256"]
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["t", "u"]}), tmp_path / "in.parquet")
    assert _fp(tmp_path, minilm_dir)["sha256"] != base["sha256"]


def test_other_job_is_refused_and_overwrite_replaces(tmp_path, minilm_dir):
    out = tmp_path / "out"
    Manifest.open(out, _fp(tmp_path, minilm_dir))
    (out / "vectors").mkdir()
    (out / "vectors" / "part-00000-00000.parquet").write_bytes(b"x")
    Manifest.open(out, _fp(tmp_path, minilm_dir))  # same job: resume
    with pytest.raises(ManifestMismatch, match="changed: settings.*--overwrite"):
        Manifest.open(out, _fp(tmp_path, minilm_dir, dtype="bfloat16"))
    Manifest.open(out, _fp(tmp_path, minilm_dir, dtype="bfloat16"), overwrite=True)
    assert not (out / "vectors").exists()


def test_output_without_manifest_is_refused(tmp_path, minilm_dir):
    (tmp_path / "out" / "vectors").mkdir(parents=True)
    with pytest.raises(ManifestMismatch, match="without a manifest"):
        Manifest.open(tmp_path / "out", _fp(tmp_path, minilm_dir))


def test_unit_is_done_only_with_record_and_intact_parts(tmp_path):
    m = Manifest(tmp_path)
    vectors = tmp_path / "vectors"
    vectors.mkdir()
    for unit in ("00000-00000", "00000-00001", "00000-00002"):
        (vectors / f"part-{unit}.parquet").write_bytes(b"vectors of " + unit.encode())
    m.record("00000-00000", parts=[vectors / "part-00000-00000.parquet"], counters={})
    m.record("00000-00001", parts=[vectors / "part-00000-00001.parquet"], counters={})
    (vectors / "part-00000-00001.parquet").write_bytes(b"truncated")  # torn after its record
    (vectors / ".part-00000-00003.parquet.123.tmp").write_bytes(b"half")
    done = m.done()
    assert set(done) == {"00000-00000"}
    assert json.loads((m.root / "units" / "00000-00000.json").read_text())["parts"][0]["sha256"]
    m.clean_partials(set(done))
    assert sorted(p.name for p in vectors.iterdir()) == ["part-00000-00000.parquet"]
    assert sorted(p.name for p in (m.root / "units").iterdir()) == ["00000-00000.json"]
