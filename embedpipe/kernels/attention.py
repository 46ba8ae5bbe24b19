"""Attention over packed variable-length sequences, one signature for every backend.

    q [T, H, D], k/v [T, Hkv, D], cu_seqlens int32 [B+1]  ->  out [T, H, D]

Sequence b owns tokens cu_seqlens[b]:cu_seqlens[b+1]; tokens never attend across sequences.
`causal` masks keys after the query; `window` (ModernBERT local layers) keeps keys with
|i - j| <= window (with `causal`, 0 <= i - j <= window). GQA: query head h reads kv head
h // (H // Hkv).

Backends (pick once at start-up with `select_backend`, force one in tests):
  reference  plain loop over sequences, fp32 math: the ground truth, slow
  sdpa       torch SDPA on a padded [B, H, Lmax, D] view built by index arithmetic (CPU and GPU;
             on CPU one call per 16-token length band)
  matmul     CPU: length groups planned once per batch (see _grouped), fp32 scores by matmul,
             fp32 softmax (the CPU default)
  varlen     torch.nn.attention.varlen.varlen_attn (CUDA, torch >= 2.10, float16/bfloat16); its
             keywords differ per release (2.10: is_causal; 2.11: scale, window_size; 2.12+: also
             enable_gqa), read once from its signature
  flash      flash_attn.flash_attn_varlen_func (CUDA, float16/bfloat16, `pip install 'embedpipe[gpu]'`)

`varlen` and `flash` never read cu_seqlens on the host and take max_seqlen as a Python int, so
they run inside CUDA graphs (the runner passes a static max_seqlen per bucket). "auto" picks
flash, then varlen, then SDPA on CUDA (SDPA whenever the model is float32); matmul, then SDPA on CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    backend: str = "sdpa",
) -> Tensor:
    """Packed varlen attention. q [T, H, D], k/v [T, Hkv, D], cu_seqlens int32 [B+1] -> [T, H, D]."""
    fn = BACKENDS.get(backend)
    if fn is None:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(BACKENDS)}")
    return fn(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, causal=causal, window=window, scale=scale)


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


def _reference(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale) -> Tensor:
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


def _segments(cu: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """For each of `total` packed tokens: its sequence index and position within it ([total], [total])."""
    n = cu.numel() - 1
    seq = torch.repeat_interleave(torch.arange(n, device=cu.device), cu[1:] - cu[:-1], output_size=total)
    return seq, torch.arange(total, device=cu.device) - cu[seq]


def _sdpa_padded(q, k, v, cu: Tensor, max_seqlen: int, *, causal, window, scale) -> Tensor:
    # Scatter the packed tokens into a padded [B, Lmax] grid, run one SDPA call with a
    # key-padding mask, gather back. No host sync: B and Lmax are known without reading cu.
    T, H, D = q.shape
    B, L, dev = cu.numel() - 1, max_seqlen, q.device
    seq, pos = _segments(cu, T)  # [T], [T]
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


def _sdpa(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale) -> Tensor:
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
    seq, _ = _segments(cu, q.shape[0])  # [T] sequence of each token
    out = torch.empty_like(q)
    for b in bands:
        chosen = (band == b) & (lens > 0)  # [B]
        tok = (chosen[seq]).nonzero().squeeze(1)  # [t] packed rows of this band, in order
        sub_cu = F.pad(lens[chosen].cumsum(0), (1, 0))  # [n+1]
        out[tok] = _sdpa_padded(q[tok], k[tok], v[tok], sub_cu, (b + 1) * _BUCKET, **kw)  # [t, H, D]
    return out


def _matmul(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale) -> Tensor:
    # CPU: per length group, scores q k^T in fp32 (bf16 inputs are upcast), masked, fp32 softmax,
    # then P V in the input dtype. MiniLM on 2 cores, kernel-docs paragraphs, whole model: +4%
    # tokens/s over the per-group SDPA in fp32, +5% in bf16 (torch's CPU flash kernel is slow
    # at head_dim 32), with the same fidelity (cos to fp32 sentence-transformers: min 0.99992).
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else scale

    def attend(q4: Tensor, k4: Tensor, v4: Tensor, mask: Tensor | None) -> Tensor:  # [n, h, L, D] -> [n, H, L, D]
        n, H, L, _ = q4.shape
        if k4.shape[1] != H:  # GQA: each kv head serves H / Hkv query heads
            k4, v4 = (x.repeat_interleave(H // x.shape[1], 1) for x in (k4, v4))
        step = max(1, _SCORE_BYTES // (H * L * L * 4))  # sequences per step: fp32 scores stay under _SCORE_BYTES
        outs = []
        for a in range(0, n, step):
            s = torch.matmul(q4[a:a + step].float() * scale, k4[a:a + step].float().transpose(2, 3))  # [s, H, L, L]
            if mask is not None:  # [n, 1, 1|L, L], or [L, L] (causal / window only) for every sequence
                s.masked_fill_(~(mask[a:a + step] if mask.dim() == 4 else mask), float("-inf"))
            outs.append(torch.matmul(torch.softmax(s, -1).to(v4.dtype), v4[a:a + step]))  # [s, H, L, D]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    return _grouped(q, k, v, cu_seqlens, causal=causal, window=window, group_attention=attend)


def _grouped(q, k, v, cu_seqlens: Tensor, *, causal: bool, window: int | None,
             group_attention: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]) -> Tensor:
    # CPU: sequences padded to the longest of their length group (the plan, made once per batch
    # and shared by the layers), attention per group on [n, H, L, D], gathered back to [T, H, D].
    # Padding costs real flops on CPU, and so does every extra op: on 2 shared cores each op is a
    # parallel region that may wait for a descheduled thread. MiniLM, 8k-token batches of
    # kernel-docs paragraphs (bf16, per token per layer): 16-token bands recomputed per layer
    # 30 us wall; a per-sequence loop 3 us CPU on one thread but ~100 us wall on two under load;
    # length groups planned once per batch 18 us wall (same load), 2.7 us on a quiet machine.
    T, H, D = q.shape
    if T == 0:
        return torch.empty_like(q)
    plan = _cpu_plan(cu_seqlens)

    def grid(x: Tensor) -> Tensor:  # [T, w] -> [rows, w], each group's sequences padded to its length
        return x.new_zeros(plan.rows, x.shape[1]).index_copy_(0, plan.slot, x)

    fused = _fused_rows(q, k, v)  # [T, (H + 2 Hkv) * D]: the q/k/v projection they are views of
    if fused is not None:  # one scatter for all three
        g, Hkv = grid(fused), k.shape[1]
        gq, gk, gv = (g[:, a * D:b * D].view(plan.rows, -1, D) for a, b in ((0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv)))
    else:
        gq, gk, gv = (grid(x.reshape(T, -1)).view(plan.rows, -1, D) for x in (q, k, v))  # [rows, h, D]
    outs = []
    for row, n, L, key_ok in plan.groups:
        def view(g: Tensor) -> Tensor:  # this group's rows as [n, h, L, D]
            return g[row:row + n * L].view(n, L, -1, D).transpose(1, 2)

        mask = key_ok  # [n, 1, 1, L] or None (no padding in the group)
        allowed = _allowed(L, causal=causal, window=window, device=q.device)
        if allowed is not None:
            mask = allowed if mask is None else mask & allowed  # [n, 1, L, L]
        o = group_attention(view(gq), view(gk), view(gv), mask)  # [n, H, L, D]
        outs.append(o.transpose(1, 2).reshape(n * L, H, D))
    return torch.cat(outs)[plan.slot]  # [T, H, D]


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
class _CpuPlan:
    """Where each packed token sits in a grid of length groups: sequences sorted by length,
    a new group when the length falls to _GROUP_RATIO of the group's longest and the group
    already holds _GROUP_TOKENS tokens, each group padded to its longest sequence."""

    slot: Tensor  # [T] grid row of each packed token
    rows: int  # grid rows, sum of n * L over the groups
    groups: tuple[tuple[int, int, int, Tensor | None], ...]  # (first row, sequences n, length L, key mask)


_GROUP_RATIO, _GROUP_TOKENS = 0.85, 512
_SCORE_BYTES = 16 << 20  # matmul backend: fp32 score tensor per step (peak memory; 256-token sequences: 5 a step)
_last_plan: tuple[Tensor, int, _CpuPlan] | None = None  # (cu_seqlens, its version, plan): every layer of a batch shares it


def _cpu_plan(cu_seqlens: Tensor) -> _CpuPlan:
    global _last_plan
    cached = _last_plan
    if cached is not None and cached[0] is cu_seqlens and cached[1] == cu_seqlens._version:
        return cached[2]
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]  # [B]
    order = torch.argsort(lens, descending=True, stable=True)  # [B] longest first
    sorted_lens = [n for n in lens[order].tolist() if n > 0]  # empty sequences (bucket padding) hold no rows
    bounds, start, tokens = [], 0, 0
    for i, n in enumerate(sorted_lens):
        if i > start and n <= _GROUP_RATIO * sorted_lens[start] and tokens >= _GROUP_TOKENS:
            bounds.append((start, i))
            start, tokens = i, 0
        tokens += n
    bounds.append((start, len(sorted_lens)))
    first_row = torch.zeros(len(lens), dtype=torch.long)  # [B] grid row of each sequence's first token
    groups, row = [], 0
    for a, b in bounds:
        n, L = b - a, sorted_lens[a]
        first_row[order[a:b]] = row + torch.arange(n) * L
        key_ok = None
        if sorted_lens[b - 1] != L:
            key_ok = (torch.arange(L)[None, :] < lens[order[a:b]][:, None])[:, None, None, :]  # [n, 1, 1, L]
        groups.append((row, n, L, key_ok))
        row += n * L
    seq, pos = _segments(cu, int(cu[-1]))  # [T], [T]
    plan = _CpuPlan(slot=first_row[seq] + pos, rows=row, groups=tuple(groups))
    _last_plan = (cu_seqlens, cu_seqlens._version, plan)
    return plan


def _window_size(causal: bool, window: int | None) -> tuple[int, int]:
    """(left, right) as flash-attn counts it; -1 is unbounded."""
    left = -1 if window is None else window
    return (left, 0) if causal else (left, left)


@functools.cache
def _varlen_params() -> frozenset[str]:
    """Keyword names of the installed torch's varlen_attn (read once)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_kwargs(params: frozenset[str], *, causal: bool, window: int | None, scale: float | None,
                   gqa: bool) -> tuple[dict, float | None]:
    """varlen_attn's keywords for this torch, and a factor to fold into q where it has no `scale`.

    torch 2.10: `is_causal`, no scale, no window.  2.11: `scale`, `window_size` ((-1, 0) is
    causal), no `is_causal`.  2.12+: also `enable_gqa`, required when K/V have fewer heads
    (2.10/2.11 pass GQA straight to the flash kernel, which supports it natively).
    """
    kw: dict = {}
    if "window_size" in params:
        kw["window_size"] = _window_size(causal, window)  # a tuple: varlen_attn compares it to (-1, 0)
    elif window is not None:
        raise NotImplementedError(
            f"attention backend 'varlen' on torch {torch.__version__} has no sliding window (needs torch >= 2.11); "
            "use attention backend 'flash' or 'sdpa'")
    else:
        kw["is_causal"] = causal
    fold = None
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None:
        fold = scale
    if gqa and "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw, fold


