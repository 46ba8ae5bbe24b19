import numpy as np
import pytest
import torch

from embedpipe.text.packer import TokenPacker
from embedpipe.text.tokenizer import TextTokenizer, Tokenized


def _tok(lengths):
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)]).astype(np.int64)  # seq i is all i+1
    return Tokenized(ids=ids, lengths=lengths, truncated=np.zeros(len(lengths), bool))


@pytest.mark.parametrize("max_tokens, window", [(64, 1000), (50, 4), (1000, 1000)])
def test_packs_every_sequence_once_within_budget(max_tokens, window):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=97)
    batches = TokenPacker(max_tokens=max_tokens, sort_window=window)(_tok(lengths))
    rows = np.concatenate([b.rows for b in batches])
    assert sorted(rows.tolist()) == list(range(97))
    for b in batches:
        cu = b.cu_seqlens.numpy()
        assert b.num_tokens <= max_tokens and cu[0] == 0 and cu[-1] == b.num_tokens
        assert b.cu_seqlens.dtype == torch.int32 and b.max_seqlen == int(np.diff(cu).max())
        for j, row in enumerate(b.rows):
            seq = b.input_ids[cu[j]:cu[j + 1]]
            assert len(seq) == lengths[row] and bool((seq == row + 1).all())
            assert b.positions[cu[j]:cu[j + 1]].tolist() == list(range(lengths[row]))


def test_sorts_within_window_longest_first():
    batches = TokenPacker(max_tokens=10_000, sort_window=4)(_tok([1, 5, 3, 9, 2, 8]))
    assert [b.rows.tolist() for b in batches] == [[3, 1, 2, 0], [5, 4]]


def test_sequence_over_budget_is_an_error():
    with pytest.raises(ValueError, match="batching.max_tokens"):
        TokenPacker(max_tokens=4, sort_window=8)(_tok([5]))


def test_tokenizer_truncates_and_flags(minilm_dir):
    tok = TextTokenizer(minilm_dir, max_seq_len=8)
    out = tok(["short text", "this sentence is definitely going to be longer than eight tokens"])
    assert out.lengths.tolist()[1] == 8 and out.truncated.tolist() == [False, True]
    assert out.ids[0] == 101 and out.ids[out.lengths[0] - 1] == 102  # [CLS] ... [SEP]
    assert out.ids[out.lengths[0] + 7] == 102  # truncation keeps [SEP]
