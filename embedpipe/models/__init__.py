"""Packed encoders: registry by model_type, safetensors loader, pooling, sentence-transformers head."""

from embedpipe.models import bert, modernbert, qwen3, xlm_roberta  # noqa: F401  (register their model_types)
from embedpipe.models.head import EmbeddingHead, build_head
from embedpipe.models.loader import LoadedModel, load_model, load_state_dict_into, read_weights
from embedpipe.models.pooling import POOLING_MODES, pool
from embedpipe.models.registry import MODEL_REGISTRY, model_class, register
from embedpipe.models.st import DenseSpec, STSpec, read_st_spec

__all__ = [
    "MODEL_REGISTRY", "POOLING_MODES", "DenseSpec", "EmbeddingHead", "LoadedModel", "STSpec",
    "build_head", "load_model", "load_state_dict_into", "model_class", "pool", "read_st_spec",
    "read_weights", "register",
]
