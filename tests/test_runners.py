"""Runners: the bucketed + graphed device path against the eager one (CPU stand-in; CUDA when present)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from embedpipe.models import load_model
from embedpipe.runtime.buckets import Bucketer
from embedpipe.runtime.graphs import EagerGraphs, GraphCache
from embedpipe.config import BatchingConfig, RuntimeConfig
from embedpipe.runtime.runners import DeviceRunner, EagerRunner, build_runner
from embedpipe.runtime.warmup import compare, run_batches
from embedpipe.text.packer import TokenPacker
from embedpipe.text.tokenizer import Tokenized
from tests.model_helpers import save_tiny_bert, save_tiny_text_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
MAX_SEQ_LEN, MAX_TOKENS, N = 128, 1024, 150


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bert")
    save_tiny_bert(path)
    return path


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(3.0, 0.9, N).astype(np.int64) + 1, MAX_SEQ_LEN)  # mixed, long tail
    tok = Tokenized(ids=rng.integers(1, 100, int(lengths.sum())), lengths=lengths, truncated=np.zeros(N, bool))
    return TokenPacker(max_tokens=MAX_TOKENS, sort_window=64)(tok)


def _model(tiny_dir, *, device="cpu", dtype=torch.float32, pooling="mean", backend="sdpa"):
    lm = load_model(tiny_dir, dtype=dtype, device=device, attention_backend=backend)
    return lm.model, lm.build_head(pooling=pooling, normalize=True)


def _device_runner(model, head, *, device="cpu", graphs=True, bucketed=True, buckets=None, max_graphs=16):
    cache = None
    if graphs:
        if torch.device(device).type == "cuda":
            from embedpipe.runtime.graphs import CudaGraphs

            backend = CudaGraphs(device)
        else:
            backend = EagerGraphs()
        cache = GraphCache(backend, max_graphs=max_graphs, max_bytes=1 << 30)
    bucketer = Bucketer(max_tokens=MAX_TOKENS, max_seq_len=MAX_SEQ_LEN, token_buckets=buckets)
    return DeviceRunner(model, head, device=device, bucketer=bucketer, bucketed=bucketed, graphs=cache, inflight=2)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_bucketed_graphed_runner_matches_eager(tiny_dir, batches, pooling):
    model, head = _model(tiny_dir, pooling=pooling)
    want = run_batches(EagerRunner(model, head, device="cpu"), batches, N)
    runner = _device_runner(model, head)
    got = run_batches(runner, batches, N)  # all submitted before any is read: 2 slots, many in flight
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert compare(got, want).min_cosine > 0.999999
    assert runner.name == "graphed" and runner.graphs.stats.captures == len(runner.graphs.graphs)


def test_causal_decoder_with_last_token_pooling_through_buckets(tmp_path, batches):
    """Qwen3 (causal, GQA, RoPE): dummy and empty sequences after the real ones change nothing."""
    from tests.test_models_qwen3 import tiny_hf

    tiny_hf().save_pretrained(tmp_path, safe_serialization=True)
    lm = load_model(tmp_path, attention_backend="sdpa")
    head = lm.build_head()  # no Pooling module: a causal model pools its last token
    assert head.pooling == "last"
    want = run_batches(EagerRunner(lm.model, head, device="cpu"), batches, N)
    got = run_batches(_device_runner(lm.model, head), batches, N)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_dummy_rows_are_dropped_and_padding_is_counted(tiny_dir, batches):
    model, head = _model(tiny_dir)
    runner = _device_runner(model, head)
    for batch in batches:
        result = runner.submit(batch)
        shape = runner.shape(batch)
        assert result.get().shape[0] == batch.num_seqs  # real rows only
        assert result.computed_tokens == shape.tokens >= batch.num_tokens and shape.seqs >= batch.num_seqs
    assert runner.graphs.stats.captures == len({runner.shape(b) for b in batches})  # one graph per shape


@pytest.mark.parametrize("device", DEVICES)
def test_graph_replay_equals_eager_on_the_same_padded_inputs(tiny_dir, batches, device):
    model, head = _model(tiny_dir, device=device, dtype=torch.bfloat16, backend="auto")
    eager = run_batches(_device_runner(model, head, device=device, graphs=False), batches, N)  # bucketed, no graphs
    graphed = run_batches(_device_runner(model, head, device=device), batches, N)
    assert torch.equal(graphed, eager)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphed", "staged"])
def test_fast_path_bf16_matches_fp32_eager(tiny_dir, batches, device, cuda_graphs):
    ref_model, ref_head = _model(tiny_dir, device=device, backend="sdpa")
    want = run_batches(EagerRunner(ref_model, ref_head, device=device), batches, N)
    model, head = _model(tiny_dir, device=device, dtype=torch.bfloat16, backend="auto")  # varlen / flash on CUDA
    if device == "cuda":
        runner = build_runner(model, head, device=device, max_seq_len=MAX_SEQ_LEN,
                              batching=BatchingConfig(max_tokens=MAX_TOKENS), runtime=RuntimeConfig(cuda_graphs=cuda_graphs))
    else:  # the same runner class with the CPU graph stand-in
        runner = _device_runner(model, head, graphs=cuda_graphs, bucketed=cuda_graphs)
    assert runner.name == ("graphed" if cuda_graphs else "staged")
    assert compare(run_batches(runner, batches, N), want).min_cosine > 0.999


def test_staged_exact_shapes_equal_the_eager_runner(tiny_dir, batches):
    model, head = _model(tiny_dir)
    staged = _device_runner(model, head, graphs=False, bucketed=False)
    assert staged.name == "staged"
    got = run_batches(staged, batches, N)
    assert torch.equal(got, run_batches(EagerRunner(model, head, device="cpu"), batches, N))
    assert all(staged.submit(b).computed_tokens == b.num_tokens for b in batches[:3])  # no padding


def test_eviction_under_a_tight_cap_keeps_results_right(tiny_dir, batches):
    model, head = _model(tiny_dir)
    want = run_batches(EagerRunner(model, head, device="cpu"), batches, N)
    runner = _device_runner(model, head, max_graphs=1, buckets=[128, 512, 1024])
    torch.testing.assert_close(run_batches(runner, batches, N), want, atol=2e-6, rtol=1e-5)
    assert len(runner.graphs.graphs) == 1 and runner.graphs.stats.evictions >= 1


def test_graphs_need_buckets(tiny_dir):
    model, head = _model(tiny_dir)
    with pytest.raises(ValueError, match="graphs need bucketed shapes"):
        DeviceRunner(model, head, device="cpu", bucketer=Bucketer(max_tokens=64, max_seq_len=64), bucketed=False,
                     graphs=GraphCache(EagerGraphs(), max_graphs=1, max_bytes=1))


def test_cpu_gets_the_eager_runner(tiny_dir):
    model, head = _model(tiny_dir)
    runner = build_runner(model, head, device="cpu", max_seq_len=MAX_SEQ_LEN,
                          batching=BatchingConfig(max_tokens=MAX_TOKENS), runtime=RuntimeConfig())
    assert isinstance(runner, EagerRunner)


def _family_dir(family, path):
    if family == "bert":
        save_tiny_bert(path)
    else:
        from tests.test_models_modernbert import tiny_hf as modernbert
        from tests.test_models_qwen3 import tiny_hf as qwen3

        {"modernbert": modernbert, "qwen3": qwen3}[family]().save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("backend", ["grouped", "matmul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["bert", "modernbert", "qwen3"])
def test_row_padding_once_per_forward_gives_the_same_bits(family, dtype, backend, batches, tmp_path):
    """The pack padded once to the rows oneDNN's linears compute (rows_for) instead of a copy in every linear:
    BERT's vectors are bit for bit those of the unpadded pack through the same linears (its elementwise ops run on
    whole rows); the gated MLPs' ops on column halves of a projection may round an element differently at
    another row count (ATen's scalar tail where a thread's share ends), as any change of batch does."""
    from embedpipe.runtime.cpu import padded_rows, use_onednn_linears

    lm = load_model(_family_dir(family, tmp_path), dtype=dtype, device="cpu", attention_backend=backend)
    if not use_onednn_linears(lm.model):
        pytest.skip(f"oneDNN has no {dtype} linear on this CPU")
    head = lm.build_head(pooling="mean", normalize=True)
    assert any(padded_rows(b.num_tokens) > b.num_tokens for b in batches)  # the padding is exercised
    want = run_batches(EagerRunner(lm.model, head, device="cpu"), batches, N)
    got = run_batches(EagerRunner(lm.model, head, device="cpu", rows_for=padded_rows), batches, N)
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    if family == "bert":
        assert torch.equal(got, want)
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    else:
        assert F.cosine_similarity(got, want).min() >= 0.999


@pytest.mark.parametrize("linears, backend, padded", [("onednn", "grouped", True), ("onednn", "matmul", True),
                                                      ("torch", "grouped", False), ("onednn", "sdpa", False)])
def test_the_cpu_encoder_pads_rows_once_where_its_linears_and_attention_take_it(linears, backend, padded, tmp_path):
    from embedpipe.runtime import Encoder
    from embedpipe.runtime.cpu import onednn_linear_works, padded_rows

    if linears == "onednn" and not onednn_linear_works(torch.float32):
        pytest.skip("oneDNN's linear does not run on this CPU")
    encoder = Encoder.from_options(str(save_tiny_text_model(tmp_path)), cpu_linears=linears, attention=backend,
                                   warmup_check=False)
    assert encoder.runner.rows_for is (padded_rows if padded else None)
