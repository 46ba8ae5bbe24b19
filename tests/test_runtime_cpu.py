"""CPU runtime settings: oneDNN linears give nn.Linear's results; the allocator setting is idempotent."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from embedpipe.runtime.cpu import OneDNNLinear, keep_freed_memory, use_onednn_linears


def test_keep_freed_memory_is_idempotent():
    first = keep_freed_memory()
    assert keep_freed_memory() == first and isinstance(first, bool)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_onednn_linears_match_nn_linear(dtype, tol):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Sequential(nn.Linear(96, 32, bias=False))).to(dtype).eval()
    x = torch.randn(37, 48, dtype=dtype)
    with torch.no_grad():
        want = model(x)
        swapped = use_onednn_linears(model)
        if swapped == 0:
            pytest.skip("torch has no oneDNN linear op here")
        got = model(x)
        assert swapped == 2 and isinstance(model[0], OneDNNLinear) and isinstance(model[2][0], OneDNNLinear)
        assert model[0].weight.data_ptr() != 0 and model(x[None]).shape == (1, 37, 32)  # leading dims kept
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_float16_linears_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8)).half()
    assert use_onednn_linears(model) == 0 and type(model[0]) is nn.Linear


def test_runtime_cpu_keep_memory_false_leaves_the_allocator_alone(minilm_dir, monkeypatch):
    import embedpipe.runtime.encoder as encoder_mod
    from embedpipe.api.options import job_for_options
    from embedpipe.runtime import Encoder

    calls = []
    monkeypatch.setattr(encoder_mod, "keep_freed_memory", lambda **kw: calls.append(kw) or True)
    job = job_for_options(str(minilm_dir), {"cpu_keep_memory": False, "device": "cpu"})
    assert job.runtime.cpu_keep_memory is False
    assert Encoder.from_job(job).runtime.cpu_keep_memory is False
    assert calls == []
    Encoder.from_options(str(minilm_dir), device="cpu")  # the default keeps it
    assert len(calls) == 1


def test_onednn_rows_are_padded_to_few_shapes():
    from embedpipe.runtime.cpu import padded_rows

    shapes = {padded_rows(n) for n in range(1, 8193)}
    assert len(shapes) == 68 and max(shapes) == 8192
    assert all(padded_rows(n) >= n for n in range(1, 8193))
    assert max((padded_rows(n) - n) / n for n in range(2049, 8193)) < 0.125  # full batches: little waste
    assert padded_rows(1) == 16 and padded_rows(300) == 320 and padded_rows(4000) == 4096


def test_the_gemm_library_is_chosen_by_timing_the_models_forward_once_per_machine(minilm_dir, tmp_path, monkeypatch,
                                                                                  caplog):
    """runtime.cpu_linears: auto times MiniLM's own forward (its post-ops included) on oneDNN's linears and on torch's,
    and keeps the library that the logged timings say (oneDNN unless torch's is TORCH_MARGIN faster); the answer is
    cached per machine, so a second encoder gets it without measuring, and the model runs on it."""
    import logging

    from embedpipe.runtime import Encoder, cpu

    if not cpu.onednn_linear_works(torch.float32):
        pytest.skip("oneDNN's linear does not run on this CPU: nothing to choose")
    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path))
    forwards = []
    real = cpu.forward_timings
    monkeypatch.setattr(cpu, "forward_timings", lambda model, twins: forwards.append(model) or real(model, twins))
    with caplog.at_level(logging.INFO, logger="embedpipe.runtime.cpu"):
        encoder = Encoder.from_options(str(minilm_dir), device="cpu", cpu_linears="auto", warmup_check=False)
    logged = re.search(r"ms per forward: oneDNN ([\d.]+), torch ([\d.]+) -> (\w+)", caplog.text)  # the probe
    onednn_ms, torch_ms, choice = float(logged[1]), float(logged[2]), logged[3]
    assert forwards == [encoder.loaded.model] and onednn_ms > 0 and torch_ms > 0
    assert choice == ("torch" if onednn_ms > cpu.TORCH_MARGIN * torch_ms else "onednn")
    linears = [type(m) for m in encoder.loaded.model.modules() if isinstance(m, (nn.Linear, cpu.OneDNNLinear))]
    assert set(linears) == {cpu.OneDNNLinear if choice == "onednn" else nn.Linear}
    assert (tmp_path / "cpu_linears.json").is_file()
    monkeypatch.setattr(cpu, "_faster", lambda timings: pytest.fail("measured again"))
    again = Encoder.from_options(str(minilm_dir), device="cpu", cpu_linears="auto", warmup_check=False)
    assert {type(m) for m in again.loaded.model.modules() if isinstance(m, (nn.Linear, cpu.OneDNNLinear))} == set(linears)
    vectors = again.embed(["one short text", "and another"])
    assert vectors.shape == (2, 384)


def test_the_probe_pack_shrinks_for_a_costly_model():
    """The probe's batch: 64-token sequences, 1,024 tokens for a small model, down to one sequence for a large one,
    so that no machine spends more than PROBE_FLOPS a forward choosing."""
    from embedpipe.runtime import cpu

    class Model(nn.Module):
        def __init__(self, flops: float):
            super().__init__()
            self.flops, self.config = flops, type("Config", (), {"vocab_size": 100})()

        def flops_per_token(self, seq_len: float) -> float:
            return self.flops

    for flops, tokens in ((22e6, 1024), (cpu.PROBE_FLOPS / 256, 256), (1.2e9, 64)):
        ids, positions, cu = cpu.probe_pack(Model(flops))
        assert ids.shape == positions.shape == (tokens,) and int(ids.max()) < 100
        assert cu.tolist() == list(range(0, tokens + 1, cpu.PROBE_SEQ_LEN)) and cu.dtype == torch.int32
        assert positions[:cpu.PROBE_SEQ_LEN].tolist() == list(range(cpu.PROBE_SEQ_LEN))


def test_the_forward_probe_stops_after_one_timed_round_when_the_ratio_is_clear(monkeypatch):
    """A warm-up round, then timed rounds of both libraries: one when its oneDNN / torch ratio lies outside CLEAR,
    PROBE_REPEATS otherwise; the model is left on torch's linears either way."""
    from embedpipe.runtime import cpu

    if not cpu.onednn_linear_works(torch.float32):
        pytest.skip("oneDNN's linear does not run on this CPU: nothing to time")

    class Model(nn.Module):  # the probe's interface: forward(ids, positions, cu_seqlens, max_seqlen), FLOPs, vocab
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"vocab_size": 100})()
            self.embed, self.up, self.down = nn.Embedding(100, 64), nn.Linear(64, 256), nn.Linear(256, 64)
            self.calls = 0

        def flops_per_token(self, seq_len: float) -> float:
            return 4 * 64 * 256

        def forward(self, ids, positions, cu_seqlens, max_seqlen):
            self.calls += 1
            return self.down(F.gelu(self.up(self.embed(ids))))  # [T, 64]

    for clear, rounds in (((float("inf"), float("inf")), 1), ((0.0, float("inf")), cpu.PROBE_REPEATS)):
        monkeypatch.setattr(cpu, "CLEAR", clear)
        model = Model().eval()
        timings = cpu.forward_timings(model, cpu._onednn_twins(model))
        assert model.calls == 2 * (1 + rounds) and 0 < timings["onednn"] < 1 and 0 < timings["torch"] < 1
        assert type(model.up) is nn.Linear and type(model.down) is nn.Linear


