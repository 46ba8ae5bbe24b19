"""Qwen3's facts, torch-free: its config (heads, RoPE theta, causal or bidirectional) and FLOPs rule.

The packed torch encoder (embedpipe/models/qwen3.py) and the driver's checks (preflight, the report's FLOPs)
read config.json through this one class; the driver never imports torch for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embedpipe.models.activations import check_activation
from embedpipe.models.flops import attention_flops

# model_types whose checkpoints were trained bidirectionally whatever their flags say
BIDIRECTIONAL_MODEL_TYPES: frozenset[str] = frozenset({"bidirectional_pplx_qwen3"})


def _rope_theta(hf: dict[str, Any]) -> float:
    """transformers 5.x saves rope_parameters {"rope_type", "rope_theta"}; 4.x saved rope_theta (+ rope_scaling)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"Qwen3 rope_type {kind!r} is not supported (only 'default' RoPE); see config.json rope_parameters")
    return float(params.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))


def _causal(hf: dict[str, Any]) -> bool:
    if hf.get("model_type") in BIDIRECTIONAL_MODEL_TYPES:
        return False
    return not (hf.get("use_bidirectional_attention") is True or hf.get("is_causal") is False)


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # Qwen3 sets it explicitly: 0.6B has 16 heads x 128 = 2048 > hidden 1024
    intermediate_size: int
    max_positions: int = 32768  # trained context; RoPE itself has no table to run out of
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    hidden_act: str = "silu"  # one of models/activations.py: ACTIVATION_NAMES, applied to the gate half
    causal: bool = True  # False: every token sees its whole sequence (pplx-embed style)

    @property
    def max_seq_len(self) -> int:
        return self.max_positions

    @property
    def default_pooling(self) -> str:
        """The pooling when the directory has no Pooling module: only the last token has seen a causal
        sequence whole."""
        return "last" if self.causal else "mean"

    @property
    def linear_weights(self) -> int:
        """Weights of every Linear in the layers: q, k, v, o = 2h(H + Hkv)D, gate, up, down = 3hi per layer."""
        h, i, D = self.hidden_size, self.intermediate_size, self.head_dim
        return self.num_layers * (2 * h * (self.num_heads + self.num_kv_heads) * D + 3 * h * i)

    def flops_per_token(self, seq_len: float) -> float:
        """The family's FLOPs rule (embedpipe.report.flops): forward FLOPs per token at `seq_len`.

        2 * linear_weights + 4 * layers * H * D * context (QK^T and PV). Causal: a query sees
        (seq_len + 1) / 2 keys on average (query i sees i + 1 keys); bidirectional: seq_len.
        Not counted: embedding lookup, RMSNorms, SiLU, RoPE, softmax; there is no LM head.
        Qwen3-0.6B (h 1024, 28 layers, H 16, Hkv 8, D 128, i 3072), causal, seq 512:
        2 * 28 * (2*1024*(16+8)*128 + 3*1024*3072) + 4 * 28 * 16 * 128 * 256.5 = 939.6 MFLOP/token.
        """
        context = (seq_len + 1) / 2 if self.causal else seq_len
        return 2.0 * self.linear_weights + attention_flops(
            layers=self.num_layers, heads=self.num_heads, head_dim=self.head_dim, context=context)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Qwen3Config:
        heads = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        if heads % kv:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
        if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
            raise ValueError("Qwen3 sliding-window layers (use_sliding_window / layer_types) are not supported; "
                             "set use_sliding_window: false if the checkpoint was trained with full attention")
        act = hf.get("hidden_act", "silu")
        check_activation(act)  # fail at planning, not mid-batch
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            max_positions=hf.get("max_position_embeddings", 32768),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            attention_bias=hf.get("attention_bias", False),
            hidden_act=act,
            causal=_causal(hf),
        )
