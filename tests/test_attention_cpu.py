"""The CPU backends (sdpa, matmul): length groups planned once per batch, against the reference."""

from __future__ import annotations

import pytest
import torch

from embedpipe.kernels import attention
from embedpipe.kernels.attention import _cpu_plan
from tests.test_kernels import CASES, packed_qkv

# Unsorted, with long and short sequences and > 1024 tokens per group: several groups.
LENGTHS = (256, 7, 250, 3, 180, 120, 1, 64, 90, 256, 40, 33, 200, 17, 150, 60, 9, 128, 77, 230) * 2


def test_plan_groups_cover_every_token_once():
    cu = torch.nn.functional.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32)
    plan = _cpu_plan(cu)
    assert len(plan.groups) >= 3
    assert plan.slot.unique().numel() == sum(LENGTHS) and int(plan.slot.max()) < plan.rows
    assert sum(n for _, n, _, _ in plan.groups) == len(LENGTHS)
    lengths = [L for _, _, L, _ in plan.groups]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 256
    assert _cpu_plan(cu) is plan  # the layers of one batch share the plan
    assert _cpu_plan(cu.clone()) is not plan  # another batch gets its own
    cu2 = cu.clone()
    first = _cpu_plan(cu2)
    cu2[1:] += 0  # an in-place write bumps the version: planned again
    assert _cpu_plan(cu2) is not first


@pytest.mark.parametrize("backend", ["sdpa", "matmul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_grouped_cpu_backends_match_reference(case, dtype, backend):
    H, Hkv, causal, window, scale = CASES[case]
    kw = dict(causal=causal, window=window, scale=scale)
    q, k, v, cu, max_len = packed_qkv(LENGTHS, H, Hkv, dtype=dtype)
    ref = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="reference", **kw)
    out = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend=backend, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["sdpa", "matmul"])
def test_empty_pack(backend):
    q = torch.zeros(0, 2, 8)
    out = attention(q, q, q, cu_seqlens=torch.zeros(1, dtype=torch.int32), max_seqlen=0, backend=backend)
    assert out.shape == (0, 2, 8)


@pytest.mark.parametrize("backend", ["sdpa", "matmul"])
def test_empty_sequences_of_bucket_padding_are_left_out(backend):
    """Token buckets end a batch with empty sequences (cu_seqlens repeating its last value)."""
    q, k, v, cu, max_len = packed_qkv((5, 3, 9), 2, 2)
    padded = torch.cat([cu, cu[-1:].repeat(3)])  # [B + 1 + 3]: three empty trailing sequences
    want = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="reference")
    got = attention(q, k, v, cu_seqlens=padded, max_seqlen=max_len, backend=backend)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 2)])
def test_views_of_one_qkv_projection_take_the_fused_path(H, Hkv):
    from embedpipe.kernels.attention import _fused_rows

    D, T = 16, sum(LENGTHS)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=torch.Generator().manual_seed(0)) * 2
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    assert _fused_rows(q, k, v) is not None and _fused_rows(q.clone(), k, v) is None
    _, _, _, cu, max_len = packed_qkv(LENGTHS, H, Hkv)
    ref = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="reference")
    for backend in ("sdpa", "matmul"):
        out = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend=backend)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["mha", "gqa-causal-window", "window"])
def test_matmul_backend_in_small_score_steps(case, monkeypatch):
    import importlib

    monkeypatch.setattr(importlib.import_module("embedpipe.kernels.attention"), "_SCORE_BYTES", 4096)
    H, Hkv, causal, window, scale = CASES[case]
    kw = dict(causal=causal, window=window, scale=scale)
    q, k, v, cu, max_len = packed_qkv(LENGTHS, H, Hkv)
    ref = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="reference", **kw)
    out = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="matmul", **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
