"""Attention over packed variable-length sequences, one signature for every backend.

    q [T, H, D], k/v [T, Hkv, D], cu_seqlens int32 [B+1]  ->  out [T, H, D]

Sequence b owns tokens cu_seqlens[b]:cu_seqlens[b+1]; tokens never attend across sequences.
`causal` masks keys after the query; `window` (ModernBERT local layers) keeps keys with
|i - j| <= window (with `causal`, 0 <= i - j <= window). GQA: query head h reads kv head
h // (H // Hkv).

Backends (pick once at start-up with `select_backend`, force one in tests):
  reference  plain loop over sequences, fp32 math: the ground truth, slow
  sdpa       torch SDPA on a padded [B, H, Lmax, D] view built by index arithmetic (CPU and GPU)
  varlen     torch.nn.attention.varlen.varlen_attn (CUDA, torch >= 2.10, float16/bfloat16); its
             keywords differ per release (2.10: is_causal; 2.11: scale, window_size; 2.12+: also
             enable_gqa), read once from its signature
  flash      flash_attn.flash_attn_varlen_func (CUDA, float16/bfloat16, `pip install 'embedpipe[gpu]'`)

`varlen` and `flash` never read cu_seqlens on the host and take max_seqlen as a Python int, so
they run inside CUDA graphs (the runner passes a static max_seqlen per bucket). "auto" picks
flash, then varlen, then SDPA, and SDPA whenever the model is float32.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
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


_BUCKET = 16  # CPU: sequences whose lengths fall in the same 16-token band share one SDPA call


def _sdpa(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale) -> Tensor:
    # Only attention sees padding; the dense layers stay packed. On CUDA: one padded call
    # (no host sync, the GPU has flops to spare). On CPU padding costs real flops: for 128
    # sequences of 10..256 tokens (H=12, D=32, fp32, 2 cores) one padded call took 148 ms,
    # 16-token length bands 55 ms, a per-sequence SDPA loop 67 ms. So: one padded call per
    # band, a loop over <= Lmax/16 bands, never over sequences.
    cu = cu_seqlens.long()
    kw = dict(causal=causal, window=window, scale=scale)
    if q.is_cuda:
        return _sdpa_padded(q, k, v, cu, max_seqlen, **kw)
    # Every band pads to its ceiling, whatever else is in the batch: a sequence then meets the
    # same SDPA shape alone or packed with others, so its output is batch-invariant bit for bit.
    lens = cu[1:] - cu[:-1]  # [B]
    band = (lens - 1).clamp(min=0) // _BUCKET  # [B]
    bands = band.unique().tolist()
    if len(bands) == 1:
        return _sdpa_padded(q, k, v, cu, (bands[0] + 1) * _BUCKET, **kw)
    seq, _ = _segments(cu, q.shape[0])  # [T] sequence of each token
    out = torch.empty_like(q)
    for b in bands:
        chosen = band == b  # [B]
        tok = (chosen[seq]).nonzero().squeeze(1)  # [t] packed rows of this band, in order
        sub_cu = F.pad(lens[chosen].cumsum(0), (1, 0))  # [n+1]
        out[tok] = _sdpa_padded(q[tok], k[tok], v[tok], sub_cu, (b + 1) * _BUCKET, **kw)  # [t, H, D]
    return out


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
    "varlen": _varlen,
    "flash": _flash,
}


def _cuda() -> bool:
    return torch.cuda.is_available()


# Which backends can run on a device kind; checked lazily (nothing GPU-only is imported).
_AVAILABLE: dict[str, Callable[[bool], bool]] = {
    "reference": lambda on_cuda: True,
    "sdpa": lambda on_cuda: True,
    "varlen": lambda on_cuda: on_cuda and _cuda() and importlib.util.find_spec("torch.nn.attention.varlen") is not None,
    "flash": lambda on_cuda: on_cuda and _cuda() and importlib.util.find_spec("flash_attn") is not None,
}
_AUTO_ORDER = ("flash", "varlen", "sdpa")  # best first
_HALF_ONLY = frozenset({"flash", "varlen"})  # flash kernels: float16 / bfloat16 only
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
        choice = next(name for name in _AUTO_ORDER if name in available)
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
