"""HF `tokenizers` wrapper: prompt, batch encode with truncation, ids out as one flat array."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.normalizers import Lowercase, Sequence


@dataclass
class Tokenized:
    ids: np.ndarray  # [T] int64, all sequences back to back
    lengths: np.ndarray  # [N] int64
    truncated: np.ndarray  # [N] bool: the text was cut at max_seq_len

    @property
    def starts(self) -> np.ndarray:  # [N] offset of each sequence in ids
        return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)


class TextTokenizer:
    """Built once from a model directory's ``tokenizer.json``; called per list of texts.

    The file's own padding and truncation settings are replaced: no padding ever, and
    truncation at ``max_seq_len`` tokens counting the special tokens and the prompt. As in
    sentence-transformers: the prompt is put before the text as a string, lower-casing is a
    ``Lowercase`` normalizer in front of the tokenizer's own (so the prompt is lower-cased too),
    and the prompt's length is that of the prompt tokenized alone, less a trailing special token.
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
        self.prompt_length = self._prompt_length(prompt)

    def _prompt_length(self, prompt: str) -> int:
        if not prompt:
            return 0
        ids = self.tokenizer.encode(prompt).ids
        special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        return len(ids) - 1 if ids and ids[-1] in special else len(ids)

    def __call__(self, texts: list[str]) -> Tokenized:
        if self.prompt:
            texts = [self.prompt + t for t in texts]
        encodings = self.tokenizer.encode_batch(texts)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64,
                          count=int(lengths.sum()))
        truncated = np.fromiter((bool(e.overflowing) for e in encodings), dtype=bool, count=len(encodings))
        return Tokenized(ids=ids, lengths=lengths, truncated=truncated)


def _has_lowercase(normalizer) -> bool:
    """sentence-transformers' test: a Lowercase normalizer, alone or in a Sequence."""
    if isinstance(normalizer, Lowercase):
        return True
    return isinstance(normalizer, Sequence) and any(isinstance(n, Lowercase) for n in normalizer)
