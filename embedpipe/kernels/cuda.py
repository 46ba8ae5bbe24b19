"""CUDA attention backends: torch's varlen_attn and flash-attn's varlen kernel (float16 / bfloat16).

Their GPU-only imports happen inside the calls, so this module imports anywhere; the keyword
logic (`_varlen_kwargs`, `_window_size`) is plain Python, tested on CPU. Neither reads cu_seqlens
on the host, so both run inside CUDA graphs. Signature and semantics: embedpipe/kernels/attention.py.

Availability is proven, not assumed: `flash_problem` imports flash-attn (a wheel built for another
torch or CUDA fails here, with an ImportError or an undefined symbol) and `varlen_problem` finds
torch's varlen_attn, and each runs one tiny call on the CUDA device when there is one (a kernel
missing for this GPU fails here); each returns None or the one-line reason, once per process.
"""

from __future__ import annotations

import functools
import importlib.util
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


def probe_device() -> str | None:
    """Where the backends' one-call probes run: the CUDA device; None without one (nothing is called)."""
    return "cuda" if torch.cuda.is_available() else None


def _probe(fn, device: str) -> None:
    """One tiny packed call (2 sequences of 3 and 1 tokens, 2 heads of 64, bfloat16) on `device`."""
    q = torch.randn(4, 2, 64, device=device).to(torch.bfloat16)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
    out = fn(q, q, q, cu_seqlens=cu, max_seqlen=3, causal=False, window=None, scale=None)
    if tuple(out.shape) != (4, 2, 64) or not bool(torch.isfinite(out.float()).all()):
        raise RuntimeError(f"probe gave {tuple(out.shape)} {out.dtype}, finite={bool(torch.isfinite(out.float()).all())}")


@functools.cache
def flash_problem(device: str | None) -> str | None:
    """None when flash-attn imports (and, with a device, runs one tiny call there); else why not."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install 'embedpipe[gpu]')"
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, OSError (undefined symbol), RuntimeError: all mean "broken"
        return f"flash-attn is installed but does not import: {type(e).__name__}: {_line(e)}"
    if device is not None:
        try:
            _probe(_flash, device)
        except Exception as e:  # noqa: BLE001
            return f"flash-attn imports but its kernel fails on {device}: {type(e).__name__}: {_line(e)}"
    return None


@functools.cache
def varlen_problem(device: str | None) -> str | None:
    """None when torch has varlen_attn (and, with a device, it runs one tiny call there); else why not."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.10)"
    if device is not None:
        try:
            _probe(_varlen, device)
        except Exception as e:  # noqa: BLE001
            return f"torch's varlen_attn fails on {device}: {type(e).__name__}: {_line(e)}"
    return None


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]

