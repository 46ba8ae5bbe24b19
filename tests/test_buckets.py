"""Token buckets: shape choice, padding layout, the dummy sequences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedpipe.runtime.buckets import (
    MIN_SEQLEN, MIN_SEQS, PAD_ID, Bucketer, Shape, check_buckets, default_token_buckets, exact_shape, fill_inputs,
)
from embedpipe.text.packer import TokenPacker
from embedpipe.text.tokenizer import Tokenized


def tokenized(lengths, *, seed=0, vocab=1000) -> Tokenized:
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    return Tokenized(ids=rng.integers(1, vocab, int(lengths.sum())), lengths=lengths,
                     truncated=np.zeros(lengths.size, dtype=bool))


def test_default_buckets_are_powers_of_two_up_to_max_tokens():
    assert default_token_buckets(8192) == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert default_token_buckets(3000) == [64, 128, 256, 512, 1024, 2048, 3000]
    assert default_token_buckets(50) == [50]


def test_configured_buckets_are_sorted_and_must_hold_a_full_batch():
    assert check_buckets([4096, 512, 512, 8192], max_tokens=8192) == [512, 4096, 8192]
    with pytest.raises(ValueError, match="largest bucket 4096 is below batching.max_tokens=8192"):
        check_buckets([512, 4096], max_tokens=8192)
    with pytest.raises(ValueError, match="must be positive"):
        check_buckets([0, 8192], max_tokens=8192)


def test_shape_is_the_smallest_bucket_that_fits():
    b = Bucketer(max_tokens=8192, max_seq_len=512)
    s = b.shape(num_tokens=1000, num_seqs=20, max_seqlen=70)
    assert s == Shape(tokens=1024, seqs=32, seqlen=128)
    assert b.shape(num_tokens=1024, num_seqs=20, max_seqlen=70).tokens == 1024  # exact fit: no dummy
    assert b.shape(num_tokens=3, num_seqs=1, max_seqlen=3) == Shape(tokens=64, seqs=MIN_SEQS, seqlen=MIN_SEQLEN)
    assert b.shape(num_tokens=8192, num_seqs=16, max_seqlen=512).seqlen == 512
    capped = Bucketer(max_tokens=8192, max_seq_len=300)  # not a power of two: the cap is the model's limit
    assert capped.shape(num_tokens=4000, num_seqs=14, max_seqlen=290).seqlen == 300


def test_sequence_bucket_counts_the_dummies():
    b = Bucketer(max_tokens=8192, max_seq_len=512)
    # 4100 real tokens in 8 sequences -> bucket 8192, 4092 padding tokens in dummies of <= 512 tokens: 8 dummies
    s = b.shape(num_tokens=4100, num_seqs=8, max_seqlen=512)
    assert s.tokens == 8192 and s.seqs == 16
    # short sequences: the static max_seqlen is small, so the padding needs more dummies
    s = b.shape(num_tokens=4100, num_seqs=200, max_seqlen=30)
    assert s.seqlen == 32 and s.seqs == 512  # 200 real + 128 dummies of 32 tokens -> 512


def test_out_of_range_batches_are_refused():
    b = Bucketer(max_tokens=1024, max_seq_len=128)
    with pytest.raises(ValueError, match="exceeds the largest bucket 1024"):
        b.shape(num_tokens=1025, num_seqs=9, max_seqlen=128)
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        b.shape(num_tokens=500, num_seqs=2, max_seqlen=300)
    with pytest.raises(ValueError, match="below batching.max_tokens"):
        Bucketer(max_tokens=1024, max_seq_len=128, token_buckets=[256, 512])


def _unpack(flat: np.ndarray, shape: Shape):
    T, B = shape.tokens, shape.seqs
    return flat[:T], flat[T:2 * T], flat[2 * T:2 * T + B + 1]


@pytest.mark.parametrize("seed", range(6))
def test_padding_keeps_real_sequences_first_and_dummies_valid(seed):
    rng = np.random.default_rng(seed)
    max_seq_len = int(rng.choice([64, 128, 512]))
    tok = tokenized(rng.integers(1, max_seq_len + 1, 300), seed=seed)
    bucketer = Bucketer(max_tokens=2048, max_seq_len=max_seq_len, token_buckets=[100, 700, 2048])
    for batch in TokenPacker(max_tokens=2048, sort_window=128)(tok):
        shape = bucketer.shape(num_tokens=batch.num_tokens, num_seqs=batch.num_seqs, max_seqlen=batch.max_seqlen)
        flat = np.full(bucketer.largest.flat_size, -7, dtype=np.int32)
        fill_inputs(flat, batch, shape)
        ids, pos, cu = _unpack(flat, shape)
        T, B = batch.num_tokens, batch.num_seqs
        # the real batch, unchanged, in front
        np.testing.assert_array_equal(ids[:T], batch.input_ids.numpy())
        np.testing.assert_array_equal(pos[:T], batch.positions.numpy())
        np.testing.assert_array_equal(cu[:B + 1], batch.cu_seqlens.numpy())
        # padding: dummy tokens, every sequence within the static max_seqlen, cu_seqlens covers all tokens
        assert (ids[T:] == PAD_ID).all()
        lens = np.diff(cu)
        assert cu[0] == 0 and cu[-1] == shape.tokens and (lens >= 0).all() and lens.max() <= shape.seqlen
        dummies = -(-(shape.tokens - T) // shape.seqlen)
        assert (lens[B:B + dummies] > 0).all() and (lens[B + dummies:] == 0).all()  # dummies, then empties
        starts = np.repeat(cu[:-1], lens)
        np.testing.assert_array_equal(pos, np.arange(shape.tokens) - starts)  # positions restart per sequence
        assert (flat[shape.flat_size:] == -7).all()  # nothing written past the shape


def test_exact_shape_is_the_batch_itself():
    batch = TokenPacker(max_tokens=100, sort_window=8)(tokenized([5, 9, 3]))[0]
    shape = exact_shape(batch)
    assert shape == Shape(tokens=17, seqs=3, seqlen=9)
    flat = np.zeros(shape.flat_size, dtype=np.int32)
    fill_inputs(flat, batch, shape)
    ids, pos, cu = _unpack(flat, shape)
    assert torch.equal(torch.from_numpy(ids).long(), batch.input_ids)
    assert cu.tolist() == batch.cu_seqlens.tolist()


def test_fill_refuses_a_shape_that_is_too_small():
    batch = TokenPacker(max_tokens=100, sort_window=8)(tokenized([50, 40]))[0]
    with pytest.raises(ValueError, match="does not fit"):
        fill_inputs(np.zeros(1000, dtype=np.int32), batch, Shape(tokens=64, seqs=8, seqlen=64))


def test_a_realistic_mix_needs_few_graphs_and_little_padding():
    """Lognormal lengths (mean ~42, tail to 512), default buckets: well under runtime.max_graphs, ~1 % padding."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(3.5, 0.7, 40_000)), 4, 512).astype(np.int64)
    tok = Tokenized(ids=np.ones(int(lengths.sum()), np.int64), lengths=lengths, truncated=np.zeros(lengths.size, bool))
    bucketer = Bucketer(max_tokens=8192, max_seq_len=512)
    shapes = [bucketer.shape(num_tokens=b.num_tokens, num_seqs=b.num_seqs, max_seqlen=b.max_seqlen)
              for b in TokenPacker(max_tokens=8192, sort_window=4096)(tok)]
    assert len(set(shapes)) <= 16  # runtime.max_graphs defaults to 32
    assert sum(s.tokens for s in shapes) / lengths.sum() < 1.05
