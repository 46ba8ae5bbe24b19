"""Process settings and matmul choice for an encoder replica on CPU.

glibc malloc hands blocks above its mmap threshold (128 KiB, adapting up to 32 MiB) to the
kernel on free and maps fresh zeroed pages on the next allocation, so every encoder step
page-faults its activations back in: an 8192-token MiniLM step allocates [8192, 1536] float32
(48 MiB) several times per layer. Measured (all-MiniLM-L6-v2, 1,000 kernel-docs paragraphs,
8192-token steps): ~600k minor faults, and 7% more fp32 tokens per CPU-second without them
(3,949 -> 4,209 on one thread); on two threads bf16 8192-token steps were slower than 4096-token
ones with the faults and faster without. Keeping freed memory in the heap removes them; the
process then holds its peak memory until it exits, which suits a dedicated embedding worker.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h> mallopt parameters
_applied: list[bool] = []


def keep_freed_memory(*, limit_bytes: int = 1 << 30) -> bool:
    """Serve blocks up to ``limit_bytes`` from the malloc heap and never trim it (glibc only;
    a no-op elsewhere). Idempotent; returns whether the settings are in effect."""
    if _applied:
        return _applied[0]
    ok = False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator alone
        mallopt = None
    if mallopt is not None:
        ok = bool(mallopt(M_MMAP_THRESHOLD, limit_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, limit_bytes))
    log.info("CPU allocator: freed blocks up to %d MiB stay in the heap: %s", limit_bytes >> 20, ok)
    _applied.append(ok)
    return ok


class OneDNNLinear(nn.Module):
    """An nn.Linear computed by oneDNN (torch's mkldnn linear op) instead of MKL's sgemm.

    torch sends float32 matmuls to MKL, which on AMD CPUs runs its AVX2 code; oneDNN uses
    AVX-512 there. Measured on 2 Zen 5 cores, MiniLM shapes ([8192, 384] x [384, 1536] and
    [8192, 1536] x [1536, 384]): MKL 170-218 GFLOP/s, oneDNN 287-490 GFLOP/s. The parameters
    are shared with the module it replaces; results differ by float32 summation order only.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # [out, in], [out] or None

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")  # [N, out]
        return out.view(*x.shape[:-1], out.shape[-1])


ONEDNN_DTYPES = (torch.float32, torch.bfloat16)  # float16 has no fast path on these CPUs: left to torch


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every float32 / bfloat16 nn.Linear under ``model`` for a OneDNNLinear when torch has the op and it
    agrees with F.linear on a probe; returns how many were swapped (0: left as it was)."""
    if not _onednn_linear_works():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype in ONEDNN_DTYPES and child.weight.device.type == "cpu":
                setattr(parent, name, OneDNNLinear(child))
                swapped += 1
    log.info("CPU matmuls through oneDNN: %d linear layers", swapped)
    return swapped


@functools.cache
def _onednn_linear_works() -> bool:
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if op is None:
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(64, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    try:
        got = op(x, w, b, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.allclose(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4))
