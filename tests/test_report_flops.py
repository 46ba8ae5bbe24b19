"""FLOPs per token from config.json against hand counts (BERT-base, Qwen3-0.6B) and the model classes."""

import sys

import numpy as np
import pytest
import torch

from embedpipe.models.layers import matmul_params
from embedpipe.models.registry import MODEL_REGISTRY, load_families
from embedpipe.report import flops
from embedpipe.report.flops import effective_seq_len, flops_per_token_from_config, read_model_config
from tests.conftest import ROOT

BERT_BASE = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
             "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 512,
             "hidden_act": "gelu", "layer_norm_eps": 1e-12, "type_vocab_size": 2}
QWEN3_06B = {"model_type": "qwen3", "vocab_size": 151669, "hidden_size": 1024, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
             "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
             "attention_bias": False, "tie_word_embeddings": True, "rope_scaling": None,
             "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28}
QWEN3_BIDIRECTIONAL = {**QWEN3_06B, "use_bidirectional_attention": True}
MODERNBERT_BASE = {"model_type": "modernbert", "vocab_size": 50368, "hidden_size": 768, "num_hidden_layers": 22,
                   "num_attention_heads": 12, "intermediate_size": 1152, "global_attn_every_n_layers": 3,
                   "local_attention": 128, "max_position_embeddings": 8192, "hidden_activation": "gelu"}


def test_bert_base_hand_count():
    per_layer = 4 * 768 * 768 + 2 * 768 * 3072  # q, k, v, out + up, down weights
    assert flops_per_token_from_config(BERT_BASE, 512) == 2 * 12 * per_layer + 4 * 12 * 768 * 512 == 188_743_680
    assert flops_per_token_from_config(BERT_BASE, 128) == 2 * 12 * per_layer + 4 * 12 * 768 * 128


def test_qwen3_06b_hand_count():
    q = 1024 * 16 * 128  # hidden -> 16 heads x 128
    kv = 2 * 1024 * 8 * 128  # k and v: 8 kv heads x 128
    o = 16 * 128 * 1024
    mlp = 3 * 1024 * 3072  # gate, up, down (SwiGLU)
    per_layer = q + kv + o + mlp
    assert per_layer == 15_728_640
    # causal: a query at position p sees p keys, (512 + 1) / 2 = 256.5 on average
    want = 2 * 28 * per_layer + 4 * 28 * 16 * 128 * 256.5
    assert flops_per_token_from_config(QWEN3_06B, 512) == want == 939_638_784


def test_mixed_lengths_average_exactly():
    lengths = [10, 30, 7]
    tokens, squared = sum(lengths), sum(n * n for n in lengths)
    seq = effective_seq_len(tokens=tokens, tokens_squared=squared)
    bidir = sum(n * flops_per_token_from_config(BERT_BASE, n) for n in lengths)
    assert tokens * flops_per_token_from_config(BERT_BASE, seq) == pytest.approx(bidir, rel=1e-12)
    # causal: sum over every position p = 1..L of (weights + attention over p keys)
    weights = flops_per_token_from_config(QWEN3_06B, -1)  # context (seq + 1) / 2 = 0: the weights alone
    causal = sum(weights + 4 * 28 * 16 * 128 * p for n in lengths for p in range(1, n + 1))
    assert tokens * flops_per_token_from_config(QWEN3_06B, seq) == pytest.approx(causal, rel=1e-12)


def test_bidirectional_qwen3_and_modernbert_hand_counts():
    per_layer = 15_728_640
    assert flops_per_token_from_config(QWEN3_BIDIRECTIONAL, 512) == 2 * 28 * per_layer + 4 * 28 * 16 * 128 * 512
    weights = 4 * 768 * 768 + 3 * 768 * 1152  # Wqkv, Wo + Wi (2 x 1152 wide), Wo
    global_layers, local_layers = 8, 14  # layers 0, 3, ..., 21 attend globally
    want = 2 * 22 * weights + 4 * 768 * (global_layers * 512 + local_layers * 129)  # local window 2 * 64 + 1
    assert flops_per_token_from_config(MODERNBERT_BASE, 512) == want


@pytest.mark.parametrize("config", [BERT_BASE, QWEN3_06B, QWEN3_BIDIRECTIONAL, MODERNBERT_BASE],
                         ids=["bert-base", "qwen3-0.6b", "qwen3-bidirectional", "modernbert-base"])
def test_matches_the_model_class(config):
    """The convention of each model's own flops_per_token (every family registered on this branch)."""
    load_families()  # registers the families

    cls = MODEL_REGISTRY.get(config["model_type"])
    if cls is None:
        pytest.skip(f"model_type {config['model_type']} is not implemented on this branch")
    with torch.device("meta"):
        model = cls(cls.config_class.from_hf_config(config))
    for seq in (1, 100, 512):
        assert model.flops_per_token(seq) == pytest.approx(flops_per_token_from_config(config, seq), rel=1e-12)


# one tiny config.json per registered family (and per attention mode): 2 layers, width 32
TINY = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 48, "max_position_embeddings": 256}
TINY_QWEN3 = {**TINY, "model_type": "qwen3", "num_key_value_heads": 2, "head_dim": 16}
TINY_FAMILIES = {
    "bert": {**TINY, "model_type": "bert"},
    "xlm-roberta": {**TINY, "model_type": "xlm-roberta", "pad_token_id": 1},
    "roberta": {**TINY, "model_type": "roberta", "pad_token_id": 1},
    "modernbert": {**TINY, "model_type": "modernbert", "num_hidden_layers": 4, "global_attn_every_n_layers": 2,
                   "local_attention": 16},
    "qwen3": TINY_QWEN3,
    "qwen3-bidirectional": {**TINY_QWEN3, "use_bidirectional_attention": True},
    "qwen3-not-causal": {**TINY_QWEN3, "is_causal": False},
    "bidirectional_pplx_qwen3": {**TINY_QWEN3, "model_type": "bidirectional_pplx_qwen3"},
}


