"""CUDA attention backends: torch's varlen_attn and flash-attn's varlen kernel (float16 / bfloat16).

Their GPU-only imports happen inside the calls, so this module imports anywhere; the keyword
logic (`_varlen_kwargs`, `_window_size`) is plain Python, tested on CPU. Neither reads cu_seqlens
on the host, so both run inside CUDA graphs. Signature and semantics: embedpipe/kernels/attention.py.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor


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


def _varlen(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale, plan=None) -> Tensor:
    # Flash-attention kernels inside torch: no host sync (cu_seqlens stays on the device,
    # max_seqlen is a Python int), so it runs under CUDA graphs.
    from torch.nn.attention.varlen import varlen_attn

    kw, fold = _varlen_kwargs(_varlen_params(), causal=causal, window=window, scale=scale,
                              gqa=k.shape[1] != q.shape[1])
    if fold is not None:  # torch 2.10: the kernel scales by D**-0.5; fold the rest into q
        q = q * (fold * q.shape[-1] ** 0.5)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)  # [T, H, D]


def _flash(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale, plan=None) -> Tensor:
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
