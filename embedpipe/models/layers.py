"""Small building blocks shared by the model families."""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn

# config.json `hidden_act` -> function (names as transformers' ACT2FN spells them)
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact, erf
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the weight/activation dtype; returns the input dtype."""

    def forward(self, x: Tensor) -> Tensor:
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def matmul_params(module: nn.Module) -> int:
    """Weights of every nn.Linear under `module` (each costs 2 FLOPs per token: multiply + add)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def attention_flops(*, layers: int, heads: int, head_dim: int, context: float) -> float:
    """Per query token: QK^T and PV are each 2 * context * head_dim FLOPs per head per layer."""
    return 4.0 * layers * heads * head_dim * context
