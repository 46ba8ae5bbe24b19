"""Derived run numbers from synthetic unit spans, checked by hand."""

import pytest

from embedpipe.config import CostConfig
from embedpipe.report.counters import Counters
from embedpipe.report.device import DeviceInfo
from embedpipe.report.metrics import UnitSpan, devices_by_slot, extend_report, fill_usd_saved, run_metrics

TINY_BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128}
CPU = DeviceInfo(kind="cpu", name="Test CPU", count=1, threads=2, host="h", peak_flops={"float32": 1e10})


def _span(worker, start, end, rows, tokens, encode, **stages):
    c = Counters(rows=rows, tokens=tokens, padded_tokens=tokens, tokens_squared=tokens * 40,  # every row 40 tokens
                 stages={"read": 0.1, "encode": encode, **stages})
    return UnitSpan(worker, 1000.0 + start, 1000.0 + end, c)


def _metrics(spans, **over):
    total = Counters()
    for s in spans:
        total.merge(s.counters)
    report = {"tokens": total.tokens, "padded_tokens": total.padded_tokens}
    kwargs = dict(this_run=total, spans=spans, devices=[CPU, CPU], started_at=1000.0, wall_seconds=10.0,
                  dtype="float32", model_config=TINY_BERT, cost=CostConfig(cpu_hour_usd=0.1))
    return run_metrics(report, **{**kwargs, **over})


SPANS = [_span(0, 2, 6, 100, 4000, 3.0), _span(0, 6, 10, 100, 4000, 3.0), _span(1, 2, 8, 150, 6000, 5.4)]


def test_per_worker_busy_and_scaling_by_hand():
    m = _metrics(SPANS)
    w0, w1 = m["per_worker"]
    assert (w0["units"], w0["rows"], w0["tokens"], w0["seconds"]) == (2, 200, 8000, 8.0)
    assert w0["tokens_per_second"] == 1000.0 and w0["rows_per_second"] == 25.0 and w0["busy_fraction"] == 0.75
    assert (w1["rows"], w1["seconds"], w1["busy_fraction"]) == (150, 6.0, 0.9)
    assert w0["timeline"] == [[2.0, 6.0, 100, 4000], [6.0, 10.0, 100, 4000]]
    assert m["busy_fraction"] == pytest.approx(11.4 / 14, abs=1e-6) and m["busy_source"] == "encode"
    assert m["scaling_efficiency"] == pytest.approx(14 / 20)  # worker-seconds on units / (2 workers x 10 s)
    assert m["scaling_efficiency_after_startup"] == pytest.approx(14 / 16)  # ... / (2 workers x (10 - 2) s)
    assert m["startup_seconds"] == 2.0 and m["padding_efficiency"] == 1.0


def test_a_calibration_piece_is_worker_time_and_start_up_ends_at_it_but_its_counters_are_the_units():
    """int8/uint8: a piece of the calibration sample (cluster/sampled.py) is on its worker's timeline; what it
    computed counts in the units that took its rows, so its own counters are not added again."""
    piece = UnitSpan(1, 1001.0, 1002.0, Counters(tokens=900, stages={"encode": 0.9}), calibration=True)
    m = _metrics(SPANS + [piece])
    w1 = m["per_worker"][1]
    assert (w1["units"], w1["rows"], w1["tokens"], w1["seconds"]) == (1, 150, 6000, 7.0)  # 6 s unit + 1 s piece
    assert w1["busy_fraction"] == pytest.approx(5.4 / 7) and w1["timeline"][0] == [1.0, 2.0, 0, 900]
    assert m["startup_seconds"] == 1.0  # to the first piece taken, before the first unit
    assert m["scaling_efficiency"] == pytest.approx(15 / 20)
    assert m["scaling_efficiency_after_startup"] == pytest.approx(15 / 18)
    assert m["busy_fraction"] == pytest.approx(11.4 / 15)
    took = UnitSpan(1, 1008.0, 1009.0, Counters(rows=20, tokens=800, sampled_rows=15, sampled_tokens=600))
    w1 = _metrics(SPANS + [piece, took])["per_worker"][1]
    assert w1["tokens"] == 6800 and w1["timeline"][-1] == [8.0, 9.0, 20, 200]  # the tokens the unit computed


