"""Model FLOPs per token from config.json alone, so the driver needs no weights to report MFU.

One rule per family, and it is the family's own: each model family's config dataclass counts its
FLOPs (``BertConfig.flops_per_token``, ``Qwen3Config``, ``ModernBertConfig``; XLM-RoBERTa shares
BERT's), and the model, the loaded model, this module, ``scripts/gpu_check.py`` and
``scripts/bench_cpu.py`` all ask it. This module parses config.json into that dataclass through the
model registry, so it knows exactly the families embedpipe can load (``families()``) and refuses
any other model_type by name. The convention:

    2 x (weights of every Linear in the layers)  +  4 x heads x head_dim x context, summed over layers

- Attention: QK^T and PV, each 2 x context x head_dim per head per query token.
- context: a bidirectional encoder's query sees all ``seq_len`` keys; a causal model's query at
  position p sees p keys, (seq_len + 1) / 2 on average; a local-attention layer (ModernBERT) sees
  at most its window, min(seq_len, 2 w + 1).
- Not counted: embeddings, biases, norms, activations, softmax, an LM head, the pooling head.

A run mixes lengths: the attention term summed over a sequence of length L is 4 l H d L^2
(bidirectional), so the exact per-token average is ``flops_per_token_from_config(cfg,
effective_seq_len(...))`` with effective length sum(L^2) / sum(L) over the run's rows (exact for
full attention, causal or not; for local-attention layers an approximation).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def families() -> list[str]:
    """The config.json model_types with a FLOPs rule: those embedpipe can load."""
    from embedpipe.models.families import FAMILIES

    return sorted(FAMILIES)


def family_config(config_json: dict) -> Any:
    """config.json parsed by its family (e.g. a BertConfig), torch-free; ValueError names an unknown model_type."""
    from embedpipe.models import families

    # the embedding table is not counted: a config without vocab_size still has a FLOPs count
    return families.family_config({"vocab_size": 1, **config_json})


def flops_per_token_from_config(config_json: dict, seq_len: float) -> float:
    """Forward FLOPs per token of the encoder described by a Hugging Face config.json, at ``seq_len``."""
    return float(family_config(config_json).flops_per_token(seq_len))


def is_causal(config_json: dict) -> bool:
    """Whether the family runs this config with causal attention (Qwen3 unless the config turns it off)."""
    return bool(getattr(family_config(config_json), "causal", False))


def effective_seq_len(*, tokens: int, tokens_squared: int) -> float:
    """The length at which per-token FLOPs equal the run's average: sum(L^2) / sum(L)."""
    return tokens_squared / tokens if tokens else 0.0


def read_model_config(model_dir: str | Path, *, transformer_dir: str | None = None) -> dict:
    """config.json of the transformer in a resolved model directory (``embedpipe/preflight.py`` resolves
    ``model.path`` once per run and keeps the result): its sentence-transformers Transformer module's
    folder, ``transformer_dir`` (None: as ``models/st.py`` reads it from modules.json), else the directory."""
    root = Path(model_dir)
    if transformer_dir is None:
        from embedpipe.models.st import read_st_spec

        transformer_dir = read_st_spec(root).transformer_dir
    return json.loads((root / transformer_dir / "config.json").read_text())
