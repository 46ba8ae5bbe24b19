"""BERT on packed tokens vs transformers / sentence-transformers, and the loader's checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from embedpipe.kernels import available_backends
from embedpipe.models import MODEL_REGISTRY, build_head, load_model, load_state_dict_into, pool
from embedpipe.models.bert import BertConfig, BertModel
from tests.model_helpers import LENGTHS, cosine, hf_hidden, pack, random_sequences, save_tiny_bert

BACKENDS = available_backends(device="cpu")  # reference, sdpa on CPU


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bert")
    hf = save_tiny_bert(path)
    seqs = random_sequences(LENGTHS)
    return path, hf, seqs, hf_hidden(hf, seqs)


def test_registry_has_bert():
    assert MODEL_REGISTRY["bert"] is BertModel


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_bert_matches_transformers_fp32(tiny, backend):
    path, _, seqs, ref = tiny
    lm = load_model(path, attention_backend=backend)
    ids, pos, cu, max_len = pack(seqs)
    with torch.no_grad():
        hidden = lm.model(ids, pos, cu, max_len)  # [T, 32]
    ref_hidden = torch.cat(ref)
    torch.testing.assert_close(hidden, ref_hidden, atol=2e-5, rtol=1e-5)
    assert cosine(hidden, ref_hidden).min() >= 1 - 1e-5
    for mode, ref_vec in [("mean", torch.stack([r.mean(0) for r in ref])), ("cls", torch.stack([r[0] for r in ref])),
                          ("last", torch.stack([r[-1] for r in ref]))]:
        vec = pool(hidden, cu, mode=mode)
        assert vec.dtype == torch.float32 and vec.shape == (len(LENGTHS), 32)
        torch.testing.assert_close(vec, ref_vec, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_bert_bf16(tiny, backend):
    path, _, seqs, ref = tiny
    lm = load_model(path, dtype=torch.bfloat16, attention_backend=backend)
    assert lm.model.embed.tok.weight.dtype == torch.bfloat16
    ids, pos, cu, max_len = pack(seqs)
    with torch.no_grad():
        hidden = lm.model(ids, pos, cu, max_len)
    assert hidden.dtype == torch.bfloat16
    assert cosine(hidden, torch.cat(ref)).min() >= 1 - 1e-3
    mean_ref = torch.stack([r.mean(0) for r in ref])
    assert cosine(pool(hidden, cu, mode="mean"), mean_ref).min() >= 1 - 1e-3


def test_load_state_dict_into_from_memory(tiny):
    """Weights straight from an in-memory transformers model (prefixed names, as in BertForX)."""
    _, hf, seqs, ref = tiny
    cfg = BertConfig.from_hf_config(hf.config.to_dict())
    with torch.device("meta"):
        model = BertModel(cfg, attention_backend="reference")
    load_state_dict_into(model, {f"bert.{k}": v for k, v in hf.state_dict().items()})
    ids, pos, cu, max_len = pack(seqs)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, cu, max_len), torch.cat(ref), atol=2e-5, rtol=1e-5)


def test_mean_pool_is_exact_in_a_long_pack():
    """A sequence's mean must not depend on what is packed before it (fp32 prefix sums would drift)."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 256, (160,), generator=g)  # ~20k tokens
    hidden = 6 + torch.randn(int(lens.sum()), 8, generator=g)  # a large common offset, like real outlier dims
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    got = pool(hidden, cu, mode="mean")
    want = torch.stack([h.double().mean(0) for h in hidden.split(lens.tolist())]).float()
    assert (got - want).abs().max().item() <= 1e-6
    for b in (0, 80, 159):  # on CPU, bit for bit the mean of the sequence pooled alone
        s, e = int(cu[b]), int(cu[b + 1])
        assert torch.equal(pool(hidden[s:e], torch.tensor([0, e - s]), mode="mean")[0], got[b])
    skipped = pool(hidden, cu, mode="mean", skip=3)  # a prompt of 3 tokens left out; nothing left: a zero vector
    want = torch.stack([h[3:].double().sum(0) / max(len(h) - 3, 1) for h in hidden.split(lens.tolist())]).float()
    assert (skipped - want).abs().max().item() <= 1e-6


def test_flops_per_token_bert_base_hand_count():
    cfg = BertConfig(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)
    with torch.device("meta"):
        model = BertModel(cfg)
    per_layer = 4 * 768 * 768 + 2 * 768 * 3072  # qkv + out + up + down weights
    assert model.flops_per_token(512) == 2 * 12 * per_layer + 4 * 12 * 768 * 512 == 188_743_680


# ---- the real packaged all-MiniLM-L6-v2 vs sentence-transformers ----

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Hi",
    "?",
    "Packed attention avoids padding in dense layers.",
    "Paris is the capital and most populous city of France.",
    "def f(x):\n    return x ** 2  # squares",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "Emojis 🚀🔥 and symbols: ∑ ∫ √ ≈ ≠",
    "UPPERCASE TEXT SHOULD BE LOWERCASED BY THE UNCASED TOKENIZER",
    "Numbers like 3.14159, 2,718 and 1e-9 appear in scientific writing.",
    "   leading and trailing whitespace   ",
    "A somewhat longer sentence that talks about batch embedding pipelines, Parquet files, "
    "Ray actors and FAISS indexes, written to exercise a few dozen tokens.",
    "What is the weather like in Reykjavik in February?",
    "Transformers use self-attention to relate tokens to each other.",
    "https://example.com/path?query=1&other=two#fragment",
    " ".join(f"word{i} and more text number {i}" for i in range(120)),  # > 256 tokens: truncated
]


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from tokenizers import Tokenizer

    path = Path(minilm_dir)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=256)
    lm = load_model(path, attention_backend="sdpa")
    return path, tok, lm, lm.build_head()


