"""Device description and the cached peak-FLOP/s probe."""

import json

import pytest
import torch

from embedpipe.report import device as device_mod
from embedpipe.report.device import DeviceInfo, describe_device, measure_peak_flops


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cpu_probe_measures_once_then_reads_the_cache(cache_dir, monkeypatch):
    info = describe_device("cpu", dtypes=("float32",))
    assert info.kind == "cpu" and info.name and info.threads == torch.get_num_threads() and info.count == 1
    peak = info.peak_flops["float32"]
    assert 1e8 < peak < 1e14  # a CPU multiplies at 0.1 GFLOP/s .. 100 TFLOP/s
    cached = json.loads((cache_dir / "peak_flops.json").read_text())
    assert list(cached.values()) == [peak] and f"threads={info.threads}|float32" in next(iter(cached))

    def no_probe(*args, **kwargs):
        raise AssertionError("the probe ran again despite the cache")

    monkeypatch.setattr(device_mod, "measure_peak_flops", no_probe)
    assert describe_device("cpu", dtypes=("float32",)).peak_flops == {"float32": peak}


def test_model_dtype_is_probed_too(cache_dir, monkeypatch):
    monkeypatch.setattr(device_mod, "measure_peak_flops", lambda kind, dtype, size: {"float32": 1e9, "bfloat16": 3e9}[dtype] * size / 1024)
    info = describe_device("cpu", dtypes=("bfloat16",))
    assert info.peak_flops == {"float32": 1e9, "bfloat16": 3e9}  # the best of the probed sizes


def test_probe_counts_two_n_cubed_flops(monkeypatch):
    clock = iter(range(0, 10_000))  # every perf_counter call advances one second
    monkeypatch.setattr(device_mod.time, "perf_counter", lambda: float(next(clock)))
    assert measure_peak_flops("cpu", "float32", size=64, seconds=0.0) == 2 * 64**3  # one 1-second matmul


def test_device_info_round_trips_through_a_dict():
    info = DeviceInfo(kind="cuda", name="NVIDIA H100 80GB HBM3", count=1, threads=2, host="n0",
                      peak_flops={"bfloat16": 7e14})
    assert DeviceInfo.from_dict(info.to_dict()) == info


def test_cpu_probe_times_every_matmul_the_encoder_may_use():
    """The CPU encoder runs oneDNN's linear op: the probe times it too, so MFU stays below 100%."""
    import torch

    from embedpipe.report.device import _matmuls
    from embedpipe.runtime.cpu import onednn_linear_works

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    found = _matmuls("cpu", torch.float32)
    assert len(found) == (3 if onednn_linear_works() else 2)  # torch.mm, F.linear, oneDNN's linear
    for mm in found:  # each computes a @ b (the linears as a @ (b^T)^T: same FLOPs and shapes)
        out = mm(a, b)
        assert out.shape == (64, 64)
        want = a @ b if mm is torch.mm else a @ b.T
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert len(_matmuls("cpu", torch.float16)) == 2 and len(_matmuls("cuda", torch.bfloat16)) == 1


def test_a_dtype_measured_slower_than_float32_gets_one_line_naming_the_fix():
    from embedpipe.report.device import slower_than_float32

    # an AVX2-only AMD EPYC, 2 threads, as probed: no native bfloat16 matmul (the engine ran 6x slower than in fp32)
    slow = DeviceInfo(kind="cpu", name="AMD EPYC", peak_flops={"float32": 1.86e11, "bfloat16": 2.09e10})
    line = slower_than_float32(slow, "bfloat16")
    assert line.startswith("model.dtype bfloat16 on AMD EPYC: ") and "21 GFLOP/s against 186 in float32" in line
    assert line.endswith("set model.dtype: float32 (or auto) for this machine")
    assert slower_than_float32(slow, "float32") is None and slower_than_float32(slow, "auto") is None  # CPU: fp32
    amx = DeviceInfo(kind="cpu", name="Intel Xeon", peak_flops={"float32": 1.4e11, "bfloat16": 1.6e12})
    assert slower_than_float32(amx, "bfloat16") is None
    gpu = DeviceInfo(kind="cuda", name="NVIDIA H100", peak_flops={"float32": 5e13, "bfloat16": 7e14})
    assert slower_than_float32(gpu, "auto") is None  # auto: bfloat16 on CUDA, faster
    assert slower_than_float32(DeviceInfo(kind="cpu", name="x"), "bfloat16") is None  # a failed probe says nothing


def test_the_driver_logs_each_device_warning_once(caplog):
    from embedpipe.cluster.driver import _warn_once
    from embedpipe.report.device import slower_than_float32

    slow = DeviceInfo(kind="cpu", name="AMD EPYC", peak_flops={"float32": 1.86e11, "bfloat16": 2.09e10})
    warned: set[str] = set()
    with caplog.at_level("WARNING", logger="embedpipe.cluster.driver"):
        for _ in range(3):  # three units of two workers on one host: one line
            _warn_once(slower_than_float32(slow, "bfloat16"), warned)
            _warn_once(slower_than_float32(slow, "float32"), warned)  # nothing to say
    assert [r.getMessage() for r in caplog.records] == [slower_than_float32(slow, "bfloat16")]
