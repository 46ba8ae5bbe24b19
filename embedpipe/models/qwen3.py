"""Qwen3 decoders as embedders (Qwen3-Embedding, pplx-embed...) on packed tokens, pure torch.

    input_ids [T], positions [T] (0-based per sequence), cu_seqlens [B+1], max_seqlen -> hidden [T, hidden]

Pre-RMSNorm: x = x + Attn(norm(x)); x = x + SwiGLU(norm(x)); a final RMSNorm. Attention:
GQA (num_key_value_heads), per-head RMSNorm on q and k before RoPE, no biases by default.
Causal as trained for generation (Qwen3-Embedding: last-token pooling), or bidirectional
when config.json says so (pplx-embed: `use_bidirectional_attention: true`; also accepted:
`is_causal: false`), then mean pooling by default.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from embedpipe.kernels import attention, plan_attention
from embedpipe.models.layers import (
    RMSNorm, activation, apply_rotary, linear_add, rotary_cos_sin,
)
from embedpipe.models.qwen3_config import BIDIRECTIONAL_MODEL_TYPES, Qwen3Config
from embedpipe.models.registry import register


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, backend: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.causal, self.backend = cfg.causal, backend
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q_width + 2 * kv_width, bias=cfg.attention_bias)  # rows: q, k, v
        self.out = nn.Linear(q_width, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cu_seqlens: Tensor, max_seqlen: int, plan: Any, *,
                residual: Tensor) -> Tensor:
        T, H, Hkv, D = x.shape[0], self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)  # [T, H*D], 2 x [T, Hkv*D]
        q = apply_rotary(self.q_norm(q.view(T, H, D)), *rope)  # [T, H, D]
        k = apply_rotary(self.k_norm(k.view(T, Hkv, D)), *rope)  # [T, Hkv, D]
        o = attention(q, k, v.view(T, Hkv, D), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, causal=self.causal,
                      backend=self.backend, plan=plan)  # [T, H, D]
        return linear_add(self.out, o.reshape(T, H * D), residual)  # [T, hidden]: residual + out


class SwiGLU(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # rows: gate, up
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: Tensor, *, residual: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # 2 x [T, intermediate]
        return linear_add(self.down, self.act(gate) * up, residual)  # [T, hidden]: residual + MLP


class Qwen3Layer(nn.Module):
    def __init__(self, cfg: Qwen3Config, backend: str) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attn = Qwen3Attention(cfg, backend)
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cu_seqlens: Tensor, max_seqlen: int, plan: Any) -> Tensor:
        x = self.attn(self.attn_norm(x), rope, cu_seqlens, max_seqlen, plan, residual=x)  # [T, hidden]: x + attn(norm(x))
        return self.mlp(self.mlp_norm(x), residual=x)  # [T, hidden]


@register("qwen3", *sorted(BIDIRECTIONAL_MODEL_TYPES))
class Qwen3Model(nn.Module):
    config_class: ClassVar[type] = Qwen3Config

    STRIP_PREFIXES: ClassVar[tuple[str, ...]] = ("model.",)  # Qwen3ForCausalLM dumps; Qwen3Model has none
    # checkpoint name -> ours (the notation: BERT_WEIGHT_MAP in embedpipe/models/bert_config.py)
    WEIGHT_MAP: ClassVar[dict[str, str | tuple[str, int] | None]] = {
        "embed_tokens.weight": "embed.weight",
        "layers.{}.input_layernorm.weight": "layers.{}.attn_norm.weight",
        "layers.{}.self_attn.q_proj.weight": ("layers.{}.attn.qkv.weight", 0),
        "layers.{}.self_attn.k_proj.weight": ("layers.{}.attn.qkv.weight", 1),
        "layers.{}.self_attn.v_proj.weight": ("layers.{}.attn.qkv.weight", 2),
        "layers.{}.self_attn.q_proj.bias": ("layers.{}.attn.qkv.bias", 0),
        "layers.{}.self_attn.k_proj.bias": ("layers.{}.attn.qkv.bias", 1),
        "layers.{}.self_attn.v_proj.bias": ("layers.{}.attn.qkv.bias", 2),
        "layers.{}.self_attn.o_proj.weight": "layers.{}.attn.out.weight",
        "layers.{}.self_attn.o_proj.bias": "layers.{}.attn.out.bias",
        "layers.{}.self_attn.q_norm.weight": "layers.{}.attn.q_norm.weight",
        "layers.{}.self_attn.k_norm.weight": "layers.{}.attn.k_norm.weight",
        "layers.{}.post_attention_layernorm.weight": "layers.{}.mlp_norm.weight",
        "layers.{}.mlp.gate_proj.weight": ("layers.{}.mlp.gate_up.weight", 0),
        "layers.{}.mlp.up_proj.weight": ("layers.{}.mlp.gate_up.weight", 1),
        "layers.{}.mlp.down_proj.weight": "layers.{}.mlp.down.weight",
        "norm.weight": "norm.weight",
        "lm_head.*": None,  # Qwen3ForCausalLM's vocabulary projection
        "score.*": None,  # Qwen3ForSequenceClassification / reranker heads
    }

    def __init__(self, config: Qwen3Config, *, attention_backend: str = "sdpa") -> None:
        super().__init__()
        self.config, self.attention_backend = config, attention_backend
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(config, attention_backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def forward(self, input_ids: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        x = self.embed(input_ids)  # [T, hidden]
        rope = rotary_cos_sin(positions, head_dim=self.config.head_dim, theta=self.config.rope_theta,
                              dtype=x.dtype)  # 2 x [T, 1, D/2], in the activation dtype as transformers applies RoPE
        plan = plan_attention(cu_seqlens, backend=self.attention_backend)  # once per forward, for every layer
        for layer in self.layers:
            x = layer(x, rope, cu_seqlens, max_seqlen, plan)  # [T, hidden]
        return self.norm(x)  # [T, hidden]

    def flops_per_token(self, seq_len: float) -> float:
        """Forward FLOPs per token at `seq_len`: the family's rule, Qwen3Config.flops_per_token."""
        return self.config.flops_per_token(seq_len)
