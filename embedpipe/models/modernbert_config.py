"""ModernBERT's facts, torch-free: its config (layer types, RoPE thetas, local window, pooling) and FLOPs rule.

The packed torch encoder (embedpipe/models/modernbert.py) and the driver's checks (preflight, the report's FLOPs)
read config.json through this one class; the driver never imports torch for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embedpipe.models.activations import check_activation
from embedpipe.models.flops import attention_flops

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
    hidden_act: str = "gelu"  # one of models/activations.py: ACTIVATION_NAMES, applied to the GeGLU input half
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
    def default_pooling(self) -> str:
        """The pooling when the directory has no Pooling module: config.json's classifier_pooling."""
        return self.pooling

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
        check_activation(act)  # fail at planning, not mid-batch
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
