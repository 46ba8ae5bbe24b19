"""Our packed encoder against sentence-transformers on the quickstart corpus (fp32): every row that
max_seq_len truncates, and every third of the others (about 1,000 of 3,000 rows; the whole corpus took
two minutes of the suite on two cores)."""

import numpy as np
import pytest
import torch

from embedpipe.runtime import Encoder


def test_quickstart_corpus_matches_sentence_transformers(minilm_dir, quickstart_table):
    st = pytest.importorskip("sentence_transformers")
    torch.manual_seed(0)
    encoder = Encoder.from_options("sentence-transformers/all-MiniLM-L6-v2")
    assert encoder.max_seq_len == 256
    every = quickstart_table["text"].to_pylist()
    truncated = encoder.tokenizer(every).truncated
    texts = [t for i, t in enumerate(every) if truncated[i] or i % 3 == 0]
    assert int(truncated.sum()) >= 20 and len(texts) >= 1000  # the long tail is in the comparison
    ours = encoder.embed(texts)
    ref = st.SentenceTransformer(str(minilm_dir), device="cpu").encode(texts, batch_size=64,
                                                                        convert_to_numpy=True)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, f"worst row {int(cos.argmin())}: cos {cos.min():.7f}"
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # Normalize module honoured
