"""Token buckets: pad a packed batch up to a fixed shape, so one CUDA graph serves every batch of it.

A shape is (tokens, seqs, seqlen):
  tokens  the smallest configured token bucket >= the batch's tokens (`batching.buckets`;
          default: powers of two from 64 up to max_tokens, and max_tokens itself)
  seqlen  the static `max_seqlen` handed to attention: the next power of two >= the longest
          sequence (at least 32), capped at the model's max_seq_len
  seqs    the next power of two >= real sequences + dummy sequences (at least 8)

The padding tokens form dummy sequences of at most `seqlen` tokens each (positions 0.., token
id 0), after the real sequences; the remaining sequence slots are empty (cu_seqlens repeats
the total). Only the first `num_seqs` output rows are real: the runner discards the rest.

    real:   [ s0 | s1 | ... | s(B-1) ]                               T tokens, B sequences
    padded: [ s0 | s1 | ... | s(B-1) | dummy | dummy | ] + empties   tokens, seqs

Inputs travel as one int32 array per batch, `[ids (tokens) | positions (tokens) | cu_seqlens (seqs+1)]`,
so a batch is one host-to-device copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from embedpipe.text.packer import Batch

MIN_TOKENS = 64  # smallest default token bucket
MIN_SEQS = 8  # smallest sequence-count bucket
MIN_SEQLEN = 32  # smallest static max_seqlen
PAD_ID = 0  # token id of dummy tokens (any valid id; their outputs are discarded)


@dataclass(frozen=True, order=True)
class Shape:
    """The static shape one graph is captured for."""

    tokens: int
    seqs: int
    seqlen: int  # static max_seqlen for attention

    @property
    def flat_size(self) -> int:
        """int32 elements of the packed input: ids, positions, cu_seqlens."""
        return 2 * self.tokens + self.seqs + 1


def default_token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from MIN_TOKENS below max_tokens, then max_tokens itself."""
    out, b = [], MIN_TOKENS
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max_tokens]


def check_buckets(buckets: Sequence[int], *, max_tokens: int) -> list[int]:
    """Sorted, deduplicated buckets; the largest must hold a full batch."""
    clean = sorted({int(b) for b in buckets})
    if not clean or clean[0] <= 0:
        raise ValueError(f"batching.buckets {list(buckets)} must be positive token counts "
                         f"(or null for powers of two up to batching.max_tokens)")
    if clean[-1] < max_tokens:
        raise ValueError(f"batching.buckets: the largest bucket {clean[-1]} is below batching.max_tokens="
                         f"{max_tokens}; add a bucket of at least {max_tokens} tokens, or lower max_tokens")
    return clean


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


class Bucketer:
    """Built once per runner from the token buckets and the model's max_seq_len; maps a batch to its Shape."""

    def __init__(self, *, max_tokens: int, max_seq_len: int, token_buckets: Sequence[int] | None = None):
        self.token_buckets = check_buckets(token_buckets or default_token_buckets(max_tokens), max_tokens=max_tokens)
        self.max_seq_len = max_seq_len
        self.largest = Shape(tokens=self.token_buckets[-1], seqs=_pow2_at_least(self.token_buckets[-1], MIN_SEQS),
                             seqlen=max_seq_len)  # bounds every shape (seqs <= tokens: dummies hold >= 1 token)

    def shape(self, *, num_tokens: int, num_seqs: int, max_seqlen: int) -> Shape:
        if num_tokens > self.token_buckets[-1]:
            raise ValueError(f"a batch of {num_tokens} tokens exceeds the largest bucket {self.token_buckets[-1]}: "
                             f"the packer's max_tokens must not exceed the largest of batching.buckets")
        if max_seqlen > self.max_seq_len:
            raise ValueError(f"a sequence of {max_seqlen} tokens exceeds max_seq_len={self.max_seq_len}")
        tokens = next(b for b in self.token_buckets if b >= num_tokens)
        seqlen = min(_pow2_at_least(max_seqlen, MIN_SEQLEN), self.max_seq_len)
        dummies = -(-(tokens - num_tokens) // seqlen)  # ceil: each dummy holds <= seqlen tokens
        seqs = _pow2_at_least(num_seqs + dummies, MIN_SEQS)
        if seqs > self.largest.seqs:
            raise ValueError(f"a batch of {num_seqs} sequences in {num_tokens} tokens has empty sequences; "
                             f"drop empty texts (or use a tokenizer that adds special tokens)")
        return Shape(tokens=tokens, seqs=seqs, seqlen=seqlen)


def exact_shape(batch: Batch) -> Shape:
    """No padding (eager runs): the batch's own sizes."""
    return Shape(tokens=batch.num_tokens, seqs=batch.num_seqs, seqlen=batch.max_seqlen)


def fill_inputs(out: np.ndarray, batch: Batch, shape: Shape) -> None:
    """Write the batch, padded to `shape`, into out[:shape.flat_size] (int32): [ids | positions | cu_seqlens]."""
    T, B, Tb, Bb, L = batch.num_tokens, batch.num_seqs, shape.tokens, shape.seqs, shape.seqlen
    pad = Tb - T
    dummies = -(-pad // L)
    if T > Tb or B + dummies > Bb or batch.max_seqlen > L:
        raise ValueError(f"batch (tokens={T}, seqs={B}, max_seqlen={batch.max_seqlen}) does not fit {shape}")
    ids, pos, cu = out[:Tb], out[Tb:2 * Tb], out[2 * Tb:2 * Tb + Bb + 1]
    ids[:T] = batch.input_ids.numpy()
    ids[T:] = PAD_ID
    pos[:T] = batch.positions.numpy()
    pos[T:] = np.arange(pad, dtype=np.int32) % L  # dummy k holds padding tokens [k*L, (k+1)*L)
    cu[:B + 1] = batch.cu_seqlens.numpy()
    cu[B + 1:B + 1 + dummies] = T + np.minimum(np.arange(1, dummies + 1) * L, pad)  # [dummies]
    cu[B + 1 + dummies:] = Tb  # empty sequences
