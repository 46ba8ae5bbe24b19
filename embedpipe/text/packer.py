"""Length-sorted token packer: windows of sequences sorted by length, cut by a token budget.

Sequences are laid back to back with no padding; ``cu_seqlens`` marks where each starts.
Index arithmetic only: no per-sequence Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from embedpipe.ranges import bounds, within
from embedpipe.text.tokenizer import Tokenized


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, 0-based within each sequence
    cu_seqlens: torch.Tensor  # [B+1] int32
    max_seqlen: int
    rows: np.ndarray  # [B] index of each sequence in the packed list of texts

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.rows.shape[0])


class TokenPacker:
    """Built once with the budget; called per tokenized unit, returns its batches."""

    def __init__(self, *, max_tokens: int, sort_window: int):
        self.max_tokens, self.sort_window = max_tokens, sort_window

    def __call__(self, tok: Tokenized) -> list[Batch]:
        if tok.lengths.size and tok.lengths.max() > self.max_tokens:
            raise ValueError(f"a sequence of {tok.lengths.max()} tokens exceeds batching.max_tokens="
                             f"{self.max_tokens}: raise batching.max_tokens to at least model.max_seq_len")
        starts = tok.starts
        batches = []
        for w0 in range(0, tok.lengths.size, self.sort_window):
            window = np.arange(w0, min(w0 + self.sort_window, tok.lengths.size))
            order = window[np.argsort(-tok.lengths[window], kind="stable")]  # longest first
            for rows in self._cut(tok.lengths[order], order):
                batches.append(self._gather(tok, starts, rows))
        return batches

    def _cut(self, lengths: np.ndarray, order: np.ndarray) -> list[np.ndarray]:
        """Greedy cut of the sorted window into runs whose token sum fits the budget."""
        groups, begin, total = [], 0, 0
        for i, n in enumerate(lengths.tolist()):
            if total + n > self.max_tokens:
                groups.append(order[begin:i])
                begin, total = i, 0
            total += n
        if begin < len(order):
            groups.append(order[begin:])
        return groups

    @staticmethod
    def _gather(tok: Tokenized, starts: np.ndarray, rows: np.ndarray) -> Batch:
        lengths = tok.lengths[rows]  # [B]
        cu = bounds(lengths)  # [B+1]
        positions = within(lengths)  # [T]
        source = np.repeat(starts[rows], lengths) + positions  # [T] index into tok.ids
        return Batch(
            input_ids=torch.from_numpy(tok.ids[source]),
            positions=torch.from_numpy(positions),
            cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
            max_seqlen=int(lengths.max()),
            rows=rows,
        )
