"""Late chunking (input.chunking.mode: late) against transformers' own forward pass over the whole document:
each chunk's vector is the pooling of its token span (tiny random ModernBERT and Qwen3, fp32)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer

from embedpipe.config import BatchingConfig, ChunkingConfig, ModelConfig, RuntimeConfig
from embedpipe.report.counters import Counters
from embedpipe.runtime import Encoder
from embedpipe.text.chunking import plan_windows
from tests.conftest import shared_data
from tests.model_helpers import randomize_norms_
from tests.test_models_modernbert import TINY as TINY_MODERNBERT
from tests.test_models_qwen3 import TINY as TINY_QWEN3

VOCAB = 30522  # all-MiniLM-L6-v2's tokenizer, copied into each tiny model's folder
KINDS = {  # family -> (transformers classes, config, pooling: the span's mean / the span's last token)
    "modernbert": ("ModernBertConfig", "ModernBertModel", {**TINY_MODERNBERT, "max_position_embeddings": 1024}, "mean"),
    "qwen3": ("Qwen3Config", "Qwen3Model", {**TINY_QWEN3, "max_position_embeddings": 1024}, "last"),
}


@pytest.fixture(scope="module", params=list(KINDS))
def tiny(request, tmp_path_factory, minilm_dir):
    import transformers

    config_cls, model_cls, config, pooling = KINDS[request.param]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**config, "vocab_size": VOCAB})).eval()
    randomize_norms_(hf)
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    hf.save_pretrained(path, safe_serialization=True)
    shutil.copy(Path(minilm_dir) / "tokenizer.json", path / "tokenizer.json")
    return path, hf, pooling


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """3 real documents of a few hundred tokens (kernel-docs paragraphs joined), one short row, one empty."""
    texts = pq.read_table(shared_data("linux_kernel_docs_paragraphs.parquet"), columns=["text"]).slice(0, 30)
    paragraphs = texts.column("text").to_pylist()
    return ["\n\n".join(paragraphs[i:i + 8]) for i in (0, 8, 16)] + [paragraphs[25], ""]


def late_encoder(path: Path, *, pooling: str, context: int, overlap: int = 8) -> Encoder:
    return Encoder(model=ModelConfig(path=str(path), max_seq_len=context, pooling=pooling, normalize=False),
                   batching=BatchingConfig(max_tokens=2048), runtime=RuntimeConfig(warmup_check=False),
                   chunking=ChunkingConfig(mode="late", max_tokens=64, overlap=overlap))


@torch.no_grad()
def reference(hf, ids: list[int], spans: list[tuple[int, int]], pooling: str) -> np.ndarray:
    """transformers over one whole sequence, then each span's rows pooled."""
    hidden = hf(input_ids=torch.tensor([ids])).last_hidden_state[0].float()  # [L, H]
    pool = (lambda h: h.mean(0)) if pooling == "mean" else (lambda h: h[-1])
    return torch.stack([pool(hidden[a:b]) for a, b in spans]).numpy()


def cosine(a, b) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_one_pass_over_the_whole_document(tiny, documents):
    path, hf, pooling = tiny
    encoder = late_encoder(path, pooling=pooling, context=1024)
    counters = Counters()
    chunks, ours = encoder.embed_chunks(documents, counters)
    plain = Tokenizer.from_file(str(path / "tokenizer.json"))
    plain.no_truncation()
    plain.no_padding()
    assert (chunks.per_document_of(len(documents))[:3] > 4).all()  # the long documents are cut
    for d, text in enumerate(documents):
        ids = plain.encode(text).ids  # [CLS] text [SEP]: the whole document, one sequence
        assert len(ids) <= 1024
        rows = np.flatnonzero(chunks.doc == d)
        spans = [(1 + a, 1 + b) if b > a else (0, len(ids)) for a, b in zip(chunks.first[rows], chunks.stop[rows])]
        cos = cosine(ours[rows], reference(hf, ids, spans, pooling))
        assert cos.min() >= 0.99999, f"document {d}: cos {cos.min():.7f}"
    assert counters.tokens == sum(len(plain.encode(t).ids) for t in documents)  # one pass: no token twice


def test_longer_than_the_context_falls_back_to_windows_with_the_overlap(tiny, documents):
    path, hf, pooling = tiny
    context, overlap = 160, 8
    encoder = late_encoder(path, pooling=pooling, context=context, overlap=overlap)
    chunks, ours = encoder.embed_chunks(documents)
    docs = encoder.tokenizer.documents(documents)
    windows = plan_windows(chunks, budget=context - 2)
    assert (windows.stop - windows.first + 2 <= context).all()
    for w in range(1, len(windows.doc)):
        if windows.doc[w] == windows.doc[w - 1]:
            assert windows.first[w] == windows.stop[w - 1] - overlap  # consecutive windows share the overlap
    assert len(windows.doc) > len(documents) + 3  # the long documents took several windows
    for w in range(len(windows.doc)):  # transformers over each window, each of its chunks pooled from it
        d, a, b = int(windows.doc[w]), int(windows.first[w]), int(windows.stop[w])
        mine = np.flatnonzero(windows.of_chunk == w)
        assert (a <= chunks.first[mine]).all() and (chunks.stop[mine] <= b).all()
        ids = [101, *docs[d].ids[a:b].tolist(), 102]
        spans = [(1 + f - a, 1 + t - a) if t > f else (0, len(ids))
                 for f, t in zip(chunks.first[mine].tolist(), chunks.stop[mine].tolist())]
        cos = cosine(ours[mine], reference(hf, ids, spans, pooling))
        assert cos.min() >= 0.99999, f"window {w}: cos {cos.min():.7f}"
