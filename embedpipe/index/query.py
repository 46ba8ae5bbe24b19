"""The query encoder of a search: a BERT-family float32 model runs in numpy (no torch imported), any other
through the torch encoder (embedpipe/runtime/encoder.py).

    texts [N] -> tokens (the model's tokenizer, query prompt, max_seq_len) -> NumpyBert -> pool -> first dim
    -> L2 normalise (when the output's vectors are) -> [N, dim] float32

Every setting comes from the output's embedpipe.json (resolved: pooling, normalised, max_seq_len, dim) and the
model directory's sentence-transformers config (the prompt left out of the pool, lower-casing), the same facts the
torch encoder reads; tests/test_numpy_query.py holds the two to cosine >= 0.99999. A cold one-query search is
then about a second, where ``import torch`` alone was two (docs/performance.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from embedpipe.io.describe import OutputDescription
from embedpipe.models.numpy_bert import NumpyBert, load_numpy_bert
from embedpipe.models.st import read_st_spec
from embedpipe.text.tokenizer import TextTokenizer

NUMPY_DTYPES = ("auto", "float32")  # model.dtype values whose documents the numpy forward reproduces (CPU: fp32)
NUMPY_POOLING = ("mean", "cls", "last")


class NumpyQueryEncoder:
    """``embed(texts) -> [N, dim]`` float32, as the torch Encoder built with the same settings computes it."""

    def __init__(self, *, model: NumpyBert, tokenizer: TextTokenizer, pooling: str, normalize: bool, dim: int,
                 skip_tokens: int = 0):
        if pooling not in NUMPY_POOLING:
            raise ValueError(f"pooling {pooling!r} is not one of {NUMPY_POOLING}")
        self.model, self.tokenizer, self.pooling = model, tokenizer, pooling
        self.normalize, self.dim, self.skip_tokens = normalize, dim, skip_tokens

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        tok = self.tokenizer(list(texts))
        hidden = self.model(tok.ids, tok.lengths)  # [T, hidden]
        x = self._pool(hidden, tok.starts, tok.starts + tok.lengths)[:, :self.dim]  # [N, dim]
        if self.normalize:  # F.normalize: x / max(|x|, 1e-12)
            x = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), np.float32(1e-12))
        return x.astype(np.float32, copy=False)

    def _pool(self, hidden: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """embedpipe.models.pooling.pool for a few sequences: ``skip_tokens`` (the prompt) stay out of the pool."""
        first = np.minimum(starts + self.skip_tokens, ends)  # [N] first pooled token
        if self.pooling == "cls":
            return hidden[np.where(first < ends, first, starts)]  # [N, hidden]
        if self.pooling == "last":
            return hidden[ends - 1]  # [N, hidden]
        sums = np.stack([hidden[a:b].astype(np.float64).sum(0) for a, b in zip(first, ends)])  # [N, hidden]
        return (sums / np.maximum(ends - first, 1)[:, None]).astype(np.float32)  # an empty rest: a zero vector


def numpy_query_encoder(*, model_dir: Path, description: OutputDescription, prompt: str,
                        dtype: str) -> NumpyQueryEncoder | None:
    """The numpy encoder for queries against an output, or None where it does not apply (another model family,
    Dense modules, a model run in half precision, a pooling it lacks): the torch encoder answers then."""
    if dtype not in NUMPY_DTYPES or description.pooling not in NUMPY_POOLING:
        return None
    spec = read_st_spec(model_dir, dense_weights="skip")
    if spec.dense:
        return None
    model = load_numpy_bert(model_dir / spec.transformer_dir)
    if model is None or description.dim > model.hidden_size:
        return None
    tokenizer = TextTokenizer(model_dir, max_seq_len=description.max_seq_len, lower_case=spec.do_lower_case,
                              prompt=prompt)
    skip = 0 if spec.include_prompt else tokenizer.prompt_length  # as the torch Encoder's head
    return NumpyQueryEncoder(model=model, tokenizer=tokenizer, pooling=description.pooling,
                             normalize=description.normalized, dim=description.dim, skip_tokens=skip)
