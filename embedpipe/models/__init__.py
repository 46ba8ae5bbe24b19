"""Packed encoders: registry by model_type, safetensors loader, pooling, sentence-transformers head.

The names below load lazily (PEP 562), so that importing one of the package's torch-free modules (st.py,
resolve.py, bert_config.py, checkpoint.py, numpy_bert.py: a cold ``embedpipe search``) does not import torch;
a name of a torch module imports every family first (each registers its model_types).
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES: dict[str, str] = {
    "EmbeddingHead": "head", "build_head": "head",
    "LoadedModel": "loader", "load_model": "loader", "load_state_dict_into": "loader", "read_weights": "loader",
    "POOLING_MODES": "pooling", "pool": "pooling",
    "MODEL_REGISTRY": "registry", "model_class": "registry", "register": "registry",
    "DenseSpec": "st", "STSpec": "st", "read_st_spec": "st",
}
_TORCH_FREE = ("st",)

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'embedpipe.models' has no attribute {name!r}")
    module = _NAMES[name]
    if module not in _TORCH_FREE:
        from embedpipe.models.registry import load_families

        load_families()
    return getattr(importlib.import_module(f"embedpipe.models.{module}"), name)
