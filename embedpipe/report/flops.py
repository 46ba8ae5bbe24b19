"""Model FLOPs per token from config.json alone, so the driver needs no weights to report MFU.

The convention is the one of ``BertModel.flops_per_token`` (embedpipe/models/bert.py):

    2 x (weights of every Linear in the layers)  +  4 x layers x heads x head_dim x context

- Linear weights per layer: q (h x heads*hd), k and v (h x kv_heads*hd each), out (heads*hd x h),
  and the MLP: up + down (2 h i), or gate + up + down (3 h i) for gated (SwiGLU) MLPs.
- Attention: QK^T and PV, each 2 x context x head_dim per head per query token.
- context: a bidirectional encoder's query sees all ``seq_len`` keys; a causal model's query at
  position p sees p keys, (seq_len + 1) / 2 on average (``Qwen3Model.flops_per_token`` rounds
  this to seq_len / 2, half a token less); a local-attention layer (ModernBERT) sees at most
  its window, min(seq_len, 2 w + 1).
- causal or not: decoder families are causal unless config.json says ``use_bidirectional_attention:
  true`` or ``is_causal: false`` (the rule of embedpipe/models/qwen3.py); ModernBERT's layers are
  global every ``global_attn_every_n_layers``-th layer (or as ``layer_types`` says), local otherwise.
- Not counted: embeddings, biases, norms, activations, softmax, an LM head, the pooling head.

A run mixes lengths: the attention term summed over a sequence of length L is 4 l H d L^2
(bidirectional), so the exact per-token average is ``flops_per_token_from_config(cfg,
effective_seq_len(...))`` with effective length sum(L^2) / sum(L) over the run's rows (exact for
full attention, causal or not; for local-attention layers an approximation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Arch:
    causal: bool  # decoder-style attention (context (L + 1) / 2) unless the config turns it off
    gated_mlp: bool  # gate + up + down projections (3 h i weights) or up + down (2 h i)
    local_layers: bool = False  # ModernBERT: some layers attend within a window only


# config.json model_type -> attention and MLP shape
ARCHS: dict[str, Arch] = {
    "bert": Arch(causal=False, gated_mlp=False),
    "roberta": Arch(causal=False, gated_mlp=False),
    "xlm-roberta": Arch(causal=False, gated_mlp=False),
    "modernbert": Arch(causal=False, gated_mlp=True, local_layers=True),
    "qwen2": Arch(causal=True, gated_mlp=True),
    "qwen3": Arch(causal=True, gated_mlp=True),
    "bidirectional_pplx_qwen3": Arch(causal=False, gated_mlp=True),  # trained bidirectional whatever its flags
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
    contexts = _contexts(config_json, arch, seq_len, layers)
    return 2.0 * layers * (attn_weights + mlp_weights) + 4.0 * heads * head_dim * sum(contexts)


def _contexts(config_json: dict, arch: Arch, seq_len: float, layers: int) -> list[float]:
    """Keys each query sees, per layer."""
    if is_causal(config_json):
        return [(seq_len + 1) / 2] * layers
    if not arch.local_layers:
        return [float(seq_len)] * layers
    every = config_json.get("global_attn_every_n_layers", 3)
    types = config_json.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                               for i in range(layers)]
    window = 2 * (config_json.get("local_attention", 128) // 2) + 1
    return [float(seq_len) if t == "full_attention" else float(min(seq_len, window)) for t in types]


def is_causal(config_json: dict) -> bool:
    arch = ARCHS.get(config_json.get("model_type", ""))
    if arch is None or not arch.causal:
        return False
    return not (config_json.get("use_bidirectional_attention") is True or config_json.get("is_causal") is False)


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
