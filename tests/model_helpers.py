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


def random_sequences(lengths=LENGTHS, *, vocab: int = 100, seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in lengths]


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
