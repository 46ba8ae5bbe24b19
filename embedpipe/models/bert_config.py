"""The BERT family's facts, torch-free: its config (BERT, XLM-RoBERTa) and its checkpoint's weight names.

One owner for both forwards of the family: the packed torch encoder (embedpipe/models/bert.py) and the numpy
query encoder (embedpipe/models/numpy_bert.py) read config.json and map checkpoint names through these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from embedpipe.models.activations import check_activation
from embedpipe.models.flops import attention_flops

# checkpoint name prefixes removed before WEIGHT_MAP lookup (BertForX / RobertaModel dumps)
BERT_STRIP_PREFIXES: tuple[str, ...] = ("bert.", "roberta.", "model.")
# checkpoint name -> ours; "{}" is the layer index, "*" matches anything (drops only),
# None drops the key, (name, i) is shard i of a tensor fused along dim 0 (q, k, v -> qkv)
BERT_WEIGHT_MAP: dict[str, str | tuple[str, int] | None] = {
    "embeddings.word_embeddings.weight": "embed.tok.weight",
    "embeddings.position_embeddings.weight": "embed.pos.weight",
    "embeddings.token_type_embeddings.weight": "embed.token_type.weight",
    "embeddings.LayerNorm.weight": "embed.norm.weight",
    "embeddings.LayerNorm.bias": "embed.norm.bias",
    "embeddings.position_ids": None,  # buffer, positions come from the packer
    "embeddings.token_type_ids": None,
    "encoder.layer.{}.attention.self.query.weight": ("layers.{}.attn.qkv.weight", 0),
    "encoder.layer.{}.attention.self.key.weight": ("layers.{}.attn.qkv.weight", 1),
    "encoder.layer.{}.attention.self.value.weight": ("layers.{}.attn.qkv.weight", 2),
    "encoder.layer.{}.attention.self.query.bias": ("layers.{}.attn.qkv.bias", 0),
    "encoder.layer.{}.attention.self.key.bias": ("layers.{}.attn.qkv.bias", 1),
    "encoder.layer.{}.attention.self.value.bias": ("layers.{}.attn.qkv.bias", 2),
    "encoder.layer.{}.attention.output.dense.weight": "layers.{}.attn.out.weight",
    "encoder.layer.{}.attention.output.dense.bias": "layers.{}.attn.out.bias",
    "encoder.layer.{}.attention.output.LayerNorm.weight": "layers.{}.attn_norm.weight",
    "encoder.layer.{}.attention.output.LayerNorm.bias": "layers.{}.attn_norm.bias",
    "encoder.layer.{}.intermediate.dense.weight": "layers.{}.mlp.up.weight",
    "encoder.layer.{}.intermediate.dense.bias": "layers.{}.mlp.up.bias",
    "encoder.layer.{}.output.dense.weight": "layers.{}.mlp.down.weight",
    "encoder.layer.{}.output.dense.bias": "layers.{}.mlp.down.bias",
    "encoder.layer.{}.output.LayerNorm.weight": "layers.{}.mlp_norm.weight",
    "encoder.layer.{}.output.LayerNorm.bias": "layers.{}.mlp_norm.bias",
    "pooler.*": None,  # BERT's NSP pooler; sentence embeddings come from our head
    "cls.*": None,  # MLM / NSP heads of BertForPreTraining dumps
}
# XLM-R: BERT's table (the "roberta." prefix is stripped there), plus the MLM head of *ForMaskedLM dumps
XLM_ROBERTA_WEIGHT_MAP: dict[str, str | tuple[str, int] | None] = {**BERT_WEIGHT_MAP, "lm_head.*": None}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int = 512  # position table size; the tokenizer truncates below it
    type_vocab_size: int = 2  # only type 0 is used (single-segment inputs)
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"  # one of models/activations.py: ACTIVATION_NAMES
    position_offset: int = 0  # added to 0-based positions (RoBERTa: padding_idx + 1)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the position table covers (RoBERTa loses its offset rows)."""
        return self.max_positions - self.position_offset

    @property
    def default_pooling(self) -> str:
        """The pooling when the directory has no Pooling module."""
        return "mean"

    @property
    def linear_weights(self) -> int:
        """Weights of every Linear in the layers: qkv 3h^2, out h^2, up and down 2hi per layer."""
        h, i = self.hidden_size, self.intermediate_size
        return self.num_layers * (4 * h * h + 2 * h * i)

    def flops_per_token(self, seq_len: float) -> float:
        """The family's FLOPs rule (embedpipe.report.flops): forward FLOPs per token at `seq_len`.

        2 * linear_weights + 4 * layers * hidden * seq_len (QK^T and PV, bidirectional: every query
        sees seq_len keys). Not counted: embedding lookups, biases, LayerNorm, GELU, softmax.
        BERT-base, seq 512: 2 * 12 * (4*768^2 + 2*768*3072) + 4 * 12 * 768 * 512 = 188.7 MFLOP/token.
        """
        return 2.0 * self.linear_weights + attention_flops(
            layers=self.num_layers, heads=self.num_heads, head_dim=self.head_dim, context=seq_len)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> BertConfig:
        kind = hf.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"position_embedding_type {kind!r} is not supported (only 'absolute')")
        if hf["hidden_size"] % hf["num_attention_heads"]:
            raise ValueError(
                f"hidden_size {hf['hidden_size']} is not divisible by num_attention_heads {hf['num_attention_heads']}"
            )
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_positions=hf.get("max_position_embeddings", 512),
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            hidden_act=check_activation(hf.get("hidden_act", "gelu")),
        )


@dataclass(frozen=True)
class XLMRobertaConfig(BertConfig):
    """XLM-RoBERTa / RoBERTa: BERT's blocks; transformers numbers a sequence's tokens from padding_idx + 1
    (`create_position_ids_from_input_ids`), so position row = 0-based position + pad_token_id + 1."""

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> XLMRobertaConfig:
        cfg = super().from_hf_config(hf)
        offset = hf.get("pad_token_id", 1) + 1  # RoBERTa's padding_idx is pad_token_id
        if cfg.max_positions <= offset:
            raise ValueError(
                f"max_position_embeddings {cfg.max_positions} leaves no position after RoBERTa's offset "
                f"pad_token_id + 1 = {offset}; check config.json"
            )
        return dataclasses.replace(cfg, position_offset=offset)


# config.json model_type -> the family's config and checkpoint names (bert.py and xlm_roberta.py register
# their torch classes for the same model_types; tests/test_numpy_query.py pins that the two agree)
BERT_FAMILY: dict[str, tuple[type[BertConfig], tuple[str, ...], dict[str, str | tuple[str, int] | None]]] = {
    "bert": (BertConfig, BERT_STRIP_PREFIXES, BERT_WEIGHT_MAP),
    "xlm-roberta": (XLMRobertaConfig, BERT_STRIP_PREFIXES, XLM_ROBERTA_WEIGHT_MAP),
    "roberta": (XLMRobertaConfig, BERT_STRIP_PREFIXES, XLM_ROBERTA_WEIGHT_MAP),
}
