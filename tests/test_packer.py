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



def _trained(kind: str, texts: list[str]):
    """A small tokenizer of another family's kind, trained here on ``texts``: Qwen3's byte-level BPE or XLM-R's
    Unigram (Metaspace), each with its special tokens put around a text."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    if kind == "byte-level BPE":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        single, specials = "$A <|endoftext|>", ["<|endoftext|>"]
    else:
        tok = Tokenizer(models.Unigram())
        tok.normalizer, tok.pre_tokenizer = normalizers.NFKC(), pre_tokenizers.Metaspace()
        tok.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=2000, special_tokens=["<s>", "</s>", "<unk>"],
                                                               unk_token="<unk>"))
        single, specials = "<s> $A </s>", ["<s>", "</s>"]
    tok.post_processor = processors.TemplateProcessing(single=single,
                                                       special_tokens=[(s, tok.token_to_id(s)) for s in specials])
    return tok


@pytest.mark.parametrize("kind", ["WordPiece (MiniLM)", "byte-level BPE", "Unigram"])
@pytest.mark.parametrize("prompt", ["", "query: "])
def test_tokenizer_gives_the_ids_of_the_offset_tracking_encode(minilm_dir, quickstart_table, tmp_path, kind, prompt):
    """The tokenizer skips the character offsets (``encode_batch_fast`` where tokenizers has it): the same ids,
    lengths and truncation flags as tokenizers' full ``encode_batch``, on the real corpus, some texts cut, for each
    kind of tokenizer the model families use."""
    texts = quickstart_table.column("text").to_pylist()
    model_dir = minilm_dir
    if not kind.startswith("WordPiece"):
        model_dir = tmp_path
        _trained(kind, texts).save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer(model_dir, max_seq_len=48, prompt=prompt)
    out = tok(texts)
    full = tok.tokenizer.encode_batch([prompt + t for t in texts])  # offsets and all
    assert out.lengths.tolist() == [len(e.ids) for e in full]
    assert out.ids.tolist() == [i for e in full for i in e.ids]
    assert out.truncated.tolist() == [bool(e.overflowing) for e in full] and 0 < out.truncated.sum() < len(texts)
