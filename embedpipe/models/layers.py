"""Small building blocks shared by the model families."""

from __future__ import annotations

from typing import Callable

import torch
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


class RMSNorm(nn.Module):
    """RMSNorm (Qwen3, Llama) computed in fp32 whatever the weight/activation dtype; returns the input dtype."""

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()  # [..., dim]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


def rotary_cos_sin(positions: Tensor, *, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """positions [T] -> cos, sin [T, 1, head_dim // 2] fp32 for `apply_rotary` ("default" RoPE).

    Same inverse frequencies as transformers: 1 / theta^(2i / head_dim). Computed per forward
    from the positions (T * head_dim/2 trig ops, noise next to one matmul), so there is no
    buffer to fill from the checkpoint and nothing cached that a longer sequence could outgrow.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float) / head_dim))
    freqs = positions.float()[:, None] * inv_freq  # [T, head_dim / 2]
    return freqs.cos()[:, None, :], freqs.sin()[:, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D] rotated in fp32 by cos/sin [T, 1, D/2]; "rotate half" layout (GPT-NeoX, HF Llama/Qwen/ModernBERT):
    dimension i pairs with i + D/2."""
    x1, x2 = x.float().chunk(2, dim=-1)  # 2 x [T, H, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)  # [T, H, D]
