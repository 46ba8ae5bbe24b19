"""The CPU backends (sdpa, grouped, matmul): length groups planned once per forward, against the reference."""

from __future__ import annotations

import importlib

import pytest
import torch

from embedpipe.kernels import attention
from embedpipe.kernels.attention import plan_groups
from tests.test_kernels import CASES, packed_qkv

# Unsorted, with long and short sequences and > 1024 tokens per group: several groups.
LENGTHS = (256, 7, 250, 3, 180, 120, 1, 64, 90, 256, 40, 33, 200, 17, 150, 60, 9, 128, 77, 230) * 2


def test_plan_groups_cover_every_token_once():
    cu = torch.nn.functional.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32)
    plan = plan_groups(cu)
    assert len(plan.groups) >= 3
    assert plan.slot.unique().numel() == sum(LENGTHS) and int(plan.slot.max()) < plan.rows
    assert sum(n for _, n, _, _ in plan.groups) == len(LENGTHS)
    lengths = [L for _, _, L, _ in plan.groups]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 256
    assert all(n * L >= 512 for _, n, L, _ in plan.groups[:-1])  # a group closes at 512 tokens, whatever the lengths
    assert torch.equal(plan.source[plan.slot], torch.arange(sum(LENGTHS)))  # each token's grid row copies it
    padding = torch.ones(plan.rows, dtype=torch.bool).index_fill_(0, plan.slot, False)
    assert padding.sum() == plan.rows - sum(LENGTHS) and (plan.source[padding] == 0).all()  # padding: token 0's row


def test_banded_plan_pads_each_sequence_to_its_own_band():
    """plan_groups(band=16), the `grouped` backend's: a group holds one 16-token band and is padded to its ceiling, so
    a sequence's padded length is a function of its own length alone."""
    from embedpipe.kernels.attention import PLANNERS, SDPA_BAND

    cu = torch.nn.functional.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32)
    plan = PLANNERS["grouped"](cu)
    assert SDPA_BAND == 16 and sum(n for _, n, _, _ in plan.groups) == len(LENGTHS)
    for row, n, L, key_ok in plan.groups:
        members = sorted(x for x in LENGTHS if -(-x // 16) * 16 == L)
        assert L % 16 == 0 and 0 < n <= len(members)
        real = int(((plan.slot >= row) & (plan.slot < row + n * L)).sum())  # the group's tokens
        assert real > n * (L - 16) and (key_ok is None) == (real == n * L)
    assert torch.equal(plan.source[plan.slot], torch.arange(sum(LENGTHS)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_grouped_backend_is_batch_invariant_bit_for_bit(case, dtype):
    """A sequence's attention output is the same bits alone and packed among others of other lengths (SDPA's CPU
    kernel blocks by the padded length: with groups padded to their longest it moved at fp32 rounding)."""
    H, Hkv, causal, window, scale = CASES[case]
    kw = dict(causal=causal, window=window, scale=scale)
    q, k, v, cu, max_len = packed_qkv(LENGTHS, H, Hkv, dtype=dtype)
    whole = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="grouped", **kw)
    for i in (1, 4, 10):  # lengths 7, 180 and 40: groups of other sequences' lengths around them
        a, b = int(cu[i]), int(cu[i + 1])
        alone = attention(q[a:b], k[a:b], v[a:b], cu_seqlens=torch.tensor([0, b - a], dtype=torch.int32),
                          max_seqlen=b - a, backend="grouped", **kw)
        assert torch.equal(alone, whole[a:b]), (case, i)


@pytest.mark.parametrize("backend", ["grouped", "matmul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grid_padding_is_finite_in_recycled_memory(dtype, backend):
    """The grid is gathered into an empty tensor, its padding rows copying a real row: with freed blocks kept in the
    heap (the CPU encoder's allocator setting) it lands on NaN-filled memory, and no NaN may reach P V."""
    from embedpipe.runtime.cpu import keep_freed_memory

    keep_freed_memory()
    cu = torch.nn.functional.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32)
    plan, T = plan_groups(cu), sum(LENGTHS)
    q, k, v = torch.randn(T, 3, 4, 16, generator=torch.Generator().manual_seed(0)).to(dtype).unbind(1)
    want = attention(q, k, v, cu_seqlens=cu, max_seqlen=256, backend="reference")
    for _ in range(3):
        torch.empty(plan.rows, 3 * 4 * 16, dtype=dtype).fill_(float("nan"))
    got = attention(q, k, v, cu_seqlens=cu, max_seqlen=256, backend=backend, plan=plan)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


TINY = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "intermediate_size": 48, "max_position_embeddings": 512}
FAMILIES = {"bert": TINY, "qwen3": {**TINY, "num_key_value_heads": 2, "head_dim": 8},
            "modernbert": {**TINY, "global_attn_every_n_layers": 2, "local_attention": 16}}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_forward_plans_once_and_hands_the_plan_to_every_layer(model_type, monkeypatch):
    """No plan cached by tensor identity: each forward plans its batch once from cu_seqlens, every
    layer's attention gets that plan, and the result is the reference backend's."""
    from embedpipe.models import model_class

    attn = importlib.import_module("embedpipe.kernels.attention")
    built, seen = [], []
    plan, matmul = attn.PLANNERS["matmul"], attn.BACKENDS["matmul"]
    monkeypatch.setitem(attn.PLANNERS, "matmul", lambda cu: built.append(plan(cu)) or built[-1])
    monkeypatch.setitem(attn.BACKENDS, "matmul", lambda *a, **kw: seen.append(kw["plan"]) or matmul(*a, **kw))
    cls = model_class(model_type)
    config = cls.config_class.from_hf_config({**FAMILIES[model_type], "model_type": model_type})
    torch.manual_seed(0)
    ours, ref = cls(config, attention_backend="matmul").eval(), cls(config, attention_backend="reference").eval()
    ref.load_state_dict(ours.state_dict())
    lengths = LENGTHS[:8]
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    ids = torch.randint(1, 100, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.inference_mode():
        out = ours(ids, positions, cu, max(lengths))
        assert len(built) == 1 and len(seen) == 3 and all(p is built[0] for p in seen)
        ours(ids, positions, cu, max(lengths))  # the same cu_seqlens tensor again: planned again, not looked up
        assert len(built) == 2 and all(p is built[1] for p in seen[3:])
        torch.testing.assert_close(out, ref(ids, positions, cu, max(lengths)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "grouped", "matmul"])
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


@pytest.mark.parametrize("backend", ["sdpa", "grouped", "matmul"])
def test_empty_pack(backend):
    q = torch.zeros(0, 2, 8)
    out = attention(q, q, q, cu_seqlens=torch.zeros(1, dtype=torch.int32), max_seqlen=0, backend=backend)
    assert out.shape == (0, 2, 8)


@pytest.mark.parametrize("backend", ["sdpa", "grouped", "matmul"])
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
    for backend in ("sdpa", "grouped", "matmul"):
        out = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend=backend)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["mha", "gqa-causal-window", "window"])
def test_matmul_backend_in_small_score_steps(case, monkeypatch):
    monkeypatch.setattr(importlib.import_module("embedpipe.kernels.cpu"), "_SCORE_BYTES", 4096)
    H, Hkv, causal, window, scale = CASES[case]
    kw = dict(causal=causal, window=window, scale=scale)
    q, k, v, cu, max_len = packed_qkv(LENGTHS, H, Hkv)
    ref = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="reference", **kw)
    out = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="matmul", **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["grouped", "matmul"])
