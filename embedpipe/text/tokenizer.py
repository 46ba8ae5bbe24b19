"""HF `tokenizers` wrapper: prompt, batch encode with truncation (a long text by its head), ids out as one flat
array."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.normalizers import Lowercase, Sequence

from embedpipe.ranges import bounds

# A text longer than max_seq_len x this many characters is tokenized by its head first (``TextTokenizer._heads``):
# English runs 4-5 characters per WordPiece token, so the head nearly always holds the tokens a sequence keeps.
HEAD_CHARS_PER_TOKEN = 8
# A cut changes at most the word it falls in and, for a pre-tokenizer that looks one character ahead (byte-level
# BPE's ``\s+(?!\S)``), the word before it: the head's tokens of the words before its last two are the text's own.
HEAD_WORDS_UNSURE = 2


@dataclass
class Tokenized:
    ids: np.ndarray  # [T] int64, all sequences back to back
    lengths: np.ndarray  # [N] int64
    truncated: np.ndarray  # [N] bool: the text was cut at max_seq_len

    @property
    def starts(self) -> np.ndarray:  # [N] offset of each sequence in ids
        return bounds(self.lengths)[:-1]


@dataclass
class DocumentTokens:
    """One document tokenized once, without special tokens or the prompt (the chunker's input)."""

    ids: np.ndarray  # [n] int64
    starts: np.ndarray  # [n] int64 character offset of each token in the original text
    ends: np.ndarray  # [n] int64 character offset just past each token
    word_start: np.ndarray  # [n] bool: the token begins a pre-token (a text span starting here tokenizes alike)


class TextTokenizer:
    """Built once from a model directory's ``tokenizer.json``; called per list of texts.

    The file's own padding and truncation settings are replaced: no padding ever, and
    truncation at ``max_seq_len`` tokens counting the special tokens and the prompt. As in
    sentence-transformers: the prompt is put before the text as a string, lower-casing is a
    ``Lowercase`` normalizer in front of the tokenizer's own (so the prompt is lower-cased too),
    and the prompt's length is that of the prompt tokenized alone, less a trailing special token.
    A text much longer than a sequence is tokenized by its head where the head decides the sequence
    (``_heads``): the same ids, without tokenizing what truncation drops.
    """

    def __init__(self, model_dir: str | Path, *, max_seq_len: int, lower_case: bool = False, prompt: str = ""):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the model directory needs a fast-tokenizer file "
                                    f"(save it with `AutoTokenizer.from_pretrained(...).save_pretrained(dir)`)")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=max_seq_len)
        if lower_case and not _has_lowercase(self.tokenizer.normalizer):
            own = self.tokenizer.normalizer
            self.tokenizer.normalizer = Sequence([Lowercase(), *([own] if own is not None else [])])
        self.max_seq_len, self.lower_case, self.prompt = max_seq_len, lower_case, prompt
        # the same encodings without their character offsets, which nothing here reads: 8-12 % less tokenizer CPU
        # on MiniLM's WordPiece (docs/performance.md, session 38); an older tokenizers has only encode_batch
        self._encode_batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        self.prompt_length = self._prompt_length(prompt)
        self._documents = Tokenizer.from_str(self.tokenizer.to_str())  # the same normalizers, never truncated
        self._documents.no_truncation()
        self.prefix, self.suffix = self._specials()
        self.prompt_ids = np.asarray(self._documents.encode(prompt, add_special_tokens=False).ids if prompt else [],
                                     dtype=np.int64)
        self._kept = max_seq_len - len(self.prefix) - len(self.suffix)  # a sequence's tokens besides the specials
        self._head_chars = max_seq_len * HEAD_CHARS_PER_TOKEN

    @property
    def framing(self) -> int:
        """Tokens every sequence carries besides its text's: the special tokens and the prompt's."""
        return len(self.prefix) + len(self.prompt_ids) + len(self.suffix)

    def _specials(self) -> tuple[np.ndarray, np.ndarray]:
        """The special tokens the post-processor puts before and after a text ([CLS] / [SEP], <s> / </s>, ...)."""
        inner = self._documents.encode("a", add_special_tokens=False).ids
        outer = self._documents.encode("a", add_special_tokens=True).ids
        for i in range(len(outer) - len(inner) + 1):
            if outer[i:i + len(inner)] == inner:
                return (np.asarray(outer[:i], dtype=np.int64), np.asarray(outer[i + len(inner):], dtype=np.int64))
        raise ValueError("the tokenizer's post-processor changes a text's own tokens: chunking cannot frame chunks")

    def documents(self, texts: list[str], *, offsets_past: int = 0) -> list[DocumentTokens]:
        """Each text tokenized whole, once, with character offsets into the text (no specials, no prompt).
        ``offsets_past``: a document of at most this many tokens gets its ids only (``starts`` and the rest
        empty): the chunker cuts only longer ones, and the offsets are most of the cost on short ones."""
        out = []
        for e in self._documents.encode_batch(texts, add_special_tokens=False):
            ids = np.asarray(e.ids, dtype=np.int64)
            if len(ids) <= offsets_past:
                out.append(DocumentTokens(ids=ids, starts=_EMPTY, ends=_EMPTY, word_start=_NO_WORDS))
                continue
            offsets = np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)  # [n, 2]
            words = np.asarray([-1 if w is None else w for w in e.word_ids], dtype=np.int64)  # [n]
            word_start = np.ones(len(words), dtype=bool)
            word_start[1:] = words[1:] != words[:-1]
            out.append(DocumentTokens(ids=ids, starts=offsets[:, 0].copy(), ends=offsets[:, 1].copy(),
                                      word_start=word_start))
        return out


    def _prompt_length(self, prompt: str) -> int:
        if not prompt:
            return 0
        ids = self.tokenizer.encode(prompt).ids
        special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        return len(ids) - 1 if ids and ids[-1] in special else len(ids)

    def __call__(self, texts: list[str]) -> Tokenized:
        if self.prompt:
            texts = [self.prompt + t for t in texts]
        heads = self._heads(texts)
        encodings = self._encode_batch([t for i, t in enumerate(texts) if i not in heads] if heads else texts)
        if heads:  # every sequence in input order: a long text's from its head, the others' from the whole text
            rest = iter(encodings)
            encodings = [_Kept(heads[i]) if i in heads else next(rest) for i in range(len(texts))]
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64,
                          count=int(lengths.sum()))
        truncated = np.fromiter((bool(e.overflowing) for e in encodings), dtype=bool, count=len(encodings))
        return Tokenized(ids=ids, lengths=lengths, truncated=truncated)

    def _heads(self, texts: list[str]) -> dict[int, list[int]]:
        """The sequences of the long texts (over ``max_seq_len x HEAD_CHARS_PER_TOKEN`` characters) that their head
        decides, by position in ``texts``: the specials around the text's first tokens, cut at ``max_seq_len`` as
        the whole text's encoding would be. Truncation keeps a sequence's first tokens; tokenizing a long text whole
        to keep them spends most of the tokenizer's time on tokens it drops. A head decides its text when the
        tokens of its words before the last ``HEAD_WORDS_UNSURE`` are more than a sequence keeps (then the text is
        cut, too); any other long text is tokenized whole."""
        cut = self._head_chars
        long = [i for i, t in enumerate(texts) if len(t) > cut] if self._kept > 0 else []
        if not long:
            return {}
        encodings = self._documents.encode_batch([texts[i][:cut] for i in long], add_special_tokens=False)
        prefix, suffix, kept = self.prefix.tolist(), self.suffix.tolist(), self._kept
        return {i: prefix + e.ids[:kept] + suffix for i, e in zip(long, encodings) if _settled(e.word_ids) > kept}


_EMPTY, _NO_WORDS = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)


@dataclass(frozen=True)
class _Kept:
    """A long text's sequence taken from its head (``TextTokenizer._heads``): cut, as its whole encoding would be."""

    ids: list[int]
    overflowing: bool = True


def _settled(word_ids: list[int | None]) -> int:
    """How many leading tokens of a text's head are the whole text's: those of the words before the head's last
    ``HEAD_WORDS_UNSURE`` (word ids never decrease along a text; a token of no word, never seen without special
    tokens, settles nothing)."""
    if not word_ids or None in word_ids:
        return 0
    return bisect.bisect_left(word_ids, word_ids[-1] - HEAD_WORDS_UNSURE + 1)


def _has_lowercase(normalizer) -> bool:
    """sentence-transformers' test: a Lowercase normalizer, alone or in a Sequence."""
    if isinstance(normalizer, Lowercase):
        return True
    return isinstance(normalizer, Sequence) and any(isinstance(n, Lowercase) for n in normalizer)
