"""FLOP rules shared by the model families (torch-free: a family's config computes its FLOPs without torch)."""

from __future__ import annotations


def attention_flops(*, layers: int, heads: int, head_dim: int, context: float) -> float:
    """Per query token: QK^T and PV are each 2 * context * head_dim FLOPs per head per layer."""
    return 4.0 * layers * heads * head_dim * context
