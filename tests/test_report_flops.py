"""FLOPs per token from config.json against hand counts (BERT-base, Qwen3-0.6B) and the model classes."""

import pytest
import torch

from embedpipe.models.registry import MODEL_REGISTRY
from embedpipe.report.flops import effective_seq_len, flops_per_token_from_config, read_model_config

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
    import embedpipe.models  # noqa: F401  (registers the families)

    cls = MODEL_REGISTRY.get(config["model_type"])
    if cls is None:
        pytest.skip(f"model_type {config['model_type']} is not implemented on this branch")
    with torch.device("meta"):
        model = cls(cls.config_class.from_hf_config(config))
    for seq in (1, 100, 512):
        assert model.flops_per_token(seq) == pytest.approx(flops_per_token_from_config(config, seq), rel=1e-12)


def test_unknown_model_type_is_refused_by_name():
    with pytest.raises(ValueError, match="'t5'"):
        flops_per_token_from_config({**BERT_BASE, "model_type": "t5"}, 128)


def test_reads_the_transformer_config_of_a_sentence_transformers_folder(minilm_dir):
    config = read_model_config(str(minilm_dir))
    assert config["model_type"] == "bert" and config["hidden_size"] == 384 and config["num_hidden_layers"] == 6
