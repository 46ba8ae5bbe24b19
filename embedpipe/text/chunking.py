"""Token-aware chunking: each document tokenized once (with offsets), cut into token spans with overlap.

    texts -> TextTokenizer.documents (ids, character offsets, pre-token starts; one pass per document)
          -> spans per document: [first, stop) token ranges of at most ``budget`` tokens
             (budget = max_tokens - special tokens - prompt), consecutive spans sharing exactly
             ``overlap`` tokens, each cut at the best boundary in the ``window`` tokens before the
             limit: a sentence end > a line break > whitespace > a pre-token edge > mid-word (only
             when the window holds no whitespace: one word longer than the window)
          -> Chunks (document, chunk number, token and character spans); chunk texts are
             ``text[start:end]`` of the original text
          -> ``framed``: each span's ids with the special tokens and the prompt, for the packer.

With overlap, the next chunk starts ``overlap`` tokens before the cut: cuts whose next chunk then
starts on a pre-token edge come first (both ends of every chunk on pre-token edges: a chunk's ids are
exactly what its own text tokenizes to, so its vector is that of encoding its text), the boundary
rank decides among them. Without overlap every cut at whitespace is such a cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedpipe.ranges import within
from embedpipe.text.tokenizer import DocumentTokens, TextTokenizer, Tokenized

SENTENCE, LINE, SPACE, EDGE, MID = 3, 2, 1, 0, -1  # boundary ranks, best first
SENTENCE_ENDS = ".!?"
CLOSERS = "\"')]»”’"  # may follow a sentence end: `end." Next`


@dataclass
class Chunks:
    """The chunks of a list of documents, documents in input order, chunks in text order."""

    doc: np.ndarray  # [C] int64: the document (index into the texts) of each chunk
    chunk: np.ndarray  # [C] int32: 0-based within its document
    first: np.ndarray  # [C] int64: first token, into the document's tokens
    stop: np.ndarray  # [C] int64: one past the last token
    start: np.ndarray  # [C] int64: character offset of the chunk's text in the document
    end: np.ndarray  # [C] int64: one past its last character

    def __len__(self) -> int:
        return int(self.doc.shape[0])

    def per_document_of(self, documents: int) -> np.ndarray:  # [N] chunks of each document
        return np.bincount(self.doc, minlength=documents)

    def take(self, index: np.ndarray) -> "Chunks":
        return Chunks(**{name: getattr(self, name)[index] for name in CHUNK_FIELDS})


CHUNK_FIELDS = ("doc", "chunk", "first", "stop", "start", "end")
Chunked = tuple[list[DocumentTokens], Chunks]  # a chunker's output for N documents: each one's tokens [N], the chunks


def concat_chunks(parts: list[Chunks], *, offsets) -> Chunks:
    """The chunks of consecutive lists of documents as one, ``offsets`` being each list's first document."""
    parts = list(parts)
    if not parts:
        return Chunks(**{name: np.zeros(0, dtype=np.int32 if name == "chunk" else np.int64) for name in CHUNK_FIELDS})
    joined = {name: np.concatenate([getattr(p, name) for p in parts]) for name in CHUNK_FIELDS}
    joined["doc"] = np.concatenate([p.doc + off for p, off in zip(parts, offsets)])
    return Chunks(**joined)


def documents_of(docs: list[DocumentTokens], chunks: Chunks, index: np.ndarray) -> Chunked:
    """Documents ``index`` (increasing) of a chunker's output (``docs``, ``chunks``), as the chunker gives them for
    those texts alone: a document's tokens and chunks do not depend on the documents chunked beside it."""
    index = np.asarray(index, dtype=np.int64)
    part = chunks.take(np.flatnonzero(np.isin(chunks.doc, index)))
    part.doc = np.searchsorted(index, part.doc).astype(np.int64)
    return [docs[i] for i in index.tolist()], part