def _varlen(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale) -> Tensor:
    # Flash-attention kernels inside torch: no host sync (cu_seqlens stays on the device,
    # max_seqlen is a Python int), so it runs under CUDA graphs.
    from torch.nn.attention.varlen import varlen_attn

    kw, fold = _varlen_kwargs(_varlen_params(), causal=causal, window=window, scale=scale,
                              gqa=k.shape[1] != q.shape[1])
    if fold is not None:  # torch 2.10: the kernel scales by D**-0.5; fold the rest into q
        q = q * (fold * q.shape[-1] ** 0.5)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)  # [T, H, D]


def _flash(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale) -> Tensor:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise ImportError(
            "attention backend 'flash' needs flash-attn: pip install 'embedpipe[gpu]' "
            "(or choose attention backend 'varlen' / 'sdpa')"
        ) from e
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    return flash_attn_varlen_func(
        q, k, v, cu, cu, max_seqlen, max_seqlen,
        softmax_scale=scale, causal=causal, window_size=_window_size(causal, window),
    )  # [T, H, D]; GQA is native


BACKENDS: dict[str, Callable[..., Tensor]] = {
    "reference": _reference,
    "sdpa": _sdpa,
    "matmul": _matmul,
    "varlen": _varlen,
    "flash": _flash,
}