def test_grouped_backends_send_no_bf16_matmul_to_onednn(backend):
    """bf16 q/k/v: matmul's scores and P V are fp32 matmuls (torch's BLAS), grouped's SDPA runs torch's own CPU flash
    kernel; neither runs a oneDNN primitive, whose memory grew ~0.3 MiB per new (n, L) shape on an AMX CPU
    (docs/reliability.md). Read off ONEDNN_VERBOSE in a fresh process (a CPU with no oneDNN bf16 matmul passes
    either way)."""
    import os
    import subprocess
    import sys

    code = ("import torch; from embedpipe.kernels import attention\n"
            "torch.manual_seed(0); q, k, v = (torch.randn(50, 4, 16).bfloat16() for _ in range(3))\n"
            "cu = torch.tensor([0, 20, 45, 50], dtype=torch.int32)\n"
            f"attention(q, k, v, cu_seqlens=cu, max_seqlen=25, backend={backend!r})\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ONEDNN_VERBOSE": "all"},
                         capture_output=True, text=True, check=True).stdout
    assert [line for line in out.splitlines() if ",exec," in line] == []


@pytest.mark.parametrize("backend", ["grouped", "matmul"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_rows_past_the_pack_are_ignored_and_come_back_zero(case, fused, backend):
    """A CPU runner's row padding (runtime/runners.py EagerRunner rows_for): q/k/v carry rows past cu_seqlens[-1],
    filled here with NaN; the real rows' output is the unpadded call's, bit for bit, and the padding rows' is 0."""
    from embedpipe.kernels.attention import PADDED_ROWS

    assert backend in PADDED_ROWS
    H, Hkv, causal, window, scale = CASES[case]
    kw = dict(causal=causal, window=window, scale=scale)
    q, k, v, cu, max_len = packed_qkv(LENGTHS, H, Hkv)
    T, D, extra = q.shape[0], q.shape[2], 13
    want = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend=backend, **kw)
    nan = torch.full((extra, (H + 2 * Hkv) * D), float("nan"))
    qkv = torch.cat([torch.cat([x.reshape(T, -1) for x in (q, k, v)], 1), nan])  # [T + extra, (H + 2 Hkv) D]
    split = (qkv[:, :H * D].view(-1, H, D), qkv[:, H * D:(H + Hkv) * D].view(-1, Hkv, D),
             qkv[:, (H + Hkv) * D:].view(-1, Hkv, D))
    if not fused:
        split = tuple(x.clone() for x in split)
    got = attention(*split, cu_seqlens=cu, max_seqlen=max_len, backend=backend, **kw)
    assert got.shape == (T + extra, H, D)
    assert torch.equal(got[:T], want)
    assert torch.equal(got[T:], torch.zeros(extra, H, D))


@pytest.mark.parametrize("case", CASES)
def test_grouped_backend_upcasts_float16(case):
    """float16 is not one of the dtypes `grouped` hands SDPA as they are (_SDPA_DTYPES): upcast to fp32 per group, the
    output cast back; within an fp16 ulp or two of the reference."""
    from embedpipe.kernels.cpu import _SDPA_DTYPES

    assert torch.float16 not in _SDPA_DTYPES
    H, Hkv, causal, window, scale = CASES[case]
    kw = dict(causal=causal, window=window, scale=scale)
    q, k, v, cu, max_len = packed_qkv(LENGTHS, H, Hkv, dtype=torch.float16)
    ref = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="reference", **kw)
    out = attention(q, k, v, cu_seqlens=cu, max_seqlen=max_len, backend="grouped", **kw)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-3, rtol=5e-3)
