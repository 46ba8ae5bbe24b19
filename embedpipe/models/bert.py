"""BERT-family encoders (BERT, MiniLM, BGE, E5, GTE-base...) on packed tokens, pure torch.

    input_ids [T], positions [T] (0-based per sequence), cu_seqlens [B+1], max_seqlen -> hidden [T, hidden]

Post-LN: x = LN(x + Attn(x)); x = LN(x + MLP(x)). No batch dimension, no masks: sequence
boundaries live only in cu_seqlens and reach nothing but the attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from embedpipe.kernels import attention, plan_attention
from embedpipe.models.layers import LayerNorm, activation, attention_flops
from embedpipe.models.registry import register


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
    hidden_act: str = "gelu"  # key of models.layers.ACTIVATIONS
    position_offset: int = 0  # added to 0-based positions (RoBERTa: padding_idx + 1)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the position table covers (RoBERTa loses its offset rows)."""
        return self.max_positions - self.position_offset

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
        activation(hf.get("hidden_act", "gelu"))  # fail at load time, not mid-batch
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_positions=hf.get("max_position_embeddings", 512),
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            hidden_act=hf.get("hidden_act", "gelu"),
        )


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.offset = cfg.position_offset
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        x = self.tok(input_ids).float() + self.pos(positions + self.offset).float()  # [T, hidden] fp32 sum
        x = x + self.token_type.weight[0].float()  # token_type_ids are all 0
        return self.norm(x).to(self.tok.weight.dtype)  # [T, hidden]


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig, backend: str) -> None:
        super().__init__()
        self.heads, self.head_dim, self.backend = cfg.num_heads, cfg.head_dim, backend
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # rows: q, k, v
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int, plan: Any) -> Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.heads, self.head_dim).unbind(1)  # 3 x [T, H, D]
        o = attention(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, backend=self.backend,
                      plan=plan)  # [T, H, D]
        return self.out(o.reshape(T, self.heads * self.head_dim))  # [T, hidden]


class BertMLP(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))  # [T, hidden]


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, backend: str) -> None:
        super().__init__()
        self.attn = BertAttention(cfg, backend)
        self.attn_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = BertMLP(cfg)
        self.mlp_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int, plan: Any) -> Tensor:
        x = self.attn_norm(x + self.attn(x, cu_seqlens, max_seqlen, plan))  # [T, hidden]
        return self.mlp_norm(x + self.mlp(x))  # [T, hidden]


@register("bert")
class BertModel(nn.Module):
    config_class: ClassVar[type] = BertConfig
    default_pooling: ClassVar[str] = "mean"  # when the directory has no Pooling module

    # checkpoint name prefixes removed before WEIGHT_MAP lookup (BertForX / RobertaModel dumps)
    STRIP_PREFIXES: ClassVar[tuple[str, ...]] = ("bert.", "roberta.", "model.")
    # checkpoint name -> ours; "{}" is the layer index, "*" matches anything (drops only),
    # None drops the key, (name, i) is shard i of a tensor fused along dim 0 (q, k, v -> qkv)
    WEIGHT_MAP: ClassVar[dict[str, str | tuple[str, int] | None]] = {
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

    def __init__(self, config: BertConfig, *, attention_backend: str = "sdpa") -> None:
        super().__init__()
        self.config, self.attention_backend = config, attention_backend
        self.embed = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config, attention_backend) for _ in range(config.num_layers))

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def forward(self, input_ids: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        plan = plan_attention(cu_seqlens, backend=self.attention_backend)  # once per forward, for every layer
        x = self.embed(input_ids, positions)  # [T, hidden]
        for layer in self.layers:
            x = layer(x, cu_seqlens, max_seqlen, plan)  # [T, hidden]
        return x

    def flops_per_token(self, seq_len: float) -> float:
        """Forward FLOPs per token at `seq_len`: the family's rule, BertConfig.flops_per_token."""
        return self.config.flops_per_token(seq_len)