def _embed(lm, head, tok, texts: list[str]) -> torch.Tensor:
    encs = tok.encode_batch(texts)
    ids, pos, cu, max_len = pack([torch.tensor(e.ids) for e in encs])
    with torch.no_grad():
        return head(lm.model(ids, pos, cu, max_len), cu)  # [B, 384]


def test_minilm_matches_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    path, tok, lm, head = minilm
    assert max(len(e.ids) for e in tok.encode_batch(TEXTS)) == 256  # the long text is truncated
    ours = _embed(lm, head, tok, TEXTS)
    st = SentenceTransformer(str(path), device="cpu")
    ref = st.encode(TEXTS, convert_to_tensor=True).float()
    assert ours.shape == ref.shape == (len(TEXTS), 384)
    sims = cosine(ours, ref)
    assert sims.min() >= 0.99999, sims
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["sdpa", "grouped", "matmul"])  # the CPU backends
def test_batch_invariance(minilm, backend):
    path, tok, lm, head = minilm
    if backend != "sdpa":
        lm = load_model(path, attention_backend=backend)
    others = [f"Filler sentence {i} " + "with more words " * (i % 7) for i in range(30)]
    target = TEXTS[7]
    alone = _embed(lm, head, tok, [target])[0]
    packed = _embed(lm, head, tok, others[:15] + [target] + others[15:])[15]
    assert (alone - packed).abs().max().item() <= 1e-6


@pytest.mark.parametrize("linears", ["onednn", "torch"])
def test_encoder_default_cpu_path_is_batch_invariant(minilm_dir, linears):
    """The CPU default as workers run it (grouped attention, the packer's batches), on each GEMM library
    runtime.cpu_linears: auto may choose."""
    from embedpipe.runtime import Encoder

    enc = Encoder.from_options(str(minilm_dir), threads=2, cpu_linears=linears)
    others = [f"Filler sentence {i} " + "with more words " * (i % 7) for i in range(300)]
    alone = enc.embed([TEXTS[7]])
    packed = enc.embed(others[:150] + [TEXTS[7]] + others[150:])[150:151]
    assert np.abs(alone - packed).max() <= 1e-6


# ---- loader errors ----


def _copy_with_state(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")
    return dst


def test_loader_rejects_unknown_key(tiny, tmp_path):
    path = _copy_with_state(tiny[0], tmp_path / "m", lambda s: s.update({"encoder.layer.0.adapter.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.adapter\.weight"):
        load_model(path)


def test_loader_reports_missing_parameter(tiny, tmp_path):
    path = _copy_with_state(tiny[0], tmp_path / "m", lambda s: s.pop("encoder.layer.1.output.dense.bias"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down\.bias"):
        load_model(path)


def test_loader_refuses_pickle_only(tiny, tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(tiny[0] / "config.json", path / "config.json")
    torch.save(load_file(tiny[0] / "model.safetensors"), path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"model\.allow_pickle"):
        load_model(path)
    lm = load_model(path, allow_pickle=True, attention_backend="reference")  # opt-in reads it (weights_only)
    assert lm.hidden_size == 32


def test_loader_rejects_unknown_model_type(tiny, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny[0], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "not_a_model"}))
    with pytest.raises(ValueError, match=r"not_a_model.*bert"):
        load_model(path)


def test_plain_dir_head_defaults(tiny):
    lm = load_model(tiny[0], attention_backend="reference")
    assert lm.spec.pooling is None and not lm.spec.normalize and lm.dim == 32
    assert lm.max_positions == lm.model.max_seq_len == 128  # max_position_embeddings, no offset
    head = lm.build_head()
    assert head.pooling == lm.config.default_pooling == "mean" and not head.normalize
    assert build_head(lm.spec, pooling="cls", normalize=True).pooling == "cls"


def test_mean_pool_of_the_gpu_path_is_exact_in_a_long_pack():
    """The GPU's fp32-only prefix sums (compensated) meet the bar of the fp64 ones above; forced here on CPU."""
    from embedpipe.models.pooling import segment_means

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 256, (160,), generator=g)  # ~20k tokens
    hidden = 6 + torch.randn(int(lens.sum()), 8, generator=g)
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0))
    want = torch.stack([h.double().mean(0) for h in hidden.split(lens.tolist())]).float()
    got = segment_means(hidden, cu[:-1], cu[1:], lens, fp64=False)
    assert got.dtype == torch.float32 and (got - want).abs().max().item() <= 1e-6
    naive = torch.nn.functional.pad(hidden.cumsum(0), (0, 0, 1, 0))  # one fp32 cumsum, as vLLM's MeanPool
    assert ((naive[cu[1:]] - naive[cu[:-1]]) / lens[:, None] - want).abs().max().item() > 1e-4  # the drift it fixes
    bf16 = hidden.bfloat16()
    want16 = torch.stack([h.double().mean(0) for h in bf16.split(lens.tolist())]).float()
    assert (segment_means(bf16, cu[:-1], cu[1:], lens, fp64=False) - want16).abs().max().item() <= 1e-6
