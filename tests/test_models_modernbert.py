"""ModernBERT on packed tokens vs transformers: rotary with two thetas, local/global layers, GeGLU."""

from __future__ import annotations

import pytest
import torch

from embedpipe.models import MODEL_REGISTRY, load_model, load_state_dict_into
from embedpipe.models.modernbert import GLOBAL, LOCAL, ModernBertConfig, ModernBertModel
from tests.model_helpers import (
    LENGTHS, assert_batch_invariant, assert_matches_reference, backend_cases, dtype_cases, hf_hidden,
    random_sequences, randomize_norms_, run_packed, skip_unsupported,
)

WINDOW = 8  # local_attention 16 -> keys with |i - j| <= 8; LENGTHS reach 64, far past it
TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
            local_attention=2 * WINDOW, global_attn_every_n_layers=2,  # layers: global, local, global
            global_rope_theta=160_000.0, local_rope_theta=100.0,  # a small local theta: rotations show at short range
            pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
            initializer_range=0.2, max_position_embeddings=512)


def tiny_hf(seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    return randomize_norms_(transformers.ModernBertModel(transformers.ModernBertConfig(**{**TINY, **overrides})).eval(),
                            seed=seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_modernbert")
    hf = tiny_hf()
    hf.save_pretrained(path, safe_serialization=True)
    seqs = random_sequences(LENGTHS)
    return path, hf, seqs, hf_hidden(hf, seqs)


def test_registry_and_config():
    assert MODEL_REGISTRY["modernbert"] is ModernBertModel


def test_config_reads_5x_and_legacy_fields(tiny):
    saved = tiny[1].config.to_dict()  # transformers 5.x: layer_types + per-layer-type rope_parameters
    legacy = {k: v for k, v in saved.items() if k not in ("layer_types", "rope_parameters")}  # Hub configs of 2024
    legacy |= {"global_rope_theta": 160_000.0, "local_rope_theta": 100.0}
    for hf in (saved, legacy):
        cfg = ModernBertConfig.from_hf_config(hf)
        assert cfg.layer_types == (GLOBAL, LOCAL, GLOBAL)
        assert (cfg.global_rope_theta, cfg.local_rope_theta, cfg.local_window) == (160_000.0, 100.0, WINDOW)
        assert cfg.pooling == "cls" and cfg.max_seq_len == 512
    assert ModernBertConfig.from_hf_config({**saved, "classifier_pooling": "mean"}).pooling == "mean"
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModernBertConfig.from_hf_config({**saved, "rope_parameters": {GLOBAL: {"rope_type": "yarn"}}})


@pytest.mark.parametrize("device,backend", backend_cases())
@pytest.mark.parametrize("dtype,tol", dtype_cases())
def test_matches_transformers(tiny, device, backend, dtype, tol):
    skip_unsupported(backend, dtype)
    path, _, seqs, ref = tiny
    lm = load_model(path, dtype=dtype, device=device, attention_backend=backend)
    assert [layer.attn.window for layer in lm.model.layers] == [None, WINDOW, None]
    hidden, cu = run_packed(lm.model, seqs)
    assert hidden.dtype == dtype
    assert_matches_reference(hidden, cu, ref, tol=tol, modes=("mean", "cls"))
    if dtype == torch.float32:
        torch.testing.assert_close(hidden, torch.cat(ref), atol=2e-5, rtol=1e-5)
    head = lm.build_head()
    assert head.pooling == "cls"  # transformers' classifier_pooling default; no ST Pooling module here


def test_window_matters(tiny):
    """A one-off window (or none) changes the long sequences: the test above can fail on window semantics."""
    path, _, seqs, ref = tiny
    for window in (WINDOW - 1, WINDOW + 1, None):
        lm = load_model(path, attention_backend="reference")
        lm.model.layers[1].attn.window = window
        hidden, cu = run_packed(lm.model, seqs)
        long = slice(int(cu[-2]), int(cu[-1]))  # the 64-token sequence
        assert (hidden[long] - ref[-1]).abs().max().item() > 1e-3, window


def test_biases_and_masked_lm_dump_load():
    """norm/attention/mlp biases mapped; ModernBertForMaskedLM's "model." prefix stripped, head/decoder dropped."""
    import transformers

    torch.manual_seed(1)
    cfg = transformers.ModernBertConfig(**{**TINY, "norm_bias": True, "attention_bias": True, "mlp_bias": True})
    mlm = randomize_norms_(transformers.ModernBertForMaskedLM(cfg).eval(), seed=1)
    with torch.no_grad():
        for name, p in mlm.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)  # transformers zero-inits biases; a dropped bias must show
    seqs = random_sequences(LENGTHS)
    ref = hf_hidden(mlm.model, seqs)
    with torch.device("meta"):
        model = ModernBertModel(ModernBertConfig.from_hf_config(cfg.to_dict()), attention_backend="sdpa")
    load_state_dict_into(model, mlm.state_dict())
    hidden, _ = run_packed(model, seqs)
    torch.testing.assert_close(hidden, torch.cat(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "grouped", "matmul"])  # the CPU backends
def test_batch_invariance(tiny, backend):
    lm = load_model(tiny[0], attention_backend=backend)
    assert_batch_invariant(lm.model, tiny[2][3], random_sequences((5, 30, 64, 12, 2, 47), seed=1))


def test_flops_per_token_hand_count():
    """ModernBERT-base shape: 22 layers (every 3rd global), local_attention 128."""
    types = tuple(GLOBAL if i % 3 == 0 else LOCAL for i in range(22))
    cfg = ModernBertConfig(vocab_size=50368, hidden_size=768, num_layers=22, num_heads=12, intermediate_size=1152,
                           layer_types=types, local_window=64)
    with torch.device("meta"):
        model = ModernBertModel(cfg)
    weights = 22 * (4 * 768 * 768 + 3 * 768 * 1152)  # Wqkv + Wo + Wi (2 halves) + Wo
    global_layers, local_layers = 8, 14
    assert model.flops_per_token(512) == 2 * weights + 4 * 768 * (global_layers * 512 + local_layers * 129)
    assert model.flops_per_token(100) == 2 * weights + 4 * 768 * 22 * 100  # shorter than the window