def test_runtime_cpu_linears_pins_the_library_without_measuring(monkeypatch):
    """onednn and torch never measure: a job that pins one computes the same bits on every worker, whatever each
    machine would measure (the default, auto, measures)."""
    from embedpipe.config import RuntimeConfig
    from embedpipe.runtime import cpu

    assert RuntimeConfig().cpu_linears == "auto"
    monkeypatch.setattr(cpu, "forward_timings", lambda *a, **k: pytest.fail("measured"))
    model = nn.Sequential(nn.Linear(384, 1536), nn.GELU(), nn.Linear(1536, 384)).eval()
    assert cpu.place_linears(model, choice="torch") == "torch" and type(model[0]) is nn.Linear
    want = "onednn" if cpu.onednn_linear_works(torch.float32) else "torch"
    assert cpu.place_linears(model, choice="onednn") == want
    assert (type(model[0]) is cpu.OneDNNLinear) == (want == "onednn")


def test_onednn_primitives_are_cached_across_calls():
    """A oneDNN linear called again at the same row count reuses its primitive (ONEDNN_VERBOSE's create:cache_hit):
    with the cache off, every call rebuilt it, which cost AMX's bf16 linears 2.4x. Fresh process: oneDNN reads the
    capacity when it builds its first primitive."""
    import os
    import subprocess
    import sys

    from embedpipe.runtime.cpu import ONEDNN_CACHE_CAPACITY, onednn_linear_works

    if not onednn_linear_works(torch.float32):
        pytest.skip("torch has no oneDNN linear op here")
    code = ("import torch; from torch import nn; from embedpipe.runtime.cpu import OneDNNLinear\n"
            "layer = OneDNNLinear(nn.Linear(96, 80)); x = torch.randn(300, 96)\n"
            "with torch.no_grad():\n    [layer(x) for _ in range(3)]\n")
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"} | {"ONEDNN_VERBOSE": "all"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    creates = re.findall(r"create:cache_(hit|miss),cpu,(?:inner_product|matmul),", out)  # not the weight's one reorder
    assert ONEDNN_CACHE_CAPACITY > 0 and creates.count("miss") == 1 and creates.count("hit") == 2, creates


