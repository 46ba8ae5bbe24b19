"""Encoder.embed through the prefetch pipeline and a runner: order, counters, the bucketed path."""

from __future__ import annotations

import numpy as np
import pytest

from embedpipe.report.counters import Counters
from embedpipe.runtime import Encoder
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
    return Encoder.from_options(str(minilm_dir), max_seq_len=SEQ, sort_window=4096).embed(texts)


def test_windows_through_the_prefetch_thread_give_the_same_vectors_in_order(minilm_dir, texts, whole):
    encoder = Encoder.from_options(str(minilm_dir), max_seq_len=SEQ, sort_window=7, max_tokens=512)
    counters = Counters()
    got = encoder.embed(texts, counters)
    np.testing.assert_allclose(got, whole, atol=2e-5)
    tokens = int(encoder.tokenizer(texts).lengths.sum())
    assert counters.rows == len(texts) and counters.tokens == tokens == counters.padded_tokens  # eager: no padding
    assert all(counters.stages[s] > 0 for s in ("tokenize", "pack", "encode"))
    assert encoder.embed([]).shape == (0, encoder.dim)


def test_bucketed_graphed_runner_inside_the_encoder(minilm_dir, texts, whole):
    encoder = Encoder.from_options(str(minilm_dir), max_seq_len=SEQ, sort_window=16, max_tokens=256)
    bucketer = Bucketer(max_tokens=256, max_seq_len=encoder.max_seq_len)
    encoder.runner = DeviceRunner(encoder.loaded.model, encoder.head, device="cpu", bucketer=bucketer, bucketed=True,
                                  graphs=GraphCache(EagerGraphs(), max_graphs=8, max_bytes=1 << 30), inflight=2)
    counters = Counters()
    got = encoder.embed(texts, counters)
    np.testing.assert_allclose(got, whole, atol=2e-5)
    assert counters.padded_tokens > counters.tokens  # padding to buckets is counted


def test_the_encoder_takes_the_jobs_sections(tmp_path, minilm_dir):
    from embedpipe.config import job_from_dict
    from tests.conftest import QUICKSTART

    job = job_from_dict({"input": {"path": str(QUICKSTART)}, "output": {"path": str(tmp_path / "out"), "dim": 128},
                         "model": {"path": str(minilm_dir), "max_seq_len": SEQ},
                         "batching": {"max_tokens": 512, "sort_window": 7},
                         "runtime": {"attention": "sdpa", "device": "cpu"}})
    encoder = Encoder.from_job(job)
    assert (encoder.model_config, encoder.batching, encoder.runtime) == (job.model, job.batching, job.runtime)
    assert (encoder.packer.max_tokens, encoder.packer.sort_window, encoder.max_seq_len, encoder.dim) == (512, 7, SEQ, 128)
    assert encoder.loaded.model.attention_backend == "sdpa"


def test_from_options_builds_the_sections_through_the_schema(minilm_dir):
    from embedpipe.config import BatchingConfig, JobError, ModelConfig, RuntimeConfig

    encoder = Encoder.from_options(str(minilm_dir))  # no options: config.py's defaults, no second set
    assert encoder.model_config == ModelConfig(path=str(minilm_dir))
    assert encoder.batching == BatchingConfig() and encoder.runtime == RuntimeConfig()
    assert encoder.packer.max_tokens == BatchingConfig().max_tokens and encoder.dim == encoder.loaded.dim
    with pytest.raises(JobError, match=r"Encoder.from_options: attention: 'fast' is not one of auto, sdpa"):
        Encoder.from_options(str(minilm_dir), attention="fast")  # runtime.attention's Literal is checked
    with pytest.raises(JobError, match=r"output_dtype: is not an encoder option"):
        Encoder.from_options(str(minilm_dir), output_dtype="int8")