def test_every_loadable_family_has_a_tiny_config_here_and_nothing_else_is_listed():
    load_families()  # registers the families

    assert flops.families() == sorted(MODEL_REGISTRY) == sorted({c["model_type"] for c in TINY_FAMILIES.values()})
    for unloadable in ("llama", "mistral", "qwen2"):  # decoders embedpipe has no model class for
        with pytest.raises(ValueError, match=repr(unloadable)):
            flops_per_token_from_config({**TINY_QWEN3, "model_type": unloadable}, 10)


@pytest.mark.parametrize("name", sorted(TINY_FAMILIES))
def test_the_config_rule_is_the_built_model_count(name):
    """The rule on config.json alone = the built model's flops_per_token, and its weights are the
    model's Linear weights (built for real, width 32): one rule, no drift from the modules."""
    load_families()

    config = TINY_FAMILIES[name]
    cls = MODEL_REGISTRY[config["model_type"]]
    family_config = cls.config_class.from_hf_config(config)
    torch.manual_seed(0)
    model = cls(family_config)
    assert family_config.linear_weights == matmul_params(model.layers)
    causal = getattr(family_config, "causal", False)
    for seq in (1, 7, 33, 100, 40.5):  # 40.5: an effective length sum(L^2) / sum(L)
        rule = flops_per_token_from_config(config, seq)
        assert rule == model.flops_per_token(seq)
        weights, attention = 2 * matmul_params(model.layers), rule - 2 * matmul_params(model.layers)
        if name == "modernbert":  # layers 0 and 2 global (seq keys), 1 and 3 local (at most 2 * 8 + 1)
            assert attention == 4 * 32 * (2 * seq + 2 * min(seq, 17))
        else:
            heads_dim = 4 * (16 if "qwen3" in name else 8)
            assert attention == 4 * 2 * heads_dim * ((seq + 1) / 2 if causal else seq), (weights, causal)
    assert causal == (name == "qwen3")


def test_gpu_check_counts_with_the_same_rule(monkeypatch):
    """gpu_check's MFU numerator for a causal Qwen3 (once counted at seq_len keys per query when the
    transformers model was counted instead of ours) is the family's rule, each sequence at its length."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts the checkout first on sys.path
    spec.loader.exec_module(gpu_check)
    lengths = np.array([3, 3, 10, 64])
    want = sum(n * flops_per_token_from_config(TINY_QWEN3, n) for n in lengths.tolist())
    assert gpu_check.model_flops(TINY_QWEN3, lengths) == pytest.approx(want, rel=1e-12)


def test_unknown_model_type_is_refused_by_name():
    with pytest.raises(ValueError, match="'t5'"):
        flops_per_token_from_config({**BERT_BASE, "model_type": "t5"}, 128)


def test_reads_the_transformer_config_of_a_sentence_transformers_folder(minilm_dir):
    config = read_model_config(str(minilm_dir))
    assert config["model_type"] == "bert" and config["hidden_size"] == 384 and config["num_hidden_layers"] == 6
