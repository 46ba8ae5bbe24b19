"""Warmup guard: the decision, the error, and the Encoder wiring (tiny model with a real tokenizer)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from embedpipe.runtime import Encoder
from embedpipe.runtime.staging import LazyResult
from embedpipe.runtime.warmup import TOLERANCE, WarmupDivergence, check, compare, cosines, sample_texts
from tests.model_helpers import save_tiny_bert


def _unit_rows(n, d, seed=0):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def _tilted(ref, divergence):
    """Rows at exactly `divergence` = 1 - cos from `ref` (unit rows)."""
    other = _unit_rows(*ref.shape, seed=1)
    ortho = other - (other * ref).sum(-1, keepdim=True) * ref
    ortho = ortho / ortho.norm(dim=-1, keepdim=True)
    c = 1 - divergence
    return c * ref + (1 - c * c) ** 0.5 * ortho


def test_decision_at_the_threshold():
    ref = _unit_rows(16, 32)
    assert compare(ref, ref).ok and compare(ref, ref).min_cosine == pytest.approx(1.0)
    assert compare(_tilted(ref, 0.5 * TOLERANCE), ref).ok
    fast = ref.clone()
    fast[5] = _tilted(ref, 2 * TOLERANCE)[5]
    report = compare(fast, ref)
    assert not report.ok and report.worst_row == 5 and report.max_divergence == pytest.approx(2 * TOLERANCE)


def test_nan_zero_and_shape_mismatches():
    ref = _unit_rows(4, 8)
    bad = ref.clone()
    bad[2, 0] = float("nan")
    assert not compare(bad, ref).ok and compare(bad, ref).worst_row == 2
    zeros = torch.zeros(2, 8)
    assert cosines(zeros, zeros).tolist() == [1.0, 1.0]  # empty sequences pooled to zero on both sides
    assert cosines(zeros, ref[:2]).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="reference"):
        compare(ref[:3], ref)


class _Scripted:
    """A runner that returns fixed rows per batch (fast path under test)."""

    name = "scripted"

    def __init__(self, table):
        self.table = table

    def submit(self, batch):
        return LazyResult.ready(self.table[torch.as_tensor(batch.rows)].float(), computed_tokens=batch.num_tokens)


def test_check_raises_with_the_numbers_and_the_way_out():
    from embedpipe.text.packer import TokenPacker
    from embedpipe.text.tokenizer import Tokenized

    n = 12
    tok = Tokenized(ids=np.ones(n * 3, dtype=np.int64), lengths=np.full(n, 3), truncated=np.zeros(n, bool))
    batches = TokenPacker(max_tokens=10, sort_window=8)(tok)
    ref = _unit_rows(n, 8)
    assert check(fast=_Scripted(ref), reference=_Scripted(ref), batches=batches, rows=n).ok
    broken = ref.clone()
    broken[7] = -ref[7]
    with pytest.raises(WarmupDivergence, match=r"min cosine -1\.0+ \(row 7 of 12\).*runtime\.cuda_graphs: false"):
        check(fast=_Scripted(broken), reference=_Scripted(ref), batches=batches, rows=n)


def test_sample_texts_are_fixed_and_mixed():
    texts = sample_texts()
    assert texts == sample_texts() and len(texts) == 48
    words = sorted(len(t.split()) for t in texts)
    assert words[0] <= 4 and words[-1] >= 600


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory, minilm_dir):
    path = tmp_path_factory.mktemp("tiny-tok")
    save_tiny_bert(path, vocab_size=30522, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_dir / name, path / name)
    return path


def test_encoder_runs_the_guard_where_the_fast_path_differs(tiny_with_tokenizer):
    fp32 = Encoder.from_options(str(tiny_with_tokenizer))
    assert fp32.warmup is None  # float32 eager on CPU is the reference itself
    bf16 = Encoder.from_options(str(tiny_with_tokenizer), dtype="bfloat16")
    assert bf16.warmup is not None and bf16.warmup.ok and bf16.warmup.rows == 48
    off = Encoder.from_options(str(tiny_with_tokenizer), dtype="bfloat16", warmup_check=False)
    assert off.warmup is None


def _break_the_fast_path(monkeypatch) -> None:
    """Encoders built from here on run a fast path whose first row of every batch is negated."""
    from embedpipe.runtime import encoder as encoder_module

    real = encoder_module.build_runner

    def broken_runner(*args, **kwargs):
        runner = real(*args, **kwargs)

        class Broken:
            name = "broken"

            def submit(self, batch):
                out = runner.submit(batch).get()
                out[0] = -out[0]
                return LazyResult.ready(out, computed_tokens=batch.num_tokens)

        return Broken()

    monkeypatch.setattr(encoder_module, "build_runner", broken_runner)


def test_encoder_fails_on_a_broken_fast_path(tiny_with_tokenizer, monkeypatch):
    _break_the_fast_path(monkeypatch)
    with pytest.raises(WarmupDivergence, match="broken bfloat16 path on cpu"):
        Encoder.from_options(str(tiny_with_tokenizer), dtype="bfloat16")


def test_the_reference_is_kept_and_believed_only_where_the_fast_path_agrees(tiny_with_tokenizer, monkeypatch,
                                                                             tmp_path):
    """runtime/reference.py: a bf16 encoder's second start compares with the kept float32 vectors instead of loading
    the float32 copy again; a kept file the fast path disagrees with is computed again (and replaced), never
    believed; a broken fast path still fails against a kept reference."""
    import embedpipe.models

    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path))
    real_load, loads = embedpipe.models.load_model, []

    def counted(*args, **kwargs):  # the real load, counted: the reference's copy is the only float32 one here
        loads.append(kwargs.get("dtype"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(embedpipe.models, "load_model", counted)
    first = Encoder.from_options(str(tiny_with_tokenizer), dtype="bfloat16")
    kept = list((tmp_path / "warmup").glob("*.npy"))
    assert first.warmup.ok and loads == [torch.float32] and len(kept) == 1
    right = np.load(kept[0])
    assert right.shape == (48, first.dim) and right.dtype == np.float32

    second = Encoder.from_options(str(tiny_with_tokenizer), dtype="bfloat16")
    assert second.warmup.ok and loads == [torch.float32]  # compared with the kept vectors: no float32 copy loaded
    assert second.warmup.min_cosine == first.warmup.min_cosine

    np.save(kept[0], -right)  # a damaged (or stale) kept reference
    third = Encoder.from_options(str(tiny_with_tokenizer), dtype="bfloat16")
    assert third.warmup.ok and loads == [torch.float32] * 2  # computed again, not believed
    np.testing.assert_array_equal(np.load(kept[0]), right)  # and replaced by the right vectors

    kept[0].write_bytes(b"")  # an empty (unreadable) kept file: computed again
    assert Encoder.from_options(str(tiny_with_tokenizer), dtype="bfloat16").warmup.ok and len(loads) == 3
    np.testing.assert_array_equal(np.load(kept[0]), right)

    _break_the_fast_path(monkeypatch)
    with pytest.raises(WarmupDivergence, match="broken bfloat16 path on cpu"):
        Encoder.from_options(str(tiny_with_tokenizer), dtype="bfloat16")
    assert loads == [torch.float32] * 4  # checked against a fresh reference before failing the worker
    np.testing.assert_array_equal(np.load(kept[0]), right)


def test_the_reference_key_follows_the_model_files_tokens_head_and_device(tiny_with_tokenizer, tmp_path):
    from embedpipe.runtime.reference import reference_key

    model = tmp_path / "model"
    shutil.copytree(tiny_with_tokenizer, model)
    encoder = Encoder.from_options(str(model), warmup_check=False)
    batches = encoder.packer(encoder.tokenizer(sample_texts()))
    fewer = encoder.packer(encoder.tokenizer(sample_texts()[:47]))
    key = dict(model_dir=model, batches=batches, head="mean|True|None|0", device="cpu")
    base = reference_key(**key)
    assert reference_key(**key) == base
    assert reference_key(**{**key, "batches": fewer}) != base
    assert reference_key(**{**key, "head": "cls|True|None|0"}) != base
    assert reference_key(**{**key, "device": "cuda:1"}) != base
    assert reference_key(**{**key, "device": "cpu"}) == base
    config = model / "config.json"
    config.write_text(config.read_text() + "\n")  # a model file changed in place: its size and time
    assert reference_key(**key) != base