class Chunker:
    """Built once from the model's tokenizer and ``input.chunking``; called per list of texts."""

    def __init__(self, *, tokenizer: TextTokenizer, max_tokens: int, overlap: int, window: int):
        self.tokenizer, self.max_tokens, self.overlap = tokenizer, max_tokens, overlap
        self.budget = max_tokens - tokenizer.framing  # text tokens per chunk
        if self.budget - overlap < 1:
            raise ValueError(f"input.chunking.max_tokens={max_tokens} leaves {self.budget} text tokens after the "
                             f"{tokenizer.framing} special and prompt tokens, not more than input.chunking.overlap="
                             f"{overlap}: raise max_tokens or lower overlap")
        self.window = max(0, min(window, self.budget - overlap - 1))

    def __call__(self, texts: list[str]) -> Chunked:
        docs = self.tokenizer.documents(texts, offsets_past=self.budget)  # offsets only where a cut is needed
        spans = [self.spans(doc, text) for doc, text in zip(docs, texts)]
        counts = np.fromiter((len(s) for s in spans), dtype=np.int64, count=len(spans))
        pairs = np.asarray([p for s in spans for p in s], dtype=np.int64).reshape(-1, 2)  # [C, 2]
        doc = np.repeat(np.arange(len(texts), dtype=np.int64), counts)
        chunk = within(counts).astype(np.int32)
        start = np.empty(len(doc), dtype=np.int64)
        end = np.empty(len(doc), dtype=np.int64)
        for i, (d, (first, stop)) in enumerate(zip(doc.tolist(), pairs.tolist())):
            tokens = docs[d]
            if counts[d] == 1:  # the whole document, less the whitespace around it
                text = texts[d]
                start[i], end[i] = (len(text) - len(text.lstrip()), len(text.rstrip())) if stop > first else (0, 0)
            else:
                start[i], end[i] = tokens.starts[first], tokens.ends[stop - 1]
        return docs, Chunks(doc=doc, chunk=chunk, first=pairs[:, 0].copy(), stop=pairs[:, 1].copy(),
                            start=start, end=end)

    def chunk_range(self, texts: list[str], *, start: int, stop: int, given: Chunked | None = None) -> Chunked:
        """Documents [start, stop) of ``texts``, chunked as ``self(texts[start:stop])`` chunks them. ``given``: this
        chunker's output for all of ``texts``, when the caller has it already: its documents are taken from it, not
        tokenized again."""
        if given is None:
            return self(texts[start:stop])
        return documents_of(*given, np.arange(start, min(stop, len(texts))))

    def spans(self, doc: DocumentTokens, text: str) -> list[tuple[int, int]]:
        """[first, stop) token spans of one document: consecutive spans share exactly ``overlap`` tokens."""
        n, out, first = len(doc.ids), [], 0
        while n - first > self.budget:
            stop = self.cut(doc, text, first=first)
            out.append((first, stop))
            first = stop - self.overlap
        out.append((first, n))
        return out

    def cut(self, doc: DocumentTokens, text: str, *, first: int) -> int:
        """The stop of the span starting at ``first``: the best boundary in the window before the limit."""
        limit = first + self.budget
        best, best_key = limit, None
        for stop in range(max(first + self.overlap + 1, limit - self.window), limit + 1):
            rank = boundary_rank(doc, text, stop)
            # both ends on pre-token edges: the chunk's ids are those its own text tokenizes to
            safe = rank >= EDGE and bool(doc.word_start[stop - self.overlap])
            key = (safe, rank, stop)
            if best_key is None or key > best_key:
                best, best_key = stop, key
        return best

    def framed(self, docs: list[DocumentTokens], chunks: Chunks) -> Tokenized:
        """Each chunk's ids as the model reads them: specials, prompt, the span's tokens, specials."""
        return frame_spans(self.tokenizer, docs, chunks.doc, chunks.first, chunks.stop)


def frame_spans(tokenizer: TextTokenizer, docs: list[DocumentTokens], doc: np.ndarray, first: np.ndarray,
                stop: np.ndarray) -> Tokenized:
    """Token spans [first, stop) of documents ``doc`` as sequences: specials, prompt, the span, specials."""
    t, pieces = tokenizer, []
    for d, a, b in zip(doc.tolist(), first.tolist(), stop.tolist()):
        pieces += [t.prefix, t.prompt_ids, docs[d].ids[a:b], t.suffix]
    lengths = (stop - first + t.framing).astype(np.int64)
    ids = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
    return Tokenized(ids=ids, lengths=lengths, truncated=np.zeros(len(doc), dtype=bool))


@dataclass
class Windows:
    """Late chunking's forward passes: token spans of documents, each holding whole chunks."""

    doc: np.ndarray  # [W] int64
    first: np.ndarray  # [W] int64: first token of the window, into the document's tokens
    stop: np.ndarray  # [W] int64
    of_chunk: np.ndarray  # [C] int64: the window each chunk is pooled from


def plan_windows(chunks: Chunks, *, budget: int) -> Windows:
    """Consecutive chunks of a document gathered into windows of at most ``budget`` text tokens: the whole
    document when it fits, else a window starting at its first chunk not yet placed (consecutive windows
    then share the chunks' ``overlap`` tokens)."""
    doc, first, stop, of_chunk = [], [], [], np.empty(len(chunks), dtype=np.int64)
    for i, (d, a, b) in enumerate(zip(chunks.doc.tolist(), chunks.first.tolist(), chunks.stop.tolist())):
        if not doc or doc[-1] != d or b - first[-1] > budget:
            doc.append(d)
            first.append(a)
            stop.append(b)
        stop[-1] = max(stop[-1], b)
        of_chunk[i] = len(doc) - 1
    as_array = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return Windows(doc=as_array(doc), first=as_array(first), stop=as_array(stop), of_chunk=of_chunk)


def boundary_rank(doc: DocumentTokens, text: str, stop: int) -> int:
    """How good a cut between token ``stop - 1`` and token ``stop`` is (SENTENCE best, MID worst)."""
    end = int(doc.ends[stop - 1])
    gap = text[end:doc.starts[stop]]
    if not gap:
        return EDGE if doc.word_start[stop] else MID
    before = text[max(0, end - 8):end].rstrip(CLOSERS)[-1:]  # a few characters: never a copy of the text
    if before and before in SENTENCE_ENDS:
        return SENTENCE
    return LINE if "\n" in gap else SPACE
