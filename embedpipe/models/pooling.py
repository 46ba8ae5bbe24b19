"""Pool packed token states into one vector per sequence, by index arithmetic only."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

PoolingMode = Literal["mean", "cls", "last"]
POOLING_MODES: tuple[str, ...] = ("mean", "cls", "last")


def pool(hidden: Tensor, cu_seqlens: Tensor, *, mode: PoolingMode, skip: int = 0) -> Tensor:
    """hidden [T, H], cu_seqlens [B+1] -> [B, H] float32. No loop over sequences, no host sync.

    ``skip``: leading tokens of every sequence left out of the pool (the prompt, when the
    sentence-transformers Pooling config has include_prompt=false). As sentence-transformers does:
    mean averages the rest (a zero vector when nothing is left), cls takes the first token after
    the prompt (the first token when the prompt fills the sequence), last is unchanged.
    """
    cu = cu_seqlens.long()
    start = torch.minimum(cu[:-1] + skip, cu[1:]) if skip else cu[:-1]  # [B] first pooled token
    if mode == "cls":
        first = torch.where(start < cu[1:], start, cu[:-1]) if skip else cu[:-1]  # [B]
        return hidden[first].float()  # [B, H]
    if mode == "last":
        return hidden[cu[1:] - 1].float()  # [B, H] last token
    if mode == "mean":
        # Prefix sums in fp64: the difference of two fp32 running sums over the whole pack
        # would carry an error that grows with the sequences packed before this one.
        c = F.pad(hidden.double().cumsum(0), (0, 0, 1, 0))  # [T+1, H], c[i] = sum of rows < i
        lens = (cu[1:] - start).clamp(min=1)  # [B]; an empty rest sums to 0 -> a zero vector
        return ((c[cu[1:]] - c[start]) / lens[:, None]).float()  # [B, H]
    raise ValueError(f"pooling mode {mode!r} is not supported; choose one of {POOLING_MODES}")
