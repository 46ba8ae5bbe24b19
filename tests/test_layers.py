"""models/layers.py: norms and RoPE in the activation dtype, against transformers' own modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embedpipe.models.layers import RMSNorm, apply_rotary, layer_norm, rotary_cos_sin

HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _data(n: int = 64, d: int = 96):
    g = torch.Generator().manual_seed(0)
    x = 3 + 2 * torch.randn(n, d, generator=g)  # an offset: the mean matters
    return x, 1 + 0.1 * torch.randn(d, generator=g), 0.1 * torch.randn(d, generator=g)


@pytest.mark.parametrize("dtype", HALF)
def test_layer_norm_on_the_half_input_as_cuda_runs_it_keeps_fp32_statistics(dtype):
    """CUDA (and the CPU for bf16) passes the half input to F.layer_norm as it is (one kernel, fp32 accumulation);
    on CPU it agrees with the fp32 chain to one rounding of the output, and both with an fp64 reference."""
    x, w, b = _data()
    xs, ws, bs = x.to(dtype), w.to(dtype), b.to(dtype)
    ref = F.layer_norm(xs.double(), (96,), ws.double(), bs.double(), 1e-12)
    fused = layer_norm(xs, (96,), ws, bs, eps=1e-12, fused=True)
    chain = layer_norm(xs, (96,), ws, bs, eps=1e-12, fused=False)
    assert fused.dtype == chain.dtype == dtype
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10) * ref.abs().clamp(min=1)  # one rounding of the output
    assert ((fused.double() - ref).abs() <= ulp).all() and ((chain.double() - ref).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), *HALF])
def test_rms_norm_matches_transformers_qwen3(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    x, w, _ = _data()
    ours, hf = RMSNorm(96, eps=1e-6), Qwen3RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(w)
        hf.weight.copy_(w)
        got, want = ours.to(dtype)(x.to(dtype)), hf.to(dtype)(x.to(dtype))
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), *HALF])
def test_rope_in_the_activation_dtype_is_transformers_bit_for_bit(dtype):
    """transformers casts cos/sin to the activation dtype and rotates there: q * cos + rotate_half(q) * sin."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    T, H, D, theta = 40, 4, 64, 1e6
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    positions = torch.arange(T) % 17  # packed: positions restart per sequence
    cos, sin = rotary_cos_sin(positions, head_dim=D, theta=theta, dtype=dtype)  # [T, 1, D/2]
    assert cos.dtype == sin.dtype == dtype
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    emb = torch.cat([positions.float()[:, None] * inv_freq] * 2, dim=-1)  # [T, D], transformers' layout
    hf_q, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], emb.cos().to(dtype)[None],
                                   emb.sin().to(dtype)[None])  # [1, H, T, D]
    assert torch.equal(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1))
