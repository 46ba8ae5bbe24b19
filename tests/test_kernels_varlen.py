"""torch's varlen_attn across its API versions, and backend choice by dtype (CPU: fakes bound to the real signatures)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from tests.test_kernels import CASES, MIXED, packed_qkv

attn = importlib.import_module("embedpipe.kernels.attention")  # the module (the package exports a function of that name)
P = inspect.Parameter
_POS = [P(n, P.POSITIONAL_OR_KEYWORD) for n in ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")]


def _sig(*names: str, positional_causal: bool = False) -> inspect.Signature:
    kind = P.POSITIONAL_OR_KEYWORD if positional_causal else P.KEYWORD_ONLY
    return inspect.Signature(_POS + [P(n, kind, default=None) for n in names])


SIGNATURES = {  # as documented for each release
    "2.10": _sig("is_causal", "return_aux", positional_causal=True),
    "2.11": _sig("return_aux", "scale", "window_size"),
    "2.12+": _sig("return_aux", "scale", "window_size", "enable_gqa", "seqused_k", "block_table", "num_splits"),
}


def _fake_varlen(signature: inspect.Signature):
    """Binds every call to `signature` (TypeError on a wrong keyword), then computes with the reference."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        signature.bind(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        assert cu_q.dtype == torch.int32 and cu_k is cu_q and max_q == max_k
        if "enable_gqa" in signature.parameters and k.shape[1] != q.shape[1] and not kw.get("enable_gqa"):
            raise ValueError("Try setting enable_gqa=True for GQA.")  # what torch >= 2.12 does
        left, right = kw.get("window_size") or (-1, -1)
        causal = bool(kw.get("is_causal")) or right == 0
        window = None if left < 0 else left
        return attn.attention(q, k, v, cu_seqlens=cu_q, max_seqlen=max_q, causal=causal, window=window,
                              scale=kw.get("scale"), backend="reference")

    varlen_attn.__signature__ = signature
    return varlen_attn


@pytest.fixture
def fake_torch_varlen(monkeypatch):
    import torch.nn.attention.varlen as module

    def install(signature):
        monkeypatch.setattr(module, "varlen_attn", _fake_varlen(signature))
        attn._varlen_params.cache_clear()

    yield install
    attn._varlen_params.cache_clear()


@pytest.mark.parametrize("version", ["installed", *SIGNATURES])
@pytest.mark.parametrize("case", CASES)
def test_varlen_call_binds_and_means_the_same(fake_torch_varlen, version, case):
    import torch.nn.attention.varlen as module

    H, Hkv, causal, window, scale = CASES[case]
    signature = inspect.signature(module.varlen_attn) if version == "installed" else SIGNATURES[version]
    fake_torch_varlen(signature)
    q, k, v, cu, max_len = packed_qkv(MIXED, H, Hkv)
    kw = dict(cu_seqlens=cu, max_seqlen=max_len, causal=causal, window=window, scale=scale)
    if version == "2.10" and window is not None:
        with pytest.raises(NotImplementedError, match="needs torch >= 2.11"):
            attn.attention(q, k, v, backend="varlen", **kw)
        return
    out = attn.attention(q, k, v, backend="varlen", **kw)
    torch.testing.assert_close(out, attn.attention(q, k, v, backend="reference", **kw), atol=1e-5, rtol=1e-5)


def test_keyword_choice_per_version():
    kw, fold = attn._varlen_kwargs(frozenset(SIGNATURES["2.10"].parameters), causal=True, window=None, scale=0.3,
                                   gqa=True)
    assert kw == {"is_causal": True} and fold == 0.3
    kw, fold = attn._varlen_kwargs(frozenset(SIGNATURES["2.11"].parameters), causal=True, window=None, scale=None,
                                   gqa=True)
    assert kw == {"window_size": (-1, 0), "scale": None} and fold is None  # (-1, 0) is how 2.11+ says causal
    kw, _ = attn._varlen_kwargs(frozenset(SIGNATURES["2.12+"].parameters), causal=False, window=4, scale=None,
                                gqa=True)
    assert kw == {"window_size": (4, 4), "scale": None, "enable_gqa": True}


def test_auto_picks_sdpa_for_float32_on_cuda(monkeypatch):
    monkeypatch.setattr(attn, "_cuda", lambda: True)  # pretend: varlen is importable here (torch >= 2.10)
    assert attn.select_backend(device="cuda", dtype=torch.bfloat16) == "varlen"
    assert attn.select_backend(device="cuda", dtype=torch.float32) == "sdpa"
    assert "varlen" not in attn.available_backends(device="cuda", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"float16/bfloat16 only.*model.dtype to bfloat16"):
        attn.select_backend(device="cuda", requested="varlen", dtype=torch.float32)
