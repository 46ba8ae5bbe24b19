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

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from embedpipe.kernels import attention, plan_attention
from embedpipe.models.flops import attention_flops
from embedpipe.models.layers import (
    LayerNorm, activation, apply_rotary, rotary_cos_sin,
)
from embedpipe.models.registry import register

GLOBAL, LOCAL = "full_attention", "sliding_attention"  # transformers' layer_types names


def _rope_theta(hf: dict[str, Any], layer_type: str, legacy_key: str, default: float) -> float:
    """transformers 5.x: rope_parameters[layer_type]["rope_theta"]; older configs: global_/local_rope_theta."""
    params = (hf.get("rope_parameters") or {}).get(layer_type) or {}
    kind = params.get("rope_type", "default")
    if kind != "default" or hf.get("rope_scaling"):
        raise ValueError(f"ModernBERT rope_type {kind!r} / rope_scaling is not supported (only 'default' RoPE)")
    return float(params.get("rope_theta", hf.get(legacy_key, default)))


@dataclass(frozen=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # per layer: "full_attention" (global) or "sliding_attention" (local)
    max_positions: int = 8192  # trained context; RoPE itself has no table to run out of
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "gelu"  # key of models.layers.ACTIVATIONS, applied to the GeGLU input half
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    local_window: int = 64  # local layers: keys with |i - j| <= local_window (= local_attention // 2)
    pooling: str = "cls"  # config.json classifier_pooling: the class's pooling when no ST Pooling module

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_seq_len(self) -> int:
        return self.max_positions

    @property
    def linear_weights(self) -> int:
        """Weights of every Linear in the layers: Wqkv 3h^2, Wo h^2, Wi 2hi, Wo hi per layer."""
        h, i = self.hidden_size, self.intermediate_size
        return self.num_layers * (4 * h * h + 3 * h * i)

    def flops_per_token(self, seq_len: float) -> float:
        """The family's FLOPs rule (embedpipe.report.flops): forward FLOPs per token at `seq_len`.

        2 * linear_weights + 4 * hidden * context per layer (QK^T and PV), bidirectional: context =
        seq_len on global layers and min(seq_len, 2w + 1) on local layers (w = local_attention // 2;
        the few queries within w of a sequence edge see fewer keys, which this upper bound ignores).
        Not counted: embedding lookup, LayerNorm, GELU, RoPE, softmax.
        """
        local = min(seq_len, 2 * self.local_window + 1)
        contexts = [seq_len if t == GLOBAL else local for t in self.layer_types]
        return 2.0 * self.linear_weights + sum(
            attention_flops(layers=1, heads=self.num_heads, head_dim=self.head_dim, context=n) for n in contexts)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModernBertConfig:
        n_layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
        if hf["hidden_size"] % heads:
            raise ValueError(f"hidden_size {hf['hidden_size']} is not divisible by num_attention_heads {heads}")
        every = hf.get("global_attn_every_n_layers", 3)  # pre-5.x configs; 5.x saves layer_types
        types = tuple(hf.get("layer_types") or (LOCAL if i % every else GLOBAL for i in range(n_layers)))
        if len(types) != n_layers or set(types) - {GLOBAL, LOCAL}:
            raise ValueError(f"layer_types {list(types)} must give {GLOBAL!r} or {LOCAL!r} for each of {n_layers} layers")
        act = hf.get("hidden_activation", "gelu")
        activation(act)  # fail at load time, not mid-batch
        pooling = hf.get("classifier_pooling", "cls")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=n_layers,
            num_heads=heads,
            intermediate_size=hf["intermediate_size"],
            layer_types=types,
            max_positions=hf.get("max_position_embeddings", 8192),
            norm_eps=hf.get("norm_eps", 1e-5),
            norm_bias=hf.get("norm_bias", False),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            hidden_act=act,
            global_rope_theta=_rope_theta(hf, GLOBAL, "global_rope_theta", 160_000.0),
            local_rope_theta=_rope_theta(hf, LOCAL, "local_rope_theta", 10_000.0),
            local_window=hf.get("local_attention", 128) // 2,
            pooling=pooling if pooling in ("cls", "mean") else "cls",
        )


def _norm(cfg: ModernBertConfig) -> LayerNorm:
    return LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)


class ModernBertAttention(nn.Module):
    def __init__(self, cfg: ModernBertConfig, backend: str, window: int | None) -> None:
        super().__init__()
        self.heads, self.head_dim, self.backend, self.window = cfg.num_heads, cfg.head_dim, backend, window
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)  # rows: q, k, v
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cu_seqlens: Tensor, max_seqlen: int, plan: Any) -> Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.heads, self.head_dim).unbind(1)  # 3 x [T, H, D]
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # [T, H, D]
        o = attention(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=self.window,
                      backend=self.backend, plan=plan)  # [T, H, D]
        return self.out(o.reshape(T, self.heads * self.head_dim))  # [T, hidden]


class GeGLU(nn.Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # rows: input, gate
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        h, gate = self.up(x).chunk(2, dim=-1)  # 2 x [T, intermediate]
        return self.down(self.act(h) * gate)  # [T, hidden]


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
        x = x + self.attn(self.attn_norm(x), rope[self.layer_type], cu_seqlens, max_seqlen, plan)  # [T, hidden]
        return x + self.mlp(self.mlp_norm(x))  # [T, hidden]


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
        self.default_pooling = config.pooling  # when the directory has no Pooling module
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
