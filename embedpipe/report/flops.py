"""Model FLOPs per token from config.json alone, so the driver needs no weights to report MFU.

The convention is the one of ``BertModel.flops_per_token`` (embedpipe/models/bert.py):

    2 x (weights of every Linear in the layers)  +  4 x layers x heads x head_dim x context

- Linear weights per layer: q (h x heads*hd), k and v (h x kv_heads*hd each), out (heads*hd x h),
  and the MLP: up + down (2 h i), or gate + up + down (3 h i) for gated (SwiGLU) MLPs.
- Attention: QK^T and PV, each 2 x context x head_dim per head per query token.
- context: a bidirectional encoder's query sees all ``seq_len`` keys; a causal model's query at
  position p sees p keys, (seq_len + 1) / 2 on average.
- Not counted: embeddings, biases, norms, activations, softmax, an LM head, the pooling head.

A run mixes lengths: the attention term summed over a sequence of length L is 4 l H d L^2
(bidirectional), so the exact per-token average is ``flops_per_token_from_config(cfg,
effective_seq_len(...))`` with effective length sum(L^2) / sum(L) over the run's rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Arch:
    causal: bool  # decoder-style attention (context (L + 1) / 2) or bidirectional (context L)
    gated_mlp: bool  # gate + up + down projections (3 h i weights) or up + down (2 h i)


# config.json model_type -> attention and MLP shape
ARCHS: dict[str, Arch] = {
    "bert": Arch(causal=False, gated_mlp=False),
    "roberta": Arch(causal=False, gated_mlp=False),
    "xlm-roberta": Arch(causal=False, gated_mlp=False),
    "qwen2": Arch(causal=True, gated_mlp=True),
    "qwen3": Arch(causal=True, gated_mlp=True),
    "llama": Arch(causal=True, gated_mlp=True),
    "mistral": Arch(causal=True, gated_mlp=True),
}


def flops_per_token_from_config(config_json: dict, seq_len: float) -> float:
    """Forward FLOPs per token of the encoder described by a Hugging Face config.json, at ``seq_len``."""
    model_type = config_json.get("model_type", "<missing>")
    if model_type not in ARCHS:
        raise ValueError(f"config.json model_type {model_type!r}: no FLOPs count; known: {sorted(ARCHS)}")
    arch = ARCHS[model_type]
    h, layers = config_json["hidden_size"], config_json["num_hidden_layers"]
    heads = config_json["num_attention_heads"]
    kv_heads = config_json.get("num_key_value_heads") or heads
    head_dim = config_json.get("head_dim") or h // heads
    inter = config_json["intermediate_size"]
    attn_weights = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h  # q, k, v, out
    mlp_weights = (3 if arch.gated_mlp else 2) * h * inter
    context = (seq_len + 1) / 2 if arch.causal else seq_len
    return 2.0 * layers * (attn_weights + mlp_weights) + 4.0 * layers * heads * head_dim * context


def is_causal(config_json: dict) -> bool:
    arch = ARCHS.get(config_json.get("model_type", ""))
    return bool(arch and arch.causal)


def effective_seq_len(*, tokens: int, tokens_squared: int) -> float:
    """The length at which per-token FLOPs equal the run's average: sum(L^2) / sum(L)."""
    return tokens_squared / tokens if tokens else 0.0


def read_model_config(model_path: str) -> dict:
    """config.json of the transformer in a model directory (a sentence-transformers folder's
    Transformer module, or the directory itself), resolved offline like the workers do."""
    from embedpipe.models.resolve import resolve_model_path

    root = resolve_model_path(model_path)
    sub = ""
    modules = root / "modules.json"
    if modules.is_file():
        sub = next((m.get("path", "") for m in json.loads(modules.read_text())
                    if m.get("type", "").rsplit(".", 1)[-1] == "Transformer"), "")
    return json.loads((Path(root) / sub / "config.json").read_text())
