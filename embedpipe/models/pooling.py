"""Pool packed token states into one vector per sequence, by index arithmetic only."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from embedpipe.kernels.cpu import segments

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
        lens = (cu[1:] - start).clamp(min=1)  # [B]; an empty rest sums to 0 -> a zero vector
        return segment_means(hidden, start, cu[1:], lens)  # [B, H]
    raise ValueError(f"pooling mode {mode!r} is not supported; choose one of {POOLING_MODES}")


def segment_means(hidden: Tensor, start: Tensor, end: Tensor, lens: Tensor, *, fp64: bool | None = None) -> Tensor:
    """hidden [T, H], start/end/lens [B] -> [B, H] fp32: the sum of rows [start, end) over lens.

    One fp32 cumsum over the pack (vLLM's MeanPool) makes a sequence's sum the difference of two
    running sums, whose rounding grows with everything packed before it (|error| ~ 2^-24 times the
    running sum: 3e-3 on means of 6 after 20k tokens). Two exact ways out, one per device kind:

    - GPU (``fp64`` False, the default off CPU): fp32 only. The rounding of each step is recovered:
      ``lost[i] = h[i] - (c[i+1] - c[i])`` is what the running sum dropped at row i (exact where it
      matters: late in the pack c[i+1] and c[i] are within a factor 2, so their difference is exact),
      and its own prefix sum is small, so its rounding is negligible: sum = (c[e] - c[s]) + (l[e] - l[s]).
      Two fp32 scans and a few elementwise ops, no fp64 (1/2 to 1/64 rate on GPUs); it holds for any
      scan order (CUDA's cumsum is a parallel scan): only c's own values are used.
    - CPU (``fp64`` True, the default there): each sequence's own rows summed in fp64 (index_add_ in row order,
      from zero), so nothing packed before it enters its sum: exact, and batch invariant bit for bit. Doubles run
      at full rate on CPUs; an fp64 cumsum over the pack did the same job 13x slower (MiniLM shapes, an 8k-token
      pack, 2 threads on an AMX Xeon: 26-29 ms against 2 ms, 5% of a bf16 step).
    """
    if fp64 if fp64 is not None else hidden.device.type == "cpu":
        cu = F.pad((end - start).clamp(min=0).cumsum(0), (1, 0))  # [B+1] the pooled rows, packed as segments
        seg, pos = segments(cu, int(cu[-1]))  # [R] each pooled row's sequence and place in it
        rows = start[seg] + pos  # [R] pooled rows of hidden
        sums = hidden.new_zeros(start.numel(), hidden.shape[1], dtype=torch.float64)  # [B, H]
        return (sums.index_add_(0, seg, hidden[rows].double()) / lens[:, None]).float()  # [B, H]
    h = hidden.float()  # [T, H]; a no-op in fp32
    c = F.pad(h.cumsum(0), (0, 0, 1, 0))  # [T+1, H], c[i] ~ sum of rows < i
    lost = F.pad((h - (c[1:] - c[:-1])).cumsum(0), (0, 0, 1, 0))  # [T+1, H], what c dropped before row i
    return ((c[end] - c[start]) + (lost[end] - lost[start])) / lens[:, None]  # [B, H]
