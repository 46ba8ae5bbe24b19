"""The cost model against hand-computed values: presets, overrides, spot, CPU workers, unknown devices."""

import pytest

from embedpipe.config import CostConfig, JobError, load_job
from embedpipe.report.cost import GPU_PRESETS, cost_section, preset_for, price_for, project
from embedpipe.report.device import DeviceInfo
from embedpipe.report.plot import build_figure
from embedpipe.report.render import render_markdown, render_table
from tests.conftest import QUICKSTART, write_job
from tests.report_helpers import sample_report

H100 = DeviceInfo(kind="cuda", name="NVIDIA H100 80GB HBM3", count=1, threads=2, host="n0")
UNKNOWN_GPU = DeviceInfo(kind="cuda", name="NVIDIA GeForce RTX 3090", count=1, threads=2, host="n0")


@pytest.mark.parametrize("name, preset", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100"), ("NVIDIA H200", "H200"),
    ("NVIDIA B200", "B200"), ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", None), ("NVIDIA GeForce RTX 3090", None),
])
def test_preset_from_the_device_name(name, preset):
    assert preset_for(DeviceInfo(kind="cuda", name=name)) == preset


def test_h100_preset_cost_by_hand():
    # 4 H100 workers for 30 minutes: 2 GPU-hours at the $6.88 list price = $13.76
    price = price_for(H100, CostConfig())
    assert price.usd_per_hour == GPU_PRESETS["H100"].usd_per_hour == 6.88 and price.unit == "GPU-hour"
    cost = cost_section(prices=[price] * 4, wall_seconds=1800.0, tokens=250_000_000, rows=2_000_000)
    assert cost["device_hours"] == 2.0
    assert cost["total_usd"] == pytest.approx(13.76)
    assert cost["usd_per_hour"] == pytest.approx(6.88)
    assert cost["usd_per_million_tokens"] == pytest.approx(13.76 / 250)  # $0.05504
    assert cost["usd_per_million_rows"] == pytest.approx(13.76 / 2)  # $6.88


def test_gpu_hour_override_with_spot_by_hand():
    # $2.50/GPU-hour, spot at 60% off = $1.00; 1 GPU for 2 hours = $2.00 for 10M tokens, 40k rows
    cfg = CostConfig(gpu_hour_usd=2.5, spot=True, spot_discount=0.6)
    price = price_for(H100, cfg)
    assert price.usd_per_hour == pytest.approx(1.0)
    cost = cost_section(prices=[price], wall_seconds=7200.0, tokens=10_000_000, rows=40_000)
    assert cost["total_usd"] == pytest.approx(2.0)
    assert cost["usd_per_million_tokens"] == pytest.approx(0.2)
    assert cost["usd_per_million_rows"] == pytest.approx(50.0)


def test_instance_price_is_split_over_its_gpus():
    cfg = CostConfig(instance_hour_usd=40.0, gpus_per_instance=8)
    assert price_for(UNKNOWN_GPU, cfg).usd_per_hour == pytest.approx(5.0)  # a price makes any GPU known


def test_cpu_worker_costs_vcpu_price_times_threads():
    cpu = DeviceInfo(kind="cpu", name="AMD EPYC", count=1, threads=4)
    assert price_for(cpu, CostConfig()).usd_per_hour == pytest.approx(4 * 0.0446)
    price = price_for(cpu, CostConfig(cpu_hour_usd=0.05))
    assert price.usd_per_hour == pytest.approx(0.2) and price.unit == "worker-hour"
    cost = cost_section(prices=[price, price], wall_seconds=900.0, tokens=1_000_000, rows=5_000)
    assert cost["device_hours"] == 0.5 and cost["total_usd"] == pytest.approx(0.1)


def test_unknown_gpu_without_a_price_reports_cost_unknown():
    assert price_for(UNKNOWN_GPU, CostConfig()) is None
    # a whole run on an unknown GPU, through the driver's report path (build_report + run_metrics)
    report = sample_report(gpu="NVIDIA GeForce RTX 3090", workers=2)
    cost = report["cost"]
    for key in ("usd_per_hour", "total_usd", "usd_per_million_tokens", "usd_per_million_rows"):
        assert cost[key] is None, key
    assert cost["device_hours"] == pytest.approx(2 * report["wall_seconds"] / 3600)  # still reported
    assert cost["unit"] == "GPU-hour" and "unknown" in cost["source"]
    assert report["tokens_per_second"] > 0 and report["mfu"] is not None  # throughput is not lost
    for text in (render_table(report, project_rows=1e6), render_markdown(report, project_rows=1e6)):
        for label in ("price", "total cost", "cost per million tokens", "cost per million rows"):
            line = next(line for line in text.splitlines() if label in line and "Projection" not in line)
            assert "unknown" in line and "$" not in line, line
    assert project(report, rows=1e9)["total_usd"] is None
    assert "cost unknown" in build_figure(report)._suptitle.get_text()
    # the same run with a price from the job is priced
    priced = sample_report(gpu="NVIDIA GeForce RTX 3090", workers=2, cost=CostConfig(gpu_hour_usd=0.5))
    assert priced["cost"]["total_usd"] == pytest.approx(0.5 * 2 * report["wall_seconds"] / 3600)


def test_projection_by_hand():
    # two workers at 50 rows/s each after 30 s of start-up: 1e6 rows take 30 + 10,000 s on 2 devices
    report = {"rows": 1000, "tokens": 64_000, "rows_per_second": 40.0, "startup_seconds": 30.0,
              "per_worker": [{"rows": 600, "seconds": 12.0}, {"rows": 400, "seconds": 8.0}],
              "device": {"count": 2}, "cost": {"usd_per_hour": 3.6}}
    p = project(report, rows=1e6)
    assert p["tokens"] == 64e6
    assert p["wall_hours"] == pytest.approx(10_030 / 3600)
    assert p["device_hours"] == pytest.approx(2 * 10_030 / 3600)
    assert p["total_usd"] == pytest.approx(2 * 10_030 / 3600 * 3.6)  # $20.06


@pytest.mark.parametrize("cost, field, words", [
    ({"instance_hour_usd": 40.0}, "cost.gpus_per_instance", "needed"),
    ({"gpu_hour_usd": -1}, "cost.gpu_hour_usd", "negative"),
    ({"gpu_hour_usd": 2.0, "instance_hour_usd": 40.0, "gpus_per_instance": 8}, "cost.instance_hour_usd", "not both"),
    ({"spot_discount": 1.0}, "cost.spot_discount", "not in [0, 1)"),
    ({"preset": "V100"}, "cost.preset", "not one of"),
])
def test_bad_cost_section_names_the_field(tmp_path, cost, field, words):
    job = write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, output={"path": str(tmp_path / "o")},
                    cost=cost)
    with pytest.raises(JobError) as err:
        load_job(job)
    assert err.value.field_path == field and words in str(err.value)


def test_cost_section_and_set_override(tmp_path):
    job = write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)},
                    model={"path": "sentence-transformers/all-MiniLM-L6-v2"}, output={"path": str(tmp_path / "o")},
                    cost={"preset": "H100", "spot": True})
    loaded = load_job(job, overrides=["cost.gpu_hour_usd=3"])
    assert loaded.cost.preset == "H100" and loaded.cost.spot and loaded.cost.gpu_hour_usd == 3.0
