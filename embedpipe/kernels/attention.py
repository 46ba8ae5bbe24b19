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
  grouped    CPU: length groups of one 16-token band planned once per forward (`plan_attention`),
             one SDPA call per group (torch's CPU flash kernel, fp32 accumulation; the CPU default)
  matmul     CPU: length groups padded to their longest, fp32 scores by matmul, fp32 softmax
  varlen     torch.nn.attention.varlen.varlen_attn (CUDA, torch >= 2.10, float16/bfloat16); its
             keywords differ per release (2.10: is_causal; 2.11: scale, window_size; 2.12+: also
             enable_gqa), read once from its signature
  flash      flash_attn.flash_attn_varlen_func (CUDA, float16/bfloat16, `pip install 'embedpipe[gpu]'`)

Modules: this one holds the signature, the backend table and the choice of backend; the backends
live in kernels/cpu.py (reference, sdpa, matmul: torch ops) and kernels/cuda.py (varlen, flash).
A model builds a batch's plan once per forward, `plan = plan_attention(cu_seqlens, backend=...)`,
and passes it to every layer's `attention(..., plan=plan)` (None for backends that plan nothing).

`varlen` and `flash` never read cu_seqlens on the host and take max_seqlen as a Python int, so
they run inside CUDA graphs (the runner passes a static max_seqlen per bucket). "auto" picks
flash, then varlen, then SDPA on CUDA (SDPA whenever the model is float32); grouped on CPU.
flash counts as available only when flash-attn imports and its kernel runs one tiny call on the
GPU, varlen only when torch's does (kernels/cuda.py `flash_problem`, `varlen_problem`); the
choice is logged once with the reason each better backend was passed over.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch
from torch import Tensor

from embedpipe.kernels.cpu import (
    SDPA_BAND, CpuPlan, _fused_rows, _grouped_sdpa, _matmul, _reference, _sdpa, plan_groups,
)
from embedpipe.kernels.cuda import (
    _flash, _varlen, _varlen_kwargs, _varlen_params, _window_size, flash_problem, probe_device, varlen_problem,
)

logger = logging.getLogger(__name__)

# re-exported: callers and tests name them here
__all__ = ["BACKENDS", "PADDED_ROWS", "PLANNERS", "CpuPlan", "attention", "available_backends", "plan_attention",
           "plan_groups", "select_backend", "_fused_rows", "_varlen_kwargs", "_varlen_params", "_window_size"]

# every backend: fn(q, k, v, *, cu_seqlens, max_seqlen, causal, window, scale, plan) -> [T, H, D]
BACKENDS: dict[str, Callable[..., Tensor]] = {
    "reference": _reference,
    "sdpa": _sdpa,
    "grouped": _grouped_sdpa,
    "matmul": _matmul,
    "varlen": _varlen,
    "flash": _flash,
}
# backends that work something out once per batch from cu_seqlens alone: backend -> planner
PLANNERS: dict[str, Callable[[Tensor], Any]] = {"grouped": functools.partial(plan_groups, band=SDPA_BAND),
                                                "matmul": plan_groups}
# backends whose q/k/v may carry rows past cu_seqlens[-1] (a CPU runner's row padding: runtime/runners.py); their
# output there is zero and no real row reads them
PADDED_ROWS: frozenset[str] = frozenset({"grouped", "matmul"})


def plan_attention(cu_seqlens: Tensor, *, backend: str) -> Any:
    """What `backend` plans once per packed batch (grouped, matmul: the CPU length groups), for every layer's
    attention call of one forward; None for a backend that plans nothing."""
    planner = PLANNERS.get(backend)
    return None if planner is None else planner(cu_seqlens)


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
    plan: Any = None,
) -> Tensor:
    """Packed varlen attention. q [T, H, D], k/v [T, Hkv, D], cu_seqlens int32 [B+1] -> [T, H, D].

    ``plan``: this batch's ``plan_attention(cu_seqlens, backend=backend)``, built once per forward;
    None plans here (a single call)."""
    fn = BACKENDS.get(backend)
    if fn is None:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(BACKENDS)}")
    return fn(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, causal=causal, window=window, scale=scale,
              plan=plan)


def _cuda() -> bool:
    return torch.cuda.is_available()


# Which backends can run on a device kind; checked lazily (nothing GPU-only is imported before this).
_PROBLEMS: dict[str, Callable[[str | None], str | None]] = {
    "varlen": lambda device: varlen_problem(device),
    "flash": lambda device: flash_problem(device),
}
_AVAILABLE: dict[str, Callable[[bool], bool]] = {
    "reference": lambda on_cuda: True,
    "sdpa": lambda on_cuda: True,
    "grouped": lambda on_cuda: not on_cuda,
    "matmul": lambda on_cuda: not on_cuda,
    "varlen": lambda on_cuda: on_cuda and _cuda() and _PROBLEMS["varlen"](probe_device()) is None,
    "flash": lambda on_cuda: on_cuda and _cuda() and _PROBLEMS["flash"](probe_device()) is None,
}
_AUTO_ORDER = ("flash", "varlen", "sdpa")  # best first
_HALF_ONLY = frozenset({"flash", "varlen"})  # flash kernels: float16 / bfloat16 only
_CPU_AUTO_ORDER = ("grouped", "matmul", "sdpa")
_logged: set[tuple[str, str, str]] = set()


def available_backends(*, device: str, dtype: torch.dtype | None = None) -> list[str]:
    """Backends that run on `device` (and on `dtype`, when given)."""
    on_cuda = torch.device(device).type == "cuda"
    half = dtype is None or dtype in (torch.float16, torch.bfloat16)
    return [name for name in BACKENDS if _AVAILABLE[name](on_cuda) and (half or name not in _HALF_ONLY)]


def select_backend(*, device: str, requested: str = "auto", dtype: torch.dtype | None = None) -> str:
    """Resolve "auto" or check a named backend against `device` and `dtype`; logs the choice once."""
    available = available_backends(device=device, dtype=dtype)
    passed_over = ""
    if requested == "auto":
        order = _AUTO_ORDER if torch.device(device).type == "cuda" else _CPU_AUTO_ORDER
        choice = next(name for name in order if name in available)
        passed_over = _passed_over(order[:order.index(choice)], device=device, dtype=dtype)
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
        if requested in _PROBLEMS and torch.device(device).type == "cuda" and _cuda():
            hint = f" ({_PROBLEMS[requested](probe_device())})"
        raise ValueError(
            f"attention backend {requested!r} is not available on device {device!r}{hint}; "
            f"available here: {available}, or use 'auto'"
        )
    else:
        choice = requested
    key = (device, requested, f"{choice} {dtype}")
    if key not in _logged:
        _logged.add(key)
        broken = "does not import" in passed_over or "fails on" in passed_over  # installed, yet not usable here
        logger.log(logging.WARNING if broken else logging.INFO, "attention backend: %s (requested %s, device %s, "
                   "dtype %s)%s", choice, requested, device, dtype, passed_over)
    return choice


def _passed_over(names: tuple[str, ...], *, device: str, dtype: torch.dtype | None) -> str:
    """Why each backend before the choice in the auto order was not taken ("" when none was)."""
    reasons = []
    for name in names:
        if name in _HALF_ONLY and dtype not in (None, torch.float16, torch.bfloat16):
            reasons.append(f"{name}: float16/bfloat16 only")
        elif name in _PROBLEMS and _cuda():
            reasons.append(f"{name}: {_PROBLEMS[name](probe_device())}")
        else:
            reasons.append(f"{name}: needs CUDA")
    return "; passed over " + "; ".join(reasons) if reasons else ""
