"""ModernBERT encoders (ModernBERT-base/large, modernbert-embed, gte-modernbert...) on packed tokens, pure torch.

    input_ids [T], positions [T] (0-based per sequence), cu_seqlens [B+1], max_seqlen -> hidden [T, hidden]

Pre-LN: x = x + Attn(LN(x)); x = x + GeGLU(LN(x)); a final LN. Layer 0 has no attention LN
(the embedding LN precedes it). Rotary positions with one theta for global layers and
another for local ones. Every `global_attn_every_n_layers`-th layer (0, n, 2n, ...) attends
globally; the others see keys with |i - j| <= local_attention // 2, as transformers'
bidirectional sliding-window mask and the original flash-attn window (w, w) do.
No biases unless the config asks for them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from embedpipe.kernels import attention, plan_attention
from embedpipe.models.layers import (
    LayerNorm, activation, apply_rotary, linear_add, rotary_cos_sin,
)
from embedpipe.models.modernbert_config import GLOBAL, LOCAL, ModernBertConfig
from embedpipe.models.registry import register

def _norm(cfg: ModernBertConfig) -> LayerNorm:
    return LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)


class ModernBertAttention(nn.Module):
    def __init__(self, cfg: ModernBertConfig, backend: str, window: int | None) -> None:
        super().__init__()
        self.heads, self.head_dim, self.backend, self.window = cfg.num_heads, cfg.head_dim, backend, window
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)  # rows: q, k, v
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cu_seqlens: Tensor, max_seqlen: int, plan: Any, *,
                residual: Tensor) -> Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.heads, self.head_dim).unbind(1)  # 3 x [T, H, D]
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # [T, H, D]
        o = attention(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=self.window,
                      backend=self.backend, plan=plan)  # [T, H, D]
        return linear_add(self.out, o.reshape(T, self.heads * self.head_dim), residual)  # [T, hidden]: residual + out


class GeGLU(nn.Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # rows: input, gate
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: Tensor, *, residual: Tensor) -> Tensor:
        h, gate = self.up(x).chunk(2, dim=-1)  # 2 x [T, intermediate]
        return linear_add(self.down, self.act(h) * gate, residual)  # [T, hidden]: residual + MLP


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ModernBertConfig, index: int, backend: str) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[index]
        self.attn_norm = nn.Identity() if index == 0 else _norm(cfg)  # layer 0: the embedding LN comes just before
        self.attn = ModernBertAttention(cfg, backend, cfg.local_window if self.layer_type == LOCAL else None)
        self.mlp_norm = _norm(cfg)
        self.mlp = GeGLU(cfg)

    def forward(self, x: Tensor, rope: dict[str, tuple[Tensor, Tensor]], cu_seqlens: Tensor, max_seqlen: int,
                plan: Any) -> Tensor:
        x = self.attn(self.attn_norm(x), rope[self.layer_type], cu_seqlens, max_seqlen, plan, residual=x)  # [T, hidden]
        return self.mlp(self.mlp_norm(x), residual=x)  # [T, hidden]: pre-norm, x + MLP(norm(x))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = _norm(cfg)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.norm(self.tok(input_ids))  # [T, hidden]; positions enter through RoPE


@register("modernbert")
class ModernBertModel(nn.Module):
    config_class: ClassVar[type] = ModernBertConfig

    STRIP_PREFIXES: ClassVar[tuple[str, ...]] = ("model.",)  # ModernBertForX dumps
    # checkpoint name -> ours (the notation: BERT_WEIGHT_MAP in embedpipe/models/bert_config.py)
    WEIGHT_MAP: ClassVar[dict[str, str | tuple[str, int] | None]] = {
        "embeddings.tok_embeddings.weight": "embed.tok.weight",
        "embeddings.norm.weight": "embed.norm.weight",
        "embeddings.norm.bias": "embed.norm.bias",
        "layers.{}.attn_norm.weight": "layers.{}.attn_norm.weight",  # not in layer 0
        "layers.{}.attn_norm.bias": "layers.{}.attn_norm.bias",
        "layers.{}.attn.Wqkv.weight": "layers.{}.attn.qkv.weight",
        "layers.{}.attn.Wqkv.bias": "layers.{}.attn.qkv.bias",
        "layers.{}.attn.Wo.weight": "layers.{}.attn.out.weight",
        "layers.{}.attn.Wo.bias": "layers.{}.attn.out.bias",
        "layers.{}.mlp_norm.weight": "layers.{}.mlp_norm.weight",
        "layers.{}.mlp_norm.bias": "layers.{}.mlp_norm.bias",
        "layers.{}.mlp.Wi.weight": "layers.{}.mlp.up.weight",
        "layers.{}.mlp.Wi.bias": "layers.{}.mlp.up.bias",
        "layers.{}.mlp.Wo.weight": "layers.{}.mlp.down.weight",
        "layers.{}.mlp.Wo.bias": "layers.{}.mlp.down.bias",
        "final_norm.weight": "norm.weight",
        "final_norm.bias": "norm.bias",
        "head.*": None,  # MLM / classifier prediction head (dense + norm)
        "decoder.*": None,  # MLM vocabulary projection
        "classifier.*": None,  # sequence / token classification output
    }

    def __init__(self, config: ModernBertConfig, *, attention_backend: str = "sdpa") -> None:
        super().__init__()
        self.config, self.attention_backend = config, attention_backend
        self.embed = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, attention_backend) for i in range(config.num_layers))
        self.norm = _norm(config)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def forward(self, input_ids: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        c = self.config
        x = self.embed(input_ids)  # [T, hidden]
        rope = {  # in the activation dtype, as transformers applies RoPE
            GLOBAL: rotary_cos_sin(positions, head_dim=c.head_dim, theta=c.global_rope_theta, dtype=x.dtype),
            LOCAL: rotary_cos_sin(positions, head_dim=c.head_dim, theta=c.local_rope_theta, dtype=x.dtype),
        }  # 2 x [T, 1, D/2] each
        plan = plan_attention(cu_seqlens, backend=self.attention_backend)  # once per forward, for every layer
        for layer in self.layers:
            x = layer(x, rope, cu_seqlens, max_seqlen, plan)  # [T, hidden]
        return self.norm(x)  # [T, hidden]

    def flops_per_token(self, seq_len: float) -> float:
        """Forward FLOPs per token at `seq_len`: the family's rule, ModernBertConfig.flops_per_token."""
        return self.config.flops_per_token(seq_len)
