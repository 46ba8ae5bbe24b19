"""Job options of the GPU runtime: batching.buckets, runtime.cuda_graphs / max_graphs / graph_memory_mb / warmup_check."""

from __future__ import annotations

import pytest

from embedpipe.config import BatchingConfig, JobError, RuntimeConfig, load_job
from embedpipe.runtime import Encoder
from tests.test_config import _job


def test_defaults_and_their_path_into_the_encoder(tmp_path):
    job = load_job(_job(tmp_path))
    assert job.batching.buckets is None and job.runtime.cuda_graphs is True and job.runtime.warmup_check is True
    encoder = Encoder.from_job(job)
    assert encoder.batching == BatchingConfig() and encoder.runtime == RuntimeConfig()
    assert encoder.runtime.warmup_check is True


def test_options_reach_the_runner_settings(tmp_path):
    job = load_job(_job(tmp_path, batching={"max_tokens": 4096, "buckets": [4096, 512, 1024]},
                        runtime={"cuda_graphs": False, "max_graphs": 3, "graph_memory_mb": 900,
                                 "warmup_check": False}))
    encoder = Encoder.from_job(job)  # what build_runner reads: batching.buckets and the runtime section
    assert encoder.batching.buckets == [4096, 512, 1024]
    assert encoder.runtime == RuntimeConfig(cuda_graphs=False, max_graphs=3, graph_memory_mb=900, warmup_check=False)
    assert encoder.runtime.warmup_check is False and encoder.packer.max_tokens == 4096


@pytest.mark.parametrize("over, field, words", [
    ({"batching": {"buckets": [512, 4096]}}, "batching.buckets", "largest bucket 4096 is below batching.max_tokens=8192"),
    ({"batching": {"buckets": [0, 8192]}}, "batching.buckets", "must be positive"),
    ({"batching": {"buckets": "powers"}}, "batching.buckets", "is not a list of an integer or null"),
    ({"runtime": {"cuda_graphs": "yes"}}, "runtime.cuda_graphs", "is not true/false"),
    ({"runtime": {"max_graphs": -1}}, "runtime.max_graphs", "must be 0 or more"),
    ({"runtime": {"graph_memory_mb": 0}}, "runtime.graph_memory_mb", "must be positive"),
])
def test_bad_runtime_options_name_the_field(tmp_path, over, field, words):
    with pytest.raises(JobError) as err:
        load_job(_job(tmp_path, **over))
    assert err.value.field_path == field and words in str(err.value) and "fix:" in str(err.value)
