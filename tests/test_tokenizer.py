"""text/tokenizer.py: the sequences TextTokenizer gives are tokenizers' own full encode of each (prompted) text,
truncated at max_seq_len: without character offsets, and for a long text from its head, on real text and on cuts
made to land badly, for the three kinds of tokenizer the model families use."""

from __future__ import annotations

import numpy as np
import pytest

from embedpipe.text.tokenizer import HEAD_CHARS_PER_TOKEN, TextTokenizer
from tests.conftest import shared_data

KINDS = ["WordPiece (MiniLM)", "byte-level BPE", "Unigram"]


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


@pytest.fixture(scope="module")
def quickstart_texts(quickstart_table) -> list[str]:
    return quickstart_table.column("text").to_pylist()


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(kind, minilm_dir, quickstart_texts, tmp_path_factory):
    """A folder with the kind's tokenizer.json: the packaged MiniLM's, or one trained here."""
    if kind.startswith("WordPiece"):
        return minilm_dir
    folder = tmp_path_factory.mktemp(kind.replace(" ", "-"))
    _trained(kind, quickstart_texts).save(str(folder / "tokenizer.json"))
    return folder


def _assert_whole(tok: TextTokenizer, texts: list[str], prompt: str = "") -> None:
    """``tok(texts)`` is tokenizers' full encode (offsets and all) of each prompted text, truncated."""
    out = tok(texts)
    full = tok.tokenizer.encode_batch([prompt + t for t in texts])
    assert out.lengths.tolist() == [len(e.ids) for e in full]
    starts = np.concatenate([[0], np.cumsum(out.lengths)])
    for i, e in enumerate(full):  # one sequence at a time: a failure names the text
        assert out.ids[starts[i]:starts[i + 1]].tolist() == e.ids, (i, texts[i][:80])
    assert out.truncated.tolist() == [bool(e.overflowing) for e in full]


@pytest.mark.parametrize("prompt", ["", "query: "])
def test_the_ids_are_the_offset_tracking_encodes(model_dir, quickstart_texts, prompt):
    """The tokenizer skips the character offsets (``encode_batch_fast`` where tokenizers has it): the same ids,
    lengths and truncation flags as tokenizers' full ``encode_batch``, on the real corpus, some texts cut."""
    tok = TextTokenizer(model_dir, max_seq_len=48, prompt=prompt)
    _assert_whole(tok, quickstart_texts, prompt)
    assert 0 < tok(quickstart_texts).truncated.sum() < len(quickstart_texts)


def _long_documents(paragraphs: list[str], *, per: int, count: int) -> list[str]:
    return ["\n\n".join(paragraphs[i * per:(i + 1) * per]) for i in range(count)]


def _cut_badly(text: str, cut: int) -> list[str]:
    """``text`` altered so that a head cut at ``cut`` characters lands inside a whitespace run, a word, a letter
    with combining accents, CJK characters, an emoji, a URL and a line break; and a text that is all one word
    there. Each keeps its own first ``cut - 40`` characters."""
    head = text[:cut - 40]
    fillers = [" " * 80, "x" * 80, "e\u0301\u0308" * 30, "\u6f22\u5b57\u304b\u306a" * 20, "\U0001f600 " * 40,
               " https://example.org/a/b?c=d&e=f#g" * 4, "\r\n" * 40, "\u00a0\u2009" * 40]
    return [head + filler + text[cut - 40:] for filler in fillers]


@pytest.mark.parametrize("prompt", ["", "query: "])
@pytest.mark.parametrize("max_seq_len", [32, 128])
def test_a_long_text_gives_from_its_head_what_it_gives_whole(model_dir, quickstart_texts, max_seq_len, prompt):
    """Long texts (real paragraphs joined, and the same with the head's cut made to land in whitespace, inside a
    word, in combining accents, CJK, emoji, URLs and line breaks, at every offset around the cut) tokenize to
    their whole encoding truncated; the ordinary ones are taken from their heads, and the short ones beside them
    are unchanged."""
    tok = TextTokenizer(model_dir, max_seq_len=max_seq_len, prompt=prompt)
    cut = max_seq_len * HEAD_CHARS_PER_TOKEN - len(prompt)  # where a prompted text's head ends, in the text
    long = _long_documents(quickstart_texts, per=40, count=40)
    assert all(len(t) > 2 * cut for t in long)
    bad = [variant for t in long[:4] for shift in range(-3, 4) for variant in _cut_badly(t, cut + shift)]
    texts = long + bad + quickstart_texts[:200]
    _assert_whole(tok, texts, prompt)
    heads = tok._heads([prompt + t for t in texts])
    assert set(range(len(long))) <= set(heads), "ordinary long texts are taken from their heads"
    short = {i for i, t in enumerate(texts) if len(prompt + t) <= max_seq_len * HEAD_CHARS_PER_TOKEN}
    assert short and not set(heads) & short, "short texts are tokenized whole"


@pytest.mark.parametrize("chars_per_token", [2, 3, 4, 6])
def test_a_head_barely_longer_than_a_sequence_settles_only_what_its_cut_cannot_change(model_dir, quickstart_texts,
                                                                                      chars_per_token):
    """Heads cut shorter than the product's (``chars_per_token`` characters per kept token, so that many heads
    hold about as many tokens as a sequence keeps, and the kept ones reach the words next to the cut), starting
    every 3 characters over a stretch of real text, and with the badly placed cuts: still the whole encoding,
    truncated, whichever way each text went (it fails when the tokens of the word a cut falls in are kept)."""
    tok = TextTokenizer(model_dir, max_seq_len=32)
    tok._head_chars = 32 * chars_per_token  # the head's length is what this test varies (HEAD_CHARS_PER_TOKEN: 8)
    base = "\n\n".join(quickstart_texts[:40])
    texts = [base[start:] for start in range(0, 240, 3)]  # every word boundary and mid-word cut, roughly
    texts += [v for t in texts[:6] for v in _cut_badly(t, tok._head_chars)]
    _assert_whole(tok, texts)
    assert tok._heads(texts), "some heads settle their texts"


def test_a_long_text_its_head_cannot_settle_is_tokenized_whole(model_dir, kind):
    """A long text whose head holds too few words (a whitespace run, one long word) is tokenized whole: still the
    whole encoding, truncated or not. (What counts as a word is the pre-tokenizer's: Metaspace makes a word of
    every space, so there only WordPiece's are sure to have too few.)"""
    tok = TextTokenizer(model_dir, max_seq_len=32)
    cut = 32 * HEAD_CHARS_PER_TOKEN
    texts = ["start " + " " * (2 * cut) + "end of it", "a" * (3 * cut), "word " * 20 + "\n" * (2 * cut) + "tail " * 50]
    _assert_whole(tok, texts)
    if kind.startswith("WordPiece"):
        assert tok._heads(texts) == {}


@pytest.mark.slow
def test_kernel_documents_tokenize_from_their_heads_as_whole(minilm_dir):
    """Real long documents: consecutive kernel-docs paragraphs joined (about 7,000 characters each) give MiniLM's
    whole encoding truncated at 256, every one from its head."""
    import pyarrow.parquet as pq

    paragraphs = pq.read_table(shared_data("linux_kernel_docs_paragraphs.parquet"), columns=["text"])
    documents = _long_documents(paragraphs["text"].to_pylist()[:12_000], per=40, count=300)
    tok = TextTokenizer(minilm_dir, max_seq_len=256)
    _assert_whole(tok, documents)
    assert len(tok._heads(documents)) == len(documents)