def _onednn(linear: nn.Linear) -> OneDNNLinear:
    from embedpipe.runtime.cpu import onednn_linear_works

    if not onednn_linear_works(linear.weight.dtype):
        pytest.skip(f"oneDNN has no {linear.weight.dtype} linear on this CPU")
    return OneDNNLinear(linear)


@pytest.mark.parametrize("rows", [300, 320])  # below padded_rows (padded inside), at it (as the CPU runner hands it)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add_and_activation_are_the_unfused_ops(dtype, rows):
    """OneDNNLinear's post-ops: residual + linear(x) and gelu / relu(linear(x)) in one call. fp32: the same bits as the
    ops after the linear; bf16: one rounding instead of two, within bf16 of the fp32 result. Activations without an
    exact post-op are left to models/layers.py (None)."""
    from embedpipe.models.layers import ACTIVATIONS, FusedLinear, linear_act, linear_add

    torch.manual_seed(0)
    plain = nn.Linear(48, 96).to(dtype)
    fused = _onednn(plain)
    x, residual = torch.randn(rows, 48, dtype=dtype), torch.randn(rows, 96, dtype=dtype)
    assert isinstance(fused, FusedLinear) and not isinstance(plain, FusedLinear)
    with torch.no_grad():
        exact = nn.Linear(48, 96).float().requires_grad_(False)
        exact.weight.copy_(plain.weight), exact.bias.copy_(plain.bias)
        pairs = [(linear_add(fused, x, residual), residual + fused(x), residual.float() + exact(x.float()))]
        for act in ("gelu", "relu"):
            fn = ACTIVATIONS[act]
            pairs.append((linear_act(fused, x, act=act), fn(fused(x)), fn(exact(x.float()))))
        assert fused.activated(x, act="gelu_pytorch_tanh") is None and fused.activated(x, act="silu") is None
        torch.testing.assert_close(linear_act(fused, x, act="silu"), ACTIVATIONS["silu"](fused(x)), atol=0, rtol=0)
        torch.testing.assert_close(linear_add(plain, x, residual), residual + plain(x), atol=0, rtol=0)
    for got, unfused, truth in pairs:
        assert got.shape == (rows, 96) and got.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(got, unfused)
        else:
            torch.testing.assert_close(got.float(), truth, atol=3e-2, rtol=1e-2)


def test_bert_layers_run_their_adds_and_gelu_in_the_linears(minilm_dir, monkeypatch):
    """The CPU encoder's BERT: both residual adds of every layer and its GELU go through OneDNNLinear's post-ops."""
    from embedpipe.runtime import Encoder

    calls = []
    for name in ("add_to", "activated"):
        real = getattr(OneDNNLinear, name)
        monkeypatch.setattr(OneDNNLinear, name, lambda self, *a, _real=real, _name=name, **kw:
                            calls.append(_name) or _real(self, *a, **kw))
    encoder = Encoder.from_options(str(minilm_dir), device="cpu", cpu_linears="onednn", warmup_check=False)
    if not calls and not any(isinstance(m, OneDNNLinear) for m in encoder.loaded.model.modules()):
        pytest.skip("oneDNN's linear does not run on this CPU")
    calls.clear()
    encoder.embed(["one short text", "and another, a little longer than the first"])
    layers = encoder.loaded.model.config.num_layers
    assert calls.count("add_to") == 2 * layers and calls.count("activated") == layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_weight_gives_the_plain_weights_bits_and_follows_it(dtype):
    """OneDNNLinear computes from its weight reordered once into oneDNN's blocked layout: the same bits as the plain
    weight at any row count; a weight changed in place, or replaced, is packed again; the module still pickles.

    As the encoder runs it: parameters frozen (models/loader.py) and calls in inference mode (runtime/runners.py).
    With autograd on, oneDNN computes a bf16 layer of this size from the blocked weight with its reference kernel
    (`ref:any`, forward_training) on an AMD Zen 5 with AVX-512 BF16, 1,000x slower and an ulp off the plain weight's
    brgemm in 4 of 221,184 values; the encoder never runs that way."""
    import copy
    import pickle

    torch.manual_seed(0)
    layer = _onednn(nn.Linear(64, 96).to(dtype).requires_grad_(False))
    plain = torch.ops.mkldnn._linear_pointwise

    def same(x: torch.Tensor, module: nn.Module = layer) -> bool:  # the module's bits are the plain weight's
        with torch.inference_mode():
            return torch.equal(module(x), plain(x, layer.weight, layer.bias, "none", [], "")[:x.shape[0]])

    for rows in (16, 320, 2304):
        x = torch.randn(rows, 64, dtype=dtype)
        assert same(x)
    first = layer.packed
    assert first.is_mkldnn and layer.packed is first  # packed once, not per call
    with torch.no_grad():
        layer.weight.mul_(-1)
    assert layer.packed is not first and same(x)
    layer.weight = nn.Parameter(torch.randn(96, 64, dtype=dtype), requires_grad=False)
    assert same(x)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert same(x, clone)