def test_scaling_takes_its_wall_on_the_spans_clock_when_the_driver_clock_disagrees():
    # a VM paused mid-run: the spans (time.time()) cover 10 s, the driver's perf_counter saw 7.5 s of them
    m = _metrics(SPANS, wall_seconds=7.5, ended_at=1010.0)
    assert m["scaling_efficiency"] == pytest.approx(14 / 20)  # as with agreeing clocks, not 14 / 15
    assert m["scaling_efficiency_after_startup"] == pytest.approx(14 / 16)
    assert m["timeline_seconds"] == 10.0  # the timelines' axis: the last span ends at 10 s, past wall_seconds
    assert max(s[1] for w in m["per_worker"] for s in w["timeline"]) <= m["timeline_seconds"]
    alone = _metrics(SPANS, wall_seconds=7.5)
    assert alone["scaling_efficiency"] == pytest.approx(14 / 15) and alone["timeline_seconds"] == 7.5  # no end


def test_mfu_by_hand():
    m = _metrics(SPANS)
    fpt = 2 * 2 * (4 * 64 * 64 + 2 * 64 * 128) + 4 * 2 * 4 * 16 * 40  # weights + attention at 40 tokens
    assert m["flops_per_token"] == fpt == 151_552 and m["flops"]["seq_len"] == 40
    assert m["mfu"] == pytest.approx(fpt * 14_000 / 10 / 2e10, abs=1e-6)  # run tokens/s over both peaks
    assert m["encode_mfu"] == pytest.approx(fpt * 14_000 / (11.4 * 1e10), abs=1e-6)
    assert m["per_worker"][0]["mfu"] == pytest.approx(fpt * 1000 / 1e10, abs=1e-6)
    assert m["device"] == {"kind": "cpu", "name": "Test CPU", "count": 2, "threads": 2, "hosts": 1,
                           "dtype": "float32", "peak_flops": 1e10, "peak_flops_total": 2e10, "linears": None}


def test_the_linears_library_of_each_worker_and_of_the_run():
    from dataclasses import replace

    from embedpipe.report.render import render_table
    from tests.report_helpers import sample_report
    from tests.test_report_render import _value

    def device_row(metrics: dict) -> str:
        return _value(render_table({**sample_report(), "device": metrics["device"]}), "device")

    onednn, torch_ = replace(CPU, linears="onednn"), replace(CPU, linears="torch")
    m = _metrics(SPANS, devices=[onednn, torch_])
    assert [w["linears"] for w in m["per_worker"]] == ["onednn", "torch"]
    assert m["device"]["linears"] == "onednn + torch"  # machines that measured differently: both named
    assert device_row(m) == "2 x Test CPU (float32, 2 threads each, oneDNN linears + torch's linears)"
    same = _metrics(SPANS, devices=[onednn, onednn])
    assert same["device"]["linears"] == "onednn"
    assert device_row(same) == "2 x Test CPU (float32, 2 threads each, oneDNN linears)"


def test_cost_of_two_cpu_workers_by_hand():
    cost = _metrics(SPANS)["cost"]
    assert cost["usd_per_hour"] == pytest.approx(0.2)  # $0.10 per vCPU-hour x 2 threads
    assert cost["device_hours"] == pytest.approx(20 / 3600, abs=1e-6)
    assert cost["total_usd"] == pytest.approx(0.4 * 10 / 3600)
    assert cost["usd_per_million_tokens"] == pytest.approx(0.4 * 10 / 3600 / 14_000 * 1e6)


def test_unknown_model_and_worker_without_units():
    m = _metrics(SPANS[:1], model_config={"model_type": "t5"})
    assert m["flops_per_token"] is None and m["mfu"] is None and m["encode_mfu"] is None
    idle = m["per_worker"][1]
    assert idle["units"] == 0 and idle["tokens_per_second"] == 0.0 and idle["busy_fraction"] is None


def test_extend_never_overwrites_existing_keys():
    base = {"rows": 3, "skipped_rows": 7}
    assert extend_report(base, {"skipped_rows": 0, "mfu": 0.5}) == {"rows": 3, "skipped_rows": 7, "mfu": 0.5}


def test_a_slot_without_units_is_counted_like_the_others():
    other = DeviceInfo(kind="cpu", name="Other CPU")
    assert devices_by_slot({1: CPU, 2: other}, slots=3) == [CPU, CPU, other]
    assert devices_by_slot({}, slots=2) == []


def test_incremental_usd_saved_at_this_runs_price_per_encoded_row():
    this_run = Counters(rows=1000, reused_rows=750)  # 250 rows encoded for $0.50
    report = {"cost": {"total_usd": 0.5}, "incremental": {"reused": 750, "usd_saved": None}}
    fill_usd_saved(report, this_run=this_run)
    assert report["incremental"]["usd_saved"] == pytest.approx(750 * 0.5 / 250)  # $1.50
    unknown = {"cost": {"total_usd": None}, "incremental": {"usd_saved": None}}
    fill_usd_saved(unknown, this_run=this_run)
    assert unknown["incremental"]["usd_saved"] is None
