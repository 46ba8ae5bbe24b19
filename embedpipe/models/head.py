"""EmbeddingHead: packed hidden states -> one float32 vector per sequence.

    hidden [T, H], cu_seqlens [B+1] -> pool [B, H] -> Dense... [B, D] -> first `dim` [B, d]
    -> L2 normalize (optional)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from embedpipe.models.defaults import resolve_pooling
from embedpipe.models.pooling import POOLING_MODES, pool
from embedpipe.models.st import STSpec

# DenseSpec.activation -> function
DENSE_FUNCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "identity": lambda x: x,
    "tanh": torch.tanh,
    "relu": F.relu,
    "gelu": F.gelu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
}


class EmbeddingHead(nn.Module):
    """Pool, then the sentence-transformers Dense stack, then Matryoshka truncation to `dim`
    (None: keep all), then optional L2 normalization (after truncation: the kept part has unit
    norm again), all fp32. `skip_tokens` leading tokens of every sequence stay out of the pool: the
    prompt's, when the model's Pooling config says include_prompt=false (one prompt per run, so one length)."""

    def __init__(self, *, pooling: str, dense: list[nn.Linear], activations: list[str], normalize: bool,
                 skip_tokens: int = 0, dim: int | None = None) -> None:
        super().__init__()
        if pooling not in POOLING_MODES:
            raise ValueError(f"pooling {pooling!r} is not supported; choose one of {POOLING_MODES} or 'auto'")
        self.pooling, self.normalize, self.activations = pooling, normalize, activations
        self.skip_tokens, self.dim = skip_tokens, dim
        self.dense = nn.ModuleList(dense)

    def forward(self, hidden: Tensor, cu_seqlens: Tensor) -> Tensor:
        x = pool(hidden, cu_seqlens, mode=self.pooling, skip=self.skip_tokens)  # [B, H] fp32
        for linear, act in zip(self.dense, self.activations):
            x = DENSE_FUNCTIONS[act](linear(x))  # [B, out]
        if self.dim is not None:
            x = x[:, : self.dim]  # [B, dim]
        return F.normalize(x, dim=-1) if self.normalize else x  # [B, D]


def build_head(
    spec: STSpec, *, pooling: str = "auto", normalize: bool | str = "auto", default_pooling: str = "mean",
    dim: int | None = None, skip_tokens: int = 0,
) -> EmbeddingHead:
    """"auto" does what sentence-transformers does with this directory; without a Pooling
    module, "auto" pooling is `default_pooling` (the model class's: mean for encoders, last for decoders).
    `dim`: keep the first `dim` dimensions (None: all); `skip_tokens`: prompt tokens left out of the pool."""
    if normalize not in (True, False, "auto"):
        raise ValueError(f"normalize must be true, false or 'auto', got {normalize!r}")
    if dim is not None and dim <= 0:
        raise ValueError(f"dim must be positive, got {dim}")
    dense = []
    for d in spec.dense:
        linear = nn.Linear(d.in_features, d.out_features, bias=d.bias)
        with torch.no_grad():
            linear.weight.copy_(d.weight)
            if d.bias_value is not None:
                linear.bias.copy_(d.bias_value)
        dense.append(linear)
    return EmbeddingHead(
        pooling=resolve_pooling(spec, pooling=pooling, default_pooling=default_pooling),
        dense=dense,
        activations=[d.activation for d in spec.dense],
        normalize=spec.normalize if normalize == "auto" else bool(normalize),
        skip_tokens=skip_tokens,
        dim=dim,
    ).eval()
