"""Qwen3 on packed tokens vs transformers: GQA, q/k RMSNorm, RoPE; causal and bidirectional."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from embedpipe.models import MODEL_REGISTRY, load_model, load_state_dict_into
from embedpipe.models.qwen3 import Qwen3Config, Qwen3Model
from tests.model_helpers import (
    LENGTHS, assert_batch_invariant, assert_matches_reference, backend_cases, dtype_cases, random_sequences,
    randomize_norms_, run_packed, skip_unsupported,
)

TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16,  # heads * head_dim = 64 != hidden 32, as in Qwen3-0.6B (16 x 128 vs 1024)
            intermediate_size=64, max_position_embeddings=128, initializer_range=0.2,
            rope_parameters={"rope_type": "default", "rope_theta": 100.0})  # small theta: rotations show at short range
MODES = {"causal": {}, "bidirectional": {"use_bidirectional_attention": True}}


def tiny_hf(seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    return randomize_norms_(transformers.Qwen3Model(transformers.Qwen3Config(**{**TINY, **overrides})).eval(), seed=seed)


@torch.no_grad()
def hf_qwen3_hidden(hf, seqs: list[torch.Tensor], *, bidirectional: bool) -> list[torch.Tensor]:
    """transformers' Qwen3Model one sequence at a time. Qwen3Model always builds a causal mask from
    its config; for the bidirectional reference we pass the per-layer-type mask mapping ourselves
    (forward accepts a dict {layer_type: mask} as "already prepared") with an all-zero additive
    [1, 1, L, L] float mask: eager adds it (no-op), and SDPA, given a mask, no longer sets is_causal."""
    out = []
    for s in seqs:
        kw = {}
        if bidirectional:
            kw["attention_mask"] = {"full_attention": torch.zeros(1, 1, len(s), len(s))}
        out.append(hf(input_ids=s[None], **kw).last_hidden_state[0].float())
    return out


@pytest.fixture(scope="module", params=list(MODES))
def tiny(request, tmp_path_factory):
    bidirectional = request.param == "bidirectional"
    path = tmp_path_factory.mktemp(f"tiny_qwen3_{request.param}")
    hf = tiny_hf(**MODES[request.param])
    hf.save_pretrained(path, safe_serialization=True)
    seqs = random_sequences(LENGTHS)
    return path, hf, seqs, hf_qwen3_hidden(hf, seqs, bidirectional=bidirectional), bidirectional


def test_registry():
    assert MODEL_REGISTRY["qwen3"] is MODEL_REGISTRY["bidirectional_pplx_qwen3"] is Qwen3Model


def test_config_flags_and_rope():
    base = {**TINY, "model_type": "qwen3"}
    assert Qwen3Config.from_hf_config(base).causal
    assert not Qwen3Config.from_hf_config({**base, "use_bidirectional_attention": True}).causal
    assert not Qwen3Config.from_hf_config({**base, "is_causal": False}).causal
    assert not Qwen3Config.from_hf_config({**base, "model_type": "bidirectional_pplx_qwen3"}).causal
    legacy = {k: v for k, v in base.items() if k != "rope_parameters"} | {"rope_theta": 5e5, "rope_scaling": None}
    assert Qwen3Config.from_hf_config(legacy).rope_theta == 5e5  # transformers 4.x config.json
    assert Qwen3Config.from_hf_config(base).rope_theta == 100.0
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        Qwen3Config.from_hf_config({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})
    with pytest.raises(ValueError, match="sliding-window"):
        Qwen3Config.from_hf_config({**base, "use_sliding_window": True})


@pytest.mark.parametrize("device,backend", backend_cases())
@pytest.mark.parametrize("dtype,tol", dtype_cases())
def test_matches_transformers(tiny, device, backend, dtype, tol):
    skip_unsupported(backend, dtype)
    path, _, seqs, ref, bidirectional = tiny
    lm = load_model(path, dtype=dtype, device=device, attention_backend=backend)
    assert lm.model.config.causal is not bidirectional and lm.max_positions == 128
    hidden, cu = run_packed(lm.model, seqs)
    assert hidden.dtype == dtype
    default = "mean" if bidirectional else "last"
    assert lm.build_head().pooling == default  # no ST Pooling module in the directory
    assert_matches_reference(hidden, cu, ref, tol=tol, modes=(default,))
    if dtype == torch.float32:
        torch.testing.assert_close(hidden, torch.cat(ref), atol=2e-5, rtol=1e-5)


def test_references_differ(tiny):
    """Causal and bidirectional references disagree beyond the first token: each test above can fail."""
    _, hf, seqs, ref, bidirectional = tiny
    other = hf_qwen3_hidden(hf, seqs, bidirectional=not bidirectional)
    assert (torch.cat(ref) - torch.cat(other)).abs().max().item() > 1e-2
    torch.testing.assert_close(ref[0], other[0])  # a 1-token sequence sees the same either way


def test_causal_lm_dump_loads():
    """Qwen3ForCausalLM names: "model." prefix stripped, lm_head dropped."""
    import transformers

    torch.manual_seed(2)
    lm = randomize_norms_(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY)).eval(), seed=2)
    seqs = random_sequences(LENGTHS)
    ref = hf_qwen3_hidden(lm.model, seqs, bidirectional=False)
    assert "lm_head.weight" in lm.state_dict()
    with torch.device("meta"):
        model = Qwen3Model(Qwen3Config.from_hf_config(lm.config.to_dict()), attention_backend="sdpa")
    load_state_dict_into(model, lm.state_dict())
    hidden, _ = run_packed(model, seqs)
    torch.testing.assert_close(hidden, torch.cat(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "grouped", "matmul"])  # the CPU backends
def test_batch_invariance(tiny, backend):
    lm = load_model(tiny[0], attention_backend=backend)
    assert_batch_invariant(lm.model, tiny[2][3], random_sequences((5, 30, 64, 12, 2, 47), seed=1))


def test_flops_per_token_qwen3_0_6b_hand_count():
    cfg = Qwen3Config(vocab_size=151669, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                      intermediate_size=3072)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    # per layer: q 1024x2048, k 1024x1024, v 1024x1024, o 2048x1024, gate + up 2 x 1024x3072, down 3072x1024
    per_layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072
    assert per_layer == 15_728_640  # 440.4M matmul weights in 28 layers (+155.3M embedding, not a matmul)
    # causal: query i sees i + 1 keys, (512 + 1) / 2 on average; QK^T and PV are 2 * keys * head_dim each, per head
    attn_512 = 4 * 28 * 16 * 128 * (513 / 2)
    assert model.flops_per_token(512) == 2 * 28 * per_layer + attn_512 == 939_638_784
    with torch.device("meta"):
        bidirectional = Qwen3Model(dataclasses.replace(cfg, causal=False))  # every query sees all 512 keys
    assert bidirectional.flops_per_token(512) == 2 * 28 * per_layer + 4 * 28 * 16 * 128 * 512
