"""Every attention backend against the reference on packed varlen input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embedpipe.kernels import BACKENDS, attention, available_backends, select_backend

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
MIXED = (1, 3, 17, 40, 64, 5, 33)  # spans several 16-token bands: the CPU sdpa band loop
NARROW = (20, 25, 30, 31)  # one band: the single padded call
CASES = {  # name: (H, Hkv, causal, window, scale)
    "mha": (4, 4, False, None, None),
    "gqa": (4, 2, False, None, None),
    "gqa-causal": (4, 2, True, None, None),
    "window": (4, 4, False, 3, None),
    "gqa-causal-window": (4, 2, True, 5, None),
    "scale": (4, 1, False, None, 0.3),
}


def packed_qkv(lengths, H, Hkv, *, D=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, H, D, generator=g) * 2  # * 2: peaky softmax, so masking errors show
    k = torch.randn(T, Hkv, D, generator=g) * 2
    v = torch.randn(T, Hkv, D, generator=g)
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return *(x.to(device, dtype) for x in (q, k, v)), cu.to(device), max(lengths)


def dense_masked(q, k, v, cu, *, causal, window, scale):
    """Independent check of the reference: one [T, T] attention with a block-diagonal mask."""
    T, H, D = q.shape
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())  # [T]
    pos = torch.arange(T) - cu.long()[seq]
    ok = seq[:, None] == seq[None, :]  # [T, T]
    d = pos[:, None] - pos[None, :]
    if causal:
        ok &= d >= 0
    if window is not None:
        ok &= d.abs() <= window
    k, v = (x.repeat_interleave(H // x.shape[1], 1) for x in (k, v))
    s = torch.einsum("thd,shd->hts", q, k) * (D**-0.5 if scale is None else scale)  # [H, T, T]
    return torch.einsum("hts,shd->thd", s.masked_fill(~ok, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_dense_block_mask(case):
    H, Hkv, causal, window, scale = CASES[case]
    q, k, v, cu, max_len = packed_qkv(MIXED, H, Hkv)
    out = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, causal=causal, window=window, scale=scale,
                    backend="reference")
    torch.testing.assert_close(out, dense_masked(q, k, v, cu, causal=causal, window=window, scale=scale),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths", [MIXED, NARROW], ids=["mixed", "narrow"])
@pytest.mark.parametrize("case", CASES)
def test_backends_match_reference(device, lengths, case):
    H, Hkv, causal, window, scale = CASES[case]
    kw = dict(causal=causal, window=window, scale=scale)
    for backend in available_backends(device=device):
        dtypes = [torch.float32] if device == "cpu" and backend == "reference" else [torch.float32, torch.bfloat16]
        if backend in ("varlen", "flash"):
            dtypes = [torch.bfloat16]  # flash kernels are half precision only
        for dtype in dtypes:
            q, k, v, cu, max_len = packed_qkv(lengths, H, Hkv, dtype=dtype, device=device)
            ref = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="reference", **kw)
            out = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend=backend, **kw)
            assert out.shape == q.shape and out.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=f"{backend} {dtype}")


def test_backend_registry_and_cpu_selection():
    assert set(BACKENDS) == {"reference", "sdpa", "grouped", "matmul", "varlen", "flash"}
    assert select_backend(device="cpu") == "grouped"
    assert select_backend(device="cpu", requested="reference") == "reference"
    for gpu_only in ("flash", "varlen"):
        with pytest.raises(ValueError, match=r"not available on device 'cpu'.*'reference', 'sdpa', 'grouped', 'matmul'"):
            select_backend(device="cpu", requested=gpu_only)
    with pytest.raises(ValueError, match=r"embedpipe\[gpu\]"):
        select_backend(device="cpu", requested="flash")
    with pytest.raises(ValueError, match=r"unknown attention backend 'xformers'.*'sdpa'"):
        select_backend(device="cpu", requested="xformers")
    q, k, v, cu, max_len = packed_qkv(NARROW, 2, 2)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="xformers")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_prefers_fused_kernels():
    assert select_backend(device="cuda") in {"flash", "varlen"}
