"""Small building blocks shared by the model families."""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from embedpipe.models.activations import check_activation

# config.json `hidden_act` -> function: the names of embedpipe/models/activations.py (a test pins the match)
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact, erf
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    return ACTIVATIONS[check_activation(name)]


@runtime_checkable
class FusedLinear(Protocol):
    """A linear that computes its consumer in the same call (runtime/cpu.py OneDNNLinear: oneDNN post-ops on the
    accumulator, before the output is stored). The models reach it through linear_add and linear_act."""

    def add_to(self, x: Tensor, residual: Tensor) -> Tensor | None: ...  # residual + linear(x), or None: not here

    def activated(self, x: Tensor, *, act: str) -> Tensor | None: ...  # ACTIVATIONS[act](linear(x)), or None


def linear_add(linear: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """residual + linear(x) ([..., out]): a residual connection, in one call where the linear fuses it (the add and a
    pass over [T, hidden] saved twice a layer). MiniLM on an AMX Xeon, with linear_act: bf16 1.03x, fp32 1.04x
    tokens/s (docs/performance.md, 2026-12-04); fp32 bit-identical."""
    fused = linear.add_to(x, residual) if isinstance(linear, FusedLinear) else None
    return fused if fused is not None else residual + linear(x)


def linear_act(linear: nn.Module, x: Tensor, *, act: str) -> Tensor:
    """ACTIVATIONS[act](linear(x)) ([..., out]), in one call where the linear fuses that activation (on oneDNN's fp32
    accumulator: fp32 bit-identical, bf16 rounded once)."""
    fused = linear.activated(x, act=act) if isinstance(linear, FusedLinear) else None
    return fused if fused is not None else ACTIVATIONS[act](linear(x))


class LayerNorm(nn.LayerNorm):
    """LayerNorm that accumulates in fp32 whatever the activation dtype; returns the input dtype.

    fp32, bf16, and fp16 on CUDA: one F.layer_norm call on the input as it is (torch's kernels accumulate
    half inputs in fp32: one fused kernel, no fp32 copies of the activations; MiniLM bf16 on an AMX CPU:
    +2-6 % tokens/s, two fp32 copies per norm saved). fp16 on CPU: the input is upcast first (no fast fp16
    path on these CPUs). Both compute the same statistics in fp32 (tests/test_layers.py pins it on CPU).
    """

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, eps=self.eps)


FUSED_NORM_DTYPES = (torch.float32, torch.bfloat16)  # F.layer_norm as it is on CPU; fp16 is upcast there


def layer_norm(x: Tensor, shape: tuple[int, ...], weight: Tensor | None, bias: Tensor | None, *, eps: float,
               fused: bool | None = None) -> Tensor:
    """F.layer_norm with fp32 statistics; ``fused`` (default: fp32 or bf16 input, or CUDA) passes the input as it is."""
    if fused if fused is not None else (x.dtype in FUSED_NORM_DTYPES or x.is_cuda):
        w = None if weight is None else weight.to(x.dtype)  # no-op when loaded in the model's dtype
        b = None if bias is None else bias.to(x.dtype)
        return F.layer_norm(x, shape, w, b, eps)
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), shape, w, b, eps).to(x.dtype)


def matmul_params(module: nn.Module) -> int:
    """Weights of every nn.Linear under `module` (each costs 2 FLOPs per token: multiply + add)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


class RMSNorm(nn.Module):
    """RMSNorm (Qwen3, Llama): x / rms(x) * weight with the mean square in fp32; returns the input dtype.

    One F.rms_norm call on the input as it is: torch upcasts half inputs to fp32 for the statistics
    and multiplies by the weight after casting back, as transformers' Qwen3RMSNorm does (on CUDA,
    torch >= 2.8, one fused kernel)."""

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)  # [..., dim]


def rotary_cos_sin(positions: Tensor, *, head_dim: int, theta: float,
                   dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """positions [T] -> cos, sin [T, 1, head_dim // 2] in ``dtype`` (the activations') for `apply_rotary`
    ("default" RoPE).

    Same inverse frequencies as transformers: 1 / theta^(2i / head_dim), angles and their cos/sin in
    fp32, then cast to the activation dtype once per forward, as transformers' rotary embedding does.
    Computed per forward from the positions (T * head_dim/2 trig ops, noise next to one matmul), so
    there is no buffer to fill from the checkpoint and nothing cached that a longer sequence could outgrow.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float) / head_dim))
    freqs = positions.float()[:, None] * inv_freq  # [T, head_dim / 2]
    return freqs.cos()[:, None, :].to(dtype), freqs.sin()[:, None, :].to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D/2] in the activation dtype (transformers' rounding: each product,
    then the sum); "rotate half" layout (GPT-NeoX, HF Llama/Qwen/ModernBERT): dimension i pairs with i + D/2."""
    x1, x2 = x.chunk(2, dim=-1)  # 2 x [T, H, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, H, D]
