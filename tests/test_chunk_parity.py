"""Chunk vectors against sentence-transformers' encode of each chunk's text (packaged MiniLM, fp32)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from embedpipe.config import BatchingConfig, ChunkingConfig, ModelConfig, RuntimeConfig
from embedpipe.report.counters import Counters
from embedpipe.runtime import Encoder
from tests.conftest import shared_data


@pytest.fixture(scope="module")
def pages() -> list[str]:
    """4 real kernel-docs pages (their paragraphs joined by blank lines, ~6k tokens) and 4 short rows."""
    table = pq.read_table(shared_data("linux_kernel_docs_paragraphs.parquet"), columns=["source_doc", "text"])
    table = table.slice(0, 1500)
    grouped: dict[str, list[str]] = {}
    for doc, text in zip(table.column("source_doc").to_pylist(), table.column("text").to_pylist()):
        grouped.setdefault(doc, []).append(text)
    long = ["\n\n".join(p) for p in grouped.values() if len(p) > 3][:4]
    return long + table.column("text").to_pylist()[:4]


def chunk_encoder(*, max_tokens: int | None, overlap: int, mode: str = "split") -> Encoder:
    return Encoder(model=ModelConfig(path="sentence-transformers/all-MiniLM-L6-v2"), batching=BatchingConfig(),
                   runtime=RuntimeConfig(warmup_check=False),
                   chunking=ChunkingConfig(mode=mode, max_tokens=max_tokens, overlap=overlap))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("max_tokens,overlap", [(None, 32), (96, 16)])
def test_each_chunk_is_sentence_transformers_encode_of_its_text(minilm_dir, pages, max_tokens, overlap):
    st = pytest.importorskip("sentence_transformers")
    torch.manual_seed(0)
    encoder = chunk_encoder(max_tokens=max_tokens, overlap=overlap)
    counters = Counters()
    chunks, ours = encoder.embed_chunks(pages, counters)
    assert len(chunks) > 2 * len(pages) and ours.shape == (len(chunks), 384)
    texts = [pages[d][s:e] for d, s, e in zip(chunks.doc.tolist(), chunks.start.tolist(), chunks.end.tolist())]
    model = st.SentenceTransformer(str(minilm_dir), device="cpu")
    assert model.tokenize(texts)["input_ids"].shape[1] <= (max_tokens or 256)  # nothing truncated on either side
    ref = model.encode(texts, batch_size=32, convert_to_numpy=True)
    cos = cosine(ours, ref)
    assert cos.min() >= 0.99999, f"worst chunk {int(cos.argmin())}: cos {cos.min():.7f}"
    assert counters.documents == len(pages) and counters.rows == len(chunks)
    assert counters.chunks_max == int(chunks.per_document_of(len(pages)).max())
    assert counters.truncated_rows == 0


def test_chunks_in_input_order_across_sort_windows(pages):
    """Documents spread over several sort windows keep their order; off-mode rows are unchanged."""
    encoder = Encoder(model=ModelConfig(path="sentence-transformers/all-MiniLM-L6-v2"),
                      batching=BatchingConfig(sort_window=3), runtime=RuntimeConfig(warmup_check=False),
                      chunking=ChunkingConfig(mode="split", max_tokens=128))
    chunks, vectors = encoder.embed_chunks(pages[2:])
    assert (np.diff(chunks.doc) >= 0).all() and chunks.doc[-1] == len(pages) - 3
    short = np.flatnonzero(chunks.doc >= len(pages) - 6)  # the 4 short rows: one chunk each, their own vector
    np.testing.assert_allclose(vectors[short], encoder.embed(pages[-4:]), atol=1e-5)


def test_max_tokens_above_the_model_is_one_line():
    with pytest.raises(ValueError, match=r"input.chunking.max_tokens: 512 exceeds the model's max_seq_len=256"):
        chunk_encoder(max_tokens=512, overlap=0)