def _cuda() -> bool:
    return torch.cuda.is_available()


# Which backends can run on a device kind; checked lazily (nothing GPU-only is imported).
_AVAILABLE: dict[str, Callable[[bool], bool]] = {
    "reference": lambda on_cuda: True,
    "sdpa": lambda on_cuda: True,
    "matmul": lambda on_cuda: not on_cuda,
    "varlen": lambda on_cuda: on_cuda and _cuda() and importlib.util.find_spec("torch.nn.attention.varlen") is not None,
    "flash": lambda on_cuda: on_cuda and _cuda() and importlib.util.find_spec("flash_attn") is not None,
}
_AUTO_ORDER = ("flash", "varlen", "sdpa")  # best first
_HALF_ONLY = frozenset({"flash", "varlen"})  # flash kernels: float16 / bfloat16 only
_CPU_AUTO_ORDER = ("matmul", "sdpa")
_logged: set[tuple[str, str, str]] = set()


def available_backends(*, device: str, dtype: torch.dtype | None = None) -> list[str]:
    """Backends that run on `device` (and on `dtype`, when given)."""
    on_cuda = torch.device(device).type == "cuda"
    half = dtype is None or dtype in (torch.float16, torch.bfloat16)
    return [name for name in BACKENDS if _AVAILABLE[name](on_cuda) and (half or name not in _HALF_ONLY)]


