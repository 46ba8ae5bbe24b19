"""Encoder.embed through the prefetch pipeline and a runner: order, counters, the bucketed path."""

from __future__ import annotations

import numpy as np
import pytest

from embedpipe.report.counters import Counters
from embedpipe.runtime import Encoder, EncoderSettings
from embedpipe.runtime.buckets import Bucketer
from embedpipe.runtime.graphs import EagerGraphs, GraphCache
from embedpipe.runtime.runners import DeviceRunner
from embedpipe.runtime.warmup import sample_texts


SEQ = 64  # truncate: the sample's long texts would only cost CPU time here


@pytest.fixture(scope="module")
def texts():
    return sample_texts(n=40, seed=3)[::-1]


@pytest.fixture(scope="module")
def whole(minilm_dir, texts):
    """One window over all texts: the batches of the old, unpipelined embed."""
    return Encoder(EncoderSettings(model_path=str(minilm_dir), max_seq_len=SEQ, sort_window=4096)).embed(texts)


def test_windows_through_the_prefetch_thread_give_the_same_vectors_in_order(minilm_dir, texts, whole):
    encoder = Encoder(EncoderSettings(model_path=str(minilm_dir), max_seq_len=SEQ, sort_window=7, max_tokens=512))
    counters = Counters()
    got = encoder.embed(texts, counters)
    np.testing.assert_allclose(got, whole, atol=2e-5)
    tokens = int(encoder.tokenizer(texts).lengths.sum())
    assert counters.rows == len(texts) and counters.tokens == tokens == counters.padded_tokens  # eager: no padding
    assert all(counters.stages[s] > 0 for s in ("tokenize", "pack", "encode"))
    assert encoder.embed([]).shape == (0, encoder.dim)


def test_bucketed_graphed_runner_inside_the_encoder(minilm_dir, texts, whole):
    encoder = Encoder(EncoderSettings(model_path=str(minilm_dir), max_seq_len=SEQ, sort_window=16, max_tokens=256))
    bucketer = Bucketer(max_tokens=256, max_seq_len=encoder.max_seq_len)
    encoder.runner = DeviceRunner(encoder.loaded.model, encoder.head, device="cpu", bucketer=bucketer, bucketed=True,
                                  graphs=GraphCache(EagerGraphs(), max_graphs=8, max_bytes=1 << 30), inflight=2)
    counters = Counters()
    got = encoder.embed(texts, counters)
    np.testing.assert_allclose(got, whole, atol=2e-5)
    assert counters.padded_tokens > counters.tokens  # padding to buckets is counted
