"""XLM-RoBERTa / RoBERTa on packed tokens vs transformers: positions offset by the padding index."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from embedpipe.models import MODEL_REGISTRY, load_model, load_state_dict_into
from embedpipe.models.xlm_roberta import XLMRobertaConfig, XLMRobertaModel
from tests.model_helpers import (
    LENGTHS, assert_batch_invariant, assert_matches_reference, backend_cases, dtype_cases, hf_hidden,
    random_sequences, randomize_norms_, run_packed, skip_unsupported,
)

PAD = 1  # transformers' RobertaConfig default; positions start at PAD + 1
TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=66, pad_token_id=PAD, type_vocab_size=1, layer_norm_eps=1e-5,
            initializer_range=0.2)  # 66 = 64 usable positions + the offset of 2, exactly the longest sequence


def tiny_hf(kind: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg_cls, model_cls = {
        "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel),
        "roberta": (transformers.RobertaConfig, transformers.RobertaModel),
    }[kind]
    return randomize_norms_(model_cls(cfg_cls(**TINY)).eval(), seed=seed)


@pytest.fixture(scope="module", params=["xlm-roberta", "roberta"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_hf(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    seqs = random_sequences(LENGTHS, low=PAD + 1)  # text holds no pad ids (transformers would not number them)
    return path, hf, seqs, hf_hidden(hf, seqs)


def test_registry():
    assert MODEL_REGISTRY["xlm-roberta"] is MODEL_REGISTRY["roberta"] is XLMRobertaModel


@pytest.mark.parametrize("device,backend", backend_cases())
@pytest.mark.parametrize("dtype,tol", dtype_cases())
def test_matches_transformers(tiny, device, backend, dtype, tol):
    skip_unsupported(backend, dtype)
    path, _, seqs, ref = tiny
    lm = load_model(path, dtype=dtype, device=device, attention_backend=backend)
    assert lm.config.position_offset == PAD + 1 and lm.max_positions == 64 == max(LENGTHS)
    hidden, cu = run_packed(lm.model, seqs)
    assert hidden.dtype == dtype
    assert_matches_reference(hidden, cu, ref, tol=tol, modes=("mean", "cls"))
    if dtype == torch.float32:
        torch.testing.assert_close(hidden, torch.cat(ref), atol=2e-5, rtol=1e-5)


def test_offset_matters(tiny):
    """Without the offset the same weights give different states: the test above can fail."""
    path, hf, seqs, ref = tiny
    cfg = XLMRobertaConfig.from_hf_config(hf.config.to_dict())
    with torch.device("meta"):
        model = XLMRobertaModel(dataclasses.replace(cfg, position_offset=0), attention_backend="reference")
    load_state_dict_into(model, hf.state_dict())
    hidden, _ = run_packed(model, seqs)
    assert (hidden - torch.cat(ref)).abs().max().item() > 1e-2


def test_masked_lm_dump_loads(tiny):
    """XLMRobertaForMaskedLM names: "roberta." prefix (stripped) and an lm_head (dropped)."""
    _, hf, seqs, ref = tiny
    state = {f"roberta.{k}": v for k, v in hf.state_dict().items()} | {"lm_head.dense.weight": torch.zeros(32, 32)}
    with torch.device("meta"):
        model = XLMRobertaModel(XLMRobertaConfig.from_hf_config(hf.config.to_dict()), attention_backend="sdpa")
    load_state_dict_into(model, state)
    hidden, _ = run_packed(model, seqs)
    torch.testing.assert_close(hidden, torch.cat(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "grouped", "matmul"])  # the CPU backends
def test_batch_invariance(tiny, backend):
    lm = load_model(tiny[0], attention_backend=backend)
    others = random_sequences((5, 30, 64, 12, 2, 47), seed=1, low=PAD + 1)
    assert_batch_invariant(lm.model, tiny[2][3], others)


def test_config_rejects_table_smaller_than_offset():
    with pytest.raises(ValueError, match="max_position_embeddings 2 leaves no position"):
        XLMRobertaConfig.from_hf_config({**TINY, "max_position_embeddings": 2})
