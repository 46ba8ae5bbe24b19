"""Pool packed token states into one vector per sequence, by index arithmetic only."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

PoolingMode = Literal["mean", "cls", "last"]
POOLING_MODES: tuple[str, ...] = ("mean", "cls", "last")


def pool(hidden: Tensor, cu_seqlens: Tensor, *, mode: PoolingMode) -> Tensor:
    """hidden [T, H], cu_seqlens [B+1] -> [B, H] float32. No loop over sequences, no host sync."""
    cu = cu_seqlens.long()
    if mode == "cls":
        return hidden[cu[:-1]].float()  # [B, H] first token
    if mode == "last":
        return hidden[cu[1:] - 1].float()  # [B, H] last token
    if mode == "mean":
        # Prefix sums in fp64: the difference of two fp32 running sums over the whole pack
        # would carry an error that grows with the sequences packed before this one.
        c = F.pad(hidden.double().cumsum(0), (0, 0, 1, 0))  # [T+1, H], c[i] = sum of rows < i
        lens = (cu[1:] - cu[:-1]).clamp(min=1)  # [B]
        return ((c[cu[1:]] - c[cu[:-1]]) / lens[:, None]).float()  # [B, H]
    raise ValueError(f"pooling mode {mode!r} is not supported; choose one of {POOLING_MODES}")