def select_backend(*, device: str, requested: str = "auto", dtype: torch.dtype | None = None) -> str:
    """Resolve "auto" or check a named backend against `device` and `dtype`; logs the choice once."""
    available = available_backends(device=device, dtype=dtype)
    if requested == "auto":
        order = _AUTO_ORDER if torch.device(device).type == "cuda" else _CPU_AUTO_ORDER
        choice = next(name for name in order if name in available)
    elif requested not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {requested!r}; choose 'auto' or one of {list(BACKENDS)} "
            f"(available on {device}: {available})"
        )
    elif requested not in available:
        if requested in _HALF_ONLY and requested in available_backends(device=device):
            raise ValueError(
                f"attention backend {requested!r} runs in float16/bfloat16 only, the model is {dtype}: "
                f"set model.dtype to bfloat16, or the attention backend to 'sdpa' or 'auto'"
            )
        hint = " (flash needs CUDA and `pip install 'embedpipe[gpu]'`)" if requested == "flash" else " (needs CUDA)"
        raise ValueError(
            f"attention backend {requested!r} is not available on device {device!r}{hint}; "
            f"available here: {available}, or use 'auto'"
        )
    else:
        choice = requested
    key = (device, requested, f"{choice} {dtype}")
    if key not in _logged:
        _logged.add(key)
        logger.info("attention backend: %s (requested %s, device %s, dtype %s)", choice, requested, device, dtype)
    return choice
