"""Attention backends made of plain torch ops: reference, sdpa, grouped and matmul (the CPU ones).

`reference` and `sdpa` also run on CUDA (sdpa as one padded call there); on CPU, `sdpa` pads per
16-token length band, `grouped` (SDPA) and `matmul` (fp32 scores by matmul) per length group, planned once
per forward (`plan_groups`, built by the model through kernels.plan_attention and passed to every layer's
attention call).
Signature and semantics: embedpipe/kernels/attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _allowed(n: int, *, causal: bool, window: int | None, device: torch.device) -> Tensor | None:
    """[n, n] bool, True where query i may attend key j; None when everything is allowed."""
    if not causal and window is None:
        return None
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]  # [n, n] query minus key position
    ok = torch.ones(n, n, dtype=torch.bool, device=device)
    if causal:
        ok &= d >= 0
    if window is not None:
        ok &= d.abs() <= window
    return ok


def _reference(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale, plan=None) -> Tensor:
    T, H, D = q.shape
    group = H // k.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs = q[s:e].float().transpose(0, 1)  # [H, L, D]
        ks = k[s:e].float().transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
        vs = v[s:e].float().transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
        scores = (qs @ ks.transpose(1, 2)) * scale  # [H, L, L]
        ok = _allowed(e - s, causal=causal, window=window, device=q.device)
        if ok is not None:
            scores = scores.masked_fill(~ok, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)  # [L, H, D]
    return out


def segments(cu: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """For each of `total` packed tokens: its sequence index and position within it ([total], [total])."""
    n = cu.numel() - 1
    seq = torch.repeat_interleave(torch.arange(n, device=cu.device), cu[1:] - cu[:-1], output_size=total)
    return seq, torch.arange(total, device=cu.device) - cu[seq]


def _sdpa_padded(q, k, v, cu: Tensor, max_seqlen: int, *, causal, window, scale) -> Tensor:
    # Scatter the packed tokens into a padded [B, Lmax] grid, run one SDPA call with a
    # key-padding mask, gather back. No host sync: B and Lmax are known without reading cu.
    T, H, D = q.shape
    B, L, dev = cu.numel() - 1, max_seqlen, q.device
    seq, pos = segments(cu, T)  # [T], [T]
    slot = seq * L + pos  # [T] row of each token in the flat [B * L] grid

    def pad(x: Tensor) -> Tensor:  # [T, h, D] -> [B, h, L, D]
        grid = x.new_zeros(B * L, x.shape[1], D).index_copy_(0, slot, x)  # [B * L, h, D]
        return grid.view(B, L, -1, D).transpose(1, 2)

    key_ok = torch.arange(L, device=dev)[None, :] < (cu[1:] - cu[:-1])[:, None]  # [B, L]
    mask = key_ok[:, None, None, :]  # [B, 1, 1, L]; padded query rows are dropped below
    ok = _allowed(L, causal=causal, window=window, device=dev)
    if ok is not None:
        mask = mask & ok  # [B, 1, L, L]
    o = F.scaled_dot_product_attention(
        pad(q), pad(k), pad(v), attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != H
    )  # [B, H, L, D]
    return o.transpose(1, 2).reshape(B * L, H, D)[slot]  # [T, H, D]


_BUCKET = 16  # CPU sdpa: sequences whose lengths fall in the same 16-token band share one SDPA call


def _sdpa(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale, plan=None) -> Tensor:
    # Only attention sees padding; the dense layers stay packed. On CUDA: one padded call
    # (no host sync, the GPU has flops to spare). On CPU padding costs real flops: one padded
    # call per 16-token length band, a loop over <= Lmax/16 bands, never over sequences.
    cu = cu_seqlens.long()
    kw = dict(causal=causal, window=window, scale=scale)
    if q.is_cuda:
        return _sdpa_padded(q, k, v, cu, max_seqlen, **kw)
    # Every band pads to its ceiling, whatever else is in the batch: a sequence then meets the
    # same SDPA shape alone or packed with others, so its output is batch-invariant bit for bit
    # (SDPA's CPU kernels block by the padded length: length groups padded to their longest
    # member, as the matmul backend uses, moved values by ~1e-6 here).
    lens = cu[1:] - cu[:-1]  # [B]
    band = (lens - 1).clamp(min=0) // _BUCKET  # [B]
    bands = band[lens > 0].unique().tolist()
    if not bands:
        return torch.empty_like(q)
    if len(bands) == 1 and bool((lens > 0).all()):
        return _sdpa_padded(q, k, v, cu, (bands[0] + 1) * _BUCKET, **kw)
    seq, _ = segments(cu, q.shape[0])  # [T] sequence of each token
    out = torch.empty_like(q)
    for b in bands:
        chosen = (band == b) & (lens > 0)  # [B]
        tok = (chosen[seq]).nonzero().squeeze(1)  # [t] packed rows of this band, in order
        sub_cu = F.pad(lens[chosen].cumsum(0), (1, 0))  # [n+1]
        out[tok] = _sdpa_padded(q[tok], k[tok], v[tok], sub_cu, (b + 1) * _BUCKET, **kw)  # [t, H, D]
    return out


def _matmul(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale, plan=None) -> Tensor:
    # CPU: per length group, scores q k^T in fp32 (bf16 inputs are upcast), masked, fp32 softmax,
    # then P V in fp32, cast to the input dtype. The CPU default until 2026-12-04, now `grouped` (SDPA per group of
    # one 16-token band: 1.24x bf16, 1.0x fp32 on an AMX Xeon; on an AVX2 EPYC in 2026-11 this backend was 4-5% ahead
    # of a per-band SDPA, docs/performance.md).
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else scale

    def attend(q4: Tensor, k4: Tensor, v4: Tensor, mask: Tensor | None) -> Tensor:  # [n, H, L, D] -> [n, H, L, D]
        n, H, L, _ = q4.shape
        step = max(1, _SCORE_BYTES // (H * L * L * 4))  # sequences per step: fp32 scores stay under _SCORE_BYTES
        outs = []
        for a in range(0, n, step):
            s = torch.matmul(q4[a:a + step].float() * scale, k4[a:a + step].float().transpose(2, 3))  # [s, H, L, L]
            if mask is not None:  # [n, 1, 1|L, L], or [L, L] (causal / window only) for every sequence
                s.masked_fill_(~(mask[a:a + step] if mask.dim() == 4 else mask), float("-inf"))
            # P V in fp32 too: a bf16 matmul goes to oneDNN, whose memory grows ~0.3 MiB per new shape it meets
            # (even with its primitive cache off), and groups make a new (n, L) in almost every batch
            outs.append(torch.matmul(torch.softmax(s, -1), v4[a:a + step].float()))  # [s, H, L, D] fp32
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # cast to q's dtype as _grouped places it

    plan = plan if plan is not None else plan_groups(cu_seqlens)  # a direct call: planned here
    return _grouped(q, k, v, plan, causal=causal, window=window, group_attention=attend)


# dtypes torch's CPU flash kernel takes as they are (fp32 accumulation inside); others are upcast to fp32
_SDPA_DTYPES = frozenset({torch.float32, torch.bfloat16})


def _grouped_sdpa(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale, plan=None) -> Tensor:
    # CPU: per length group, one SDPA call on [n, H, L, D] (torch's CPU flash kernel: scores, mask, softmax and P V in
    # one parallel region with fp32 accumulation, where `matmul` runs ~8 ops per score step, each a parallel region
    # on 2 shared cores), on groups of one 16-token length band (plan_groups band=SDPA_BAND). MiniLM on an AMX Xeon,
    # kernel-docs paragraphs, against `matmul`: bf16 1.24x, fp32 1.0x; min cos to s-t fp32 0.99992 bf16 as before
    # (docs/performance.md, 2026-12-04). bf16 goes in as it is: fp32 upcasts were ~3% slower at the same fidelity.
    # Its memory stays flat over thousands of (n, L) shapes: it runs no oneDNN primitive.
    def attend(q4: Tensor, k4: Tensor, v4: Tensor, mask: Tensor | None) -> Tensor:  # [n, H, L, D] -> [n, H, L, D]
        if q4.dtype not in _SDPA_DTYPES:
            q4, k4, v4 = q4.float(), k4.float(), v4.float()
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)  # mask: True = attend

    plan = plan if plan is not None else plan_groups(cu_seqlens, band=SDPA_BAND)  # a direct call: planned here
    return _grouped(q, k, v, plan, causal=causal, window=window, group_attention=attend)


def _grouped(q, k, v, plan: CpuPlan, *, causal: bool, window: int | None,
             group_attention: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]) -> Tensor:
    # CPU: sequences padded to their length group's length (the plan, made once per forward and passed to every
    # layer: the longest member, or the band's ceiling), attention per group on [n, H, L, D], gathered back to
    # [T, H, D]. GQA: each group's kv heads are repeated to H here, for every backend (SDPA's enable_gqa needs
    # torch >= 2.5).
    # Padding costs real flops on CPU, and so does every extra op: on 2 shared cores each op is a
    # parallel region that may wait for a descheduled thread. MiniLM, 8k-token batches of
    # kernel-docs paragraphs (bf16, per token per layer): 16-token bands recomputed per layer
    # 30 us wall; a per-sequence loop 3 us CPU on one thread but ~100 us wall on two under load;
    # length groups planned once per batch 18 us wall (same load), 2.7 us on a quiet machine.
    # rows past the packed tokens (a CPU runner's row padding, runtime/runners.py) are left out of the grid; their
    # output rows are zero
    rows, H, D = q.shape
    T = plan.slot.numel()  # [T] packed tokens
    if T == 0:
        return q.new_zeros(q.shape)

    def grid(x: Tensor) -> Tensor:  # [T, w] -> [grid rows, w], each group's sequences padded to its length
        # a gather (2.3x a scatter into an empty grid plus a zero fill of its padding rows, bf16 on an AMX Xeon);
        # padding rows copy a real row: finite, so masked scores and P V's zero weights hide them exactly
        return x.index_select(0, plan.source)

    fused = _fused_rows(q, k, v)  # [rows, (H + 2 Hkv) * D]: the q/k/v projection they are views of
    if fused is not None:  # one gather for all three
        g, Hkv = grid(fused), k.shape[1]
        gq, gk, gv = (g[:, a * D:b * D].view(plan.rows, -1, D) for a, b in ((0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv)))
    else:
        gq, gk, gv = (grid(x.reshape(rows, -1)).view(plan.rows, -1, D) for x in (q, k, v))  # [grid rows, h, D]
    out = q.new_empty(plan.rows, H, D)  # [grid rows, H, D] every group's output in its grid rows (padding unread)
    for row, n, L, key_ok in plan.groups:
        def view(g: Tensor) -> Tensor:  # this group's rows as [n, h, L, D]
            return g[row:row + n * L].view(n, L, -1, D).transpose(1, 2)

        mask = key_ok  # [n, 1, 1, L] or None (no padding in the group)
        allowed = _allowed(L, causal=causal, window=window, device=q.device)
        if allowed is not None:
            mask = allowed if mask is None else mask & allowed  # [n, 1, L, L]
        gk4, gv4 = view(gk), view(gv)  # [n, Hkv, L, D]
        if gk4.shape[1] != H:  # GQA: each kv head serves H / Hkv query heads
            gk4, gv4 = (x.repeat_interleave(H // x.shape[1], 1) for x in (gk4, gv4))  # [n, H, L, D]
        o = group_attention(view(gq), gk4, gv4, mask)  # [n, H, L, D], any float dtype
        view(out).copy_(o)  # one pass: transposed back into the grid and cast to q's dtype
    if rows == T:
        return out.index_select(0, plan.slot)  # [T, H, D]
    result = q.new_empty(rows, H, D)  # [rows, H, D]: gathered in place, the padding rows zeroed (no copy later)
    torch.index_select(out, 0, plan.slot, out=result[:T])
    result[T:].zero_()
    return result


def _fused_rows(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """The [T, (H + 2 Hkv) * D] tensor whose column blocks q, k and v are (a fused qkv
    projection viewed per head), or None when they are separate tensors."""
    T, H, D = q.shape
    width, es = (H + 2 * k.shape[1]) * D, q.element_size()
    views = all(x.stride() == (width, D, 1) and x.dtype == q.dtype and x.shape[0] == T for x in (q, k, v))
    if not (views and k.data_ptr() == q.data_ptr() + H * D * es and v.data_ptr() == k.data_ptr() + k.shape[1] * D * es):
        return None
    return q.as_strided((T, width), (width, 1))


@dataclass(frozen=True)
class CpuPlan:
    """Where each packed token sits in a grid of length groups: sequences sorted by length,
    a new group once the group holds _GROUP_TOKENS tokens (or, with a length band, at the band's edge), each group
    padded to its longest sequence (or to its band's ceiling)."""

    slot: Tensor  # [T] grid row of each packed token
    rows: int  # grid rows, sum of n * L over the groups
    source: Tensor  # [rows] packed row each grid row copies; the padding rows (no token's) copy token 0's
    groups: tuple[tuple[int, int, int, Tensor | None], ...]  # (first row, sequences n, length L, key mask)


# Small groups, small steps: each group's padding is its own sequences' spread, and each step's fp32 scores stay in a
# core's cache for the mask, softmax and P V passes. MiniLM on 2 cores of an AMX Xeon, kernel-docs paragraphs, against
# groups that ran on while lengths stayed within 85 % of the longest and 16 MiB steps: bf16 1.18x, fp32 1.06x
# (docs/performance.md, 2026-12-04); 1 MiB steps alone, bit-identical: bf16 1.05x, fp32 1.02x.
_GROUP_TOKENS = 512  # a length group closes once it holds this many tokens
# `grouped`: groups of one 16-token length band, padded to its ceiling. Batch invariance (see plan_groups), and
# speed: MiniLM bf16 on an AMX Xeon 1.14x over groups padded to their longest (torch's CPU flash kernel at L a
# multiple of 16); `matmul` padded that way ran 0.87x (docs/performance.md, 2026-12-04)
SDPA_BAND = 16
_SCORE_BYTES = 1 << 20  # matmul backend: fp32 score tensor per step (peak memory; 256-token sequences: 1 a step)


def plan_groups(cu_seqlens: Tensor, *, band: int = 1) -> CpuPlan:
    """The length-group plan of one packed batch. The model builds it once per forward
    (kernels.plan_attention) and hands it to every layer's attention call. ``band`` > 1: a group holds the
    sequences of one ``band``-token length band and is padded to the band's ceiling, so a sequence's padded
    length is a function of its own length, whatever else is in the batch (the `grouped` backend's SDPA blocks
    by the padded length: a batch-dependent one moved its values at fp32 rounding)."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]  # [B]
    order = torch.argsort(lens, descending=True, stable=True)  # [B] longest first
    sorted_lens = [n for n in lens[order].tolist() if n > 0]  # empty sequences (bucket padding) hold no rows
    if not sorted_lens:  # an empty pack
        return CpuPlan(slot=torch.zeros(0, dtype=torch.long), rows=0, source=torch.zeros(0, dtype=torch.long), groups=())
    ceiling = [-(-n // band) * band for n in sorted_lens]  # each sequence's padded length in a group of its band
    bounds, start, tokens = [], 0, 0
    for i, n in enumerate(sorted_lens):
        if i > start and (tokens >= _GROUP_TOKENS or (band > 1 and ceiling[i] != ceiling[start])):
            bounds.append((start, i))
            start, tokens = i, 0
        tokens += n
    bounds.append((start, len(sorted_lens)))
    first_row = torch.zeros(len(lens), dtype=torch.long)  # [B] grid row of each sequence's first token
    groups, row = [], 0
    for a, b in bounds:
        n, L = b - a, ceiling[a]
        first_row[order[a:b]] = row + torch.arange(n) * L
        key_ok = None
        if sorted_lens[b - 1] != L:  # the shortest member (sorted: all others are at least as long)
            key_ok = (torch.arange(L)[None, :] < lens[order[a:b]][:, None])[:, None, None, :]  # [n, 1, 1, L]
        groups.append((row, n, L, key_ok))
        row += n * L
    seq, pos = segments(cu, int(cu[-1]))  # [T], [T]
    slot = first_row[seq] + pos  # [T]
    source = torch.zeros(row, dtype=torch.long).index_copy_(0, slot, torch.arange(slot.numel()))  # [rows]
    return CpuPlan(slot=slot, rows=row, source=source, groups=tuple(groups))
