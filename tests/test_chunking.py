"""The chunker (embedpipe/text/chunking.py) on real text: kernel-docs documents and a 1 MB document."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from embedpipe.text.chunking import CHUNK_FIELDS, MID, SPACE, Chunker, boundary_rank, documents_of
from embedpipe.text.tokenizer import TextTokenizer
from tests.conftest import shared_data


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """Real documents: the paragraphs of each kernel-docs page joined by blank lines (40 pages)."""
    kernel = shared_data("linux_kernel_docs_paragraphs.parquet")
    table = pq.read_table(kernel, columns=["source_doc", "text"]).slice(0, 6000)
    pages: dict[str, list[str]] = {}
    for doc, text in zip(table.column("source_doc").to_pylist(), table.column("text").to_pylist()):
        pages.setdefault(doc, []).append(text)
    docs = ["\n\n".join(p) for p in pages.values() if len(p) > 3]
    return docs[:40]


@pytest.fixture(scope="module")
def megabyte(documents) -> str:
    """One 1 MB document made of the real pages, repeated."""
    text, i = [], 0
    while sum(map(len, text)) < 1_000_000:
        text.append(documents[i % len(documents)])
        i += 1
    return "\n\n".join(text)[:1_000_000]


@pytest.fixture(scope="module")
def tokenizer(minilm_dir) -> TextTokenizer:
    return TextTokenizer(minilm_dir, max_seq_len=256, lower_case=True)


def reconstruct(text: str, start: np.ndarray, end: np.ndarray) -> str:
    """The text rebuilt from the chunk spans in order; what lies between spans (overlap 0) must be whitespace."""
    out, prev = [], 0
    for s, e in zip(start.tolist(), end.tolist()):
        if s >= prev:
            assert text[prev:s].strip() == "", f"text between chunks is not whitespace: {text[prev:s]!r}"
            out.append(text[prev:e])
        else:  # overlapping the previous chunk
            assert e > prev, "a chunk ends before the previous one"
            out.append(text[prev:e])
        prev = e
    assert text[prev:].strip() == "", "the text's tail is in no chunk"
    return "".join(out) + text[prev:]


def check_document(chunker: Chunker, text: str, doc, chunks, d: int) -> None:
    rows = np.flatnonzero(chunks.doc == d)
    first, stop = chunks.first[rows], chunks.stop[rows]
    assert chunks.chunk[rows].tolist() == list(range(len(rows)))
    # spans of the original text, in order, rebuilding it
    assert reconstruct(text, chunks.start[rows], chunks.end[rows]) == text
    # every token in at least one chunk
    covered = np.zeros(len(doc.ids), dtype=bool)
    for a, b in zip(first.tolist(), stop.tolist()):
        covered[a:b] = True
    assert covered.all() and first[0] == 0 and stop[-1] == len(doc.ids)
    # consecutive chunks share exactly `overlap` tokens
    assert (first[1:] == stop[:-1] - chunker.overlap).all()
    # no chunk over max_tokens, specials and prompt counted
    assert ((stop - first) + chunker.tokenizer.framing <= chunker.max_tokens).all()


@pytest.mark.parametrize("max_tokens,overlap", [(128, 0), (256, 32), (64, 16)])
def test_real_documents_properties(tokenizer, documents, max_tokens, overlap):
    chunker = Chunker(tokenizer=tokenizer, max_tokens=max_tokens, overlap=overlap, window=32)
    docs, chunks = chunker(documents)
    assert len(chunks) > 2 * len(documents)  # the real pages are long: many are cut
    for d, text in enumerate(documents):
        check_document(chunker, text, docs[d], chunks, d)


def assert_same_chunking(got, want) -> None:
    (got_docs, got_chunks), (want_docs, want_chunks) = got, want
    assert len(got_docs) == len(want_docs)
    for g, w in zip(got_docs, want_docs):
        for name in ("ids", "starts", "ends", "word_start"):
            np.testing.assert_array_equal(getattr(g, name), getattr(w, name))
    for name in CHUNK_FIELDS:
        np.testing.assert_array_equal(getattr(got_chunks, name), getattr(want_chunks, name))
        assert getattr(got_chunks, name).dtype == getattr(want_chunks, name).dtype


def test_documents_taken_from_a_chunkers_output_are_chunked_as_on_their_own(tokenizer, documents):
    """A subset of the documents, or a window of them, taken from the chunker's output for all of them: the same
    tokens and chunks (numbered within the subset) as chunking those texts alone."""
    chunker = Chunker(tokenizer=tokenizer, max_tokens=64, overlap=16, window=32)
    given = chunker(documents)
    subset = np.sort(np.random.default_rng(0).choice(len(documents), size=13, replace=False))
    assert_same_chunking(documents_of(*given, subset), chunker([documents[i] for i in subset]))
    for start in range(0, len(documents), 16):  # the last window runs past the end
        assert_same_chunking(chunker.chunk_range(documents, start=start, stop=start + 16, given=given),
                             chunker(documents[start:start + 16]))
    assert_same_chunking(chunker.chunk_range(documents, start=3, stop=9), chunker(documents[3:9]))  # nothing given
    empty = documents_of(*given, np.zeros(0, dtype=np.int64))
    assert empty[0] == [] and all(len(getattr(empty[1], name)) == 0 for name in CHUNK_FIELDS)


def test_megabyte_document(tokenizer, megabyte):
    chunker = Chunker(tokenizer=tokenizer, max_tokens=256, overlap=32, window=32)
    docs, chunks = chunker([megabyte])
    assert len(docs[0].ids) > 150_000 and len(chunks) > 600
    check_document(chunker, megabyte, docs[0], chunks, 0)


def test_limit_counts_specials_and_prompt(minilm_dir, documents):
    """With a prompt, every framed chunk (prompt + text + specials) fits max_tokens, and is what the model's own
    tokenizer makes of prompt + chunk text."""
    tok = TextTokenizer(minilm_dir, max_seq_len=256, lower_case=True, prompt="query: ")
    chunker = Chunker(tokenizer=tok, max_tokens=100, overlap=10, window=32)
    docs, chunks = chunker(documents[:10])
    framed = chunker.framed(docs, chunks)
    assert (framed.lengths <= 100).all() and framed.lengths.max() == 100
    plain = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    plain.no_truncation()
    plain.no_padding()
    same = 0
    for i, (d, s, e) in enumerate(zip(chunks.doc.tolist(), chunks.start.tolist(), chunks.end.tolist())):
        ids = plain.encode("query: " + documents[d][s:e]).ids
        got = framed.ids[framed.starts[i]:framed.starts[i] + framed.lengths[i]].tolist()
        same += ids == got
    assert same == len(chunks)


@pytest.mark.parametrize("overlap", [0, 24])
def test_cuts_land_on_the_best_boundary_in_the_window(tokenizer, documents, overlap):
    """The best rank in the window wins; with overlap, among the cuts whose next chunk starts on a word."""
    chunker = Chunker(tokenizer=tokenizer, max_tokens=128, overlap=overlap, window=32)
    docs, chunks = chunker(documents)
    ranks = []
    for i in np.flatnonzero(np.diff(chunks.doc, append=-1) == 0):  # every chunk followed by one of its document
        d, a, stop = int(chunks.doc[i]), int(chunks.first[i]), int(chunks.stop[i])
        limit = a + chunker.budget
        window = [c for c in range(limit - chunker.window, limit + 1) if docs[d].word_start[c - overlap]]
        assert stop in window
        best = max(boundary_rank(docs[d], documents[d], c) for c in window)
        got = boundary_rank(docs[d], documents[d], stop)
        assert got == best, f"document {d}: cut at rank {got} where rank {best} was in the window"
        ranks.append(got)
    assert min(ranks) >= SPACE  # real prose always has whitespace within 32 tokens: never mid-word


def test_sentence_end_beats_a_later_line_break(tokenizer):
    words = " ".join(["word"] * 20)
    text = f"{words}. Then more text here\nand after the break {words} {words}"
    chunker = Chunker(tokenizer=tokenizer, max_tokens=30, overlap=0, window=12)
    docs, chunks = chunker([text])
    assert text[chunks.start[0]:chunks.end[0]] == f"{words}."
    line = Chunker(tokenizer=tokenizer, max_tokens=30, overlap=0, window=5)  # the sentence end out of the window
    docs, chunks = line([text])
    assert text[chunks.end[0]:chunks.end[0] + 1] == "\n" or text[chunks.end[0]] == " "


def test_a_word_longer_than_the_window_is_cut_mid_word(tokenizer):
    long_word = ("pneumonoultramicroscopicsilicovolcanoconiosis" * 3)[:99]  # 99 characters: ~30 word pieces
    text = f"start {long_word} end"
    chunker = Chunker(tokenizer=tokenizer, max_tokens=20, overlap=4, window=8)
    docs, chunks = chunker([text])
    assert len(chunks) >= 3
    assert boundary_rank(docs[0], text, int(chunks.stop[1])) == MID
    check_document(chunker, text, docs[0], chunks, 0)


def test_short_and_empty_documents_are_one_chunk(tokenizer):
    chunker = Chunker(tokenizer=tokenizer, max_tokens=128, overlap=16, window=32)
    texts = ["  A short document.  ", ""]
    docs, chunks = chunker(texts)
    assert chunks.doc.tolist() == [0, 1] and chunks.chunk.tolist() == [0, 0]
    assert texts[0][chunks.start[0]:chunks.end[0]] == "A short document."
    assert (chunks.start[1], chunks.end[1]) == (0, 0)
    assert chunker.framed(docs, chunks).lengths.tolist() == [6, 2]  # [CLS] a short document . [SEP]; [CLS] [SEP]


def test_overlap_that_leaves_no_room_is_one_line(tokenizer):
    with pytest.raises(ValueError, match=r"input.chunking.max_tokens=10 leaves 8 text tokens.*overlap=8"):
        Chunker(tokenizer=tokenizer, max_tokens=10, overlap=8, window=4)
