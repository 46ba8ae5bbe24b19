"""model.dtype: auto (the default) resolves per device: bfloat16 on CUDA, float32 on CPU; readers see the resolved one."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embedpipe.config import ModelConfig, RuntimeConfig, parse_job, resolve_dtype
from embedpipe.io.manifest import job_fingerprint
from embedpipe.report.device import DeviceInfo, describe_device
from embedpipe.runtime.encoder import Encoder, matmul_precision
from tests.test_report_metrics import SPANS, _metrics

GPU = DeviceInfo(kind="cuda", name="Test GPU", count=1, threads=1, host="g",
                 peak_flops={"float32": 5e9, "bfloat16": 8e10})  # small: MFU rounds to 6 places
CPU = DeviceInfo(kind="cpu", name="Test CPU", count=1, threads=2, host="h", peak_flops={"float32": 1e10})


def test_auto_is_the_default_and_resolves_per_device():
    assert ModelConfig(path="m").dtype == "auto"
    assert [resolve_dtype("auto", device=d) for d in ("cpu", "cuda", "cuda:1")] == ["float32", "bfloat16", "bfloat16"]
    for explicit in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(explicit, device="cuda") == resolve_dtype(explicit, device="cpu") == explicit


def test_encoder_on_cpu_runs_float32_by_default(minilm_dir):
    enc = Encoder.from_options(str(minilm_dir), device="cpu")
    assert enc.model_config.dtype == "auto" and enc.dtype == "float32"
    assert enc.loaded.dtype == torch.float32 and next(enc.loaded.model.parameters()).dtype == torch.float32
    assert enc.warmup is None  # the eager float32 path is the guard's own reference: nothing to check


def test_tf32_only_when_asked_for_a_float32_model_on_cuda():
    assert RuntimeConfig().tf32 is False
    assert matmul_precision(tf32=True, dtype="float32", device="cuda") == "high"
    assert matmul_precision(tf32=True, dtype="float32", device="cuda:0") == "high"
    assert matmul_precision(tf32=False, dtype="float32", device="cuda") is None  # torch's setting stays
    assert matmul_precision(tf32=True, dtype="bfloat16", device="cuda") is None
    assert matmul_precision(tf32=True, dtype="float32", device="cpu") is None


def test_report_peak_and_dtype_follow_each_workers_resolved_dtype():
    """The driver passes the job's dtype ("auto"); each worker's peak is the one of its resolved dtype."""
    m = _metrics(SPANS, devices=[GPU, GPU], dtype="auto")
    assert m["device"]["dtype"] == "bfloat16" and m["device"]["peak_flops"] == 8e10
    assert m["per_worker"][0]["mfu"] == pytest.approx(m["flops_per_token"] * 1000 / 8e10, abs=1e-6)
    cpu = _metrics(SPANS, devices=[CPU, CPU], dtype="auto")
    assert cpu["device"]["dtype"] == "float32" and cpu["device"]["peak_flops"] == 1e10
    mixed = _metrics(SPANS, devices=[GPU, CPU], dtype="auto")
    assert mixed["device"]["dtype"] == "auto" and mixed["device"]["peak_flops_total"] == 8e10 + 1e10


def test_the_workers_peak_probe_measures_the_resolved_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("embedpipe.report.device.measure_peak_flops", lambda kind, dtype, size: {"float32": 7.0}[dtype])
    info = describe_device("cpu", dtypes=("auto",))  # what cluster/worker.py passes: job.model.dtype
    assert info.peak_flops == {"float32": 7.0}  # never a probe of a dtype named "auto"


def _fingerprint(tmp_path, minilm_dir, **model):
    data = tmp_path / "in.parquet"
    if not data.exists():
        pq.write_table(pa.table({"id": ["a"], "text": ["t"]}), data)
    job = parse_job({"input": {"path": str(data)}, "model": {"path": str(minilm_dir), **model},
                     "output": {"path": str(tmp_path / "out")}})
    return job_fingerprint(job, files=[str(data)], model_dir=minilm_dir)["sha256"]


def test_fingerprint_keeps_the_setting_as_written(tmp_path, minilm_dir):
    """Two runs with auto resume each other; auto and an explicit dtype are different settings (the driver makes
    the fingerprint before any worker knows its device: auto on a GPU cluster is bfloat16)."""
    auto = _fingerprint(tmp_path, minilm_dir)
    assert _fingerprint(tmp_path, minilm_dir, dtype="auto") == auto
    assert _fingerprint(tmp_path, minilm_dir, dtype="float32") != auto


def test_the_warmup_reference_runs_full_float32_under_tf32(monkeypatch):
    """runtime.tf32 sets TF32 for the process; the guard's float32 reference still runs at "highest"."""
    from embedpipe.runtime.warmup import FullFloat32

    seen = []

    class Probe:
        name = "eager"

        def submit(self, batch):
            seen.append(torch.get_float32_matmul_precision())
            return batch

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert FullFloat32(Probe()).submit("b") == "b"
        assert seen == ["highest"] and torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision(previous)


def test_the_driver_settles_auto_where_it_knows_the_device(minilm_dir, small_corpus, tmp_path):
    """An embedded CPU run fingerprints float32, as outputs made before `auto` did: they resume unchanged,
    and the same output continued on CUDA (bfloat16) is another job, never a mix."""
    from embedpipe.cluster.driver import settle_dtype
    from embedpipe.config import parse_job
    from embedpipe.io.manifest import job_fingerprint

    def job(**sections):
        return parse_job({"input": {"path": str(small_corpus[1])}, "model": {"path": str(minilm_dir)},
                          "output": {"path": str(tmp_path / "out")}, **sections})

    assert settle_dtype(job()).model.dtype == "float32"  # no GPU here
    assert settle_dtype(job(runtime={"device": "cuda"})).model.dtype == "bfloat16"
    assert settle_dtype(job(model={"path": str(minilm_dir), "dtype": "float16"})).model.dtype == "float16"
    assert settle_dtype(job(cluster={"address": "auto"})).model.dtype == "auto"  # the workers decide
    old = job(model={"path": str(minilm_dir), "dtype": "float32"})
    assert (job_fingerprint(settle_dtype(job()), files=[str(small_corpus[1])], model_dir=minilm_dir)["sha256"]
            == job_fingerprint(old, files=[str(small_corpus[1])], model_dir=minilm_dir)["sha256"])
    assert (job_fingerprint(settle_dtype(job(runtime={"device": "cuda"})), files=[str(small_corpus[1])], model_dir=minilm_dir)["sha256"]
            != job_fingerprint(old, files=[str(small_corpus[1])], model_dir=minilm_dir)["sha256"])
