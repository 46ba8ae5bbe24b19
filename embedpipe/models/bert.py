"""BERT-family encoders (BERT, MiniLM, BGE, E5, GTE-base...) on packed tokens, pure torch.

    input_ids [T], positions [T] (0-based per sequence), cu_seqlens [B+1], max_seqlen -> hidden [T, hidden]

Post-LN: x = LN(x + Attn(x)); x = LN(x + MLP(x)). No batch dimension, no masks: sequence
boundaries live only in cu_seqlens and reach nothing but the attention kernel.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from embedpipe.kernels import attention, plan_attention
from embedpipe.models.bert_config import BERT_STRIP_PREFIXES, BERT_WEIGHT_MAP, BertConfig
from embedpipe.models.layers import LayerNorm, linear_act, linear_add
from embedpipe.models.registry import register


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

    def forward(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int, plan: Any, *, residual: Tensor) -> Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.heads, self.head_dim).unbind(1)  # 3 x [T, H, D]
        o = attention(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, backend=self.backend,
                      plan=plan)  # [T, H, D]
        return linear_add(self.out, o.reshape(T, self.heads * self.head_dim), residual)  # [T, hidden]: residual + out


class BertMLP(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = cfg.hidden_act  # a name of models/layers.py ACTIVATIONS, checked when the config was read

    def forward(self, x: Tensor, *, residual: Tensor) -> Tensor:
        return linear_add(self.down, linear_act(self.up, x, act=self.act), residual)  # [T, hidden]: residual + MLP


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, backend: str) -> None:
        super().__init__()
        self.attn = BertAttention(cfg, backend)
        self.attn_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = BertMLP(cfg)
        self.mlp_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int, plan: Any) -> Tensor:
        x = self.attn_norm(self.attn(x, cu_seqlens, max_seqlen, plan, residual=x))  # [T, hidden]: post-norm
        return self.mlp_norm(self.mlp(x, residual=x))  # [T, hidden]


@register("bert")
class BertModel(nn.Module):
    config_class: ClassVar[type] = BertConfig

    # checkpoint names -> ours: the family's table, embedpipe/models/bert_config.py (shared with numpy_bert.py)
    STRIP_PREFIXES: ClassVar[tuple[str, ...]] = BERT_STRIP_PREFIXES
    WEIGHT_MAP: ClassVar[dict[str, str | tuple[str, int] | None]] = BERT_WEIGHT_MAP

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
