"""Model classes keyed by config.json's `model_type`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from torch import nn

M = TypeVar("M", bound=type)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {}
# the modules of embedpipe/models that @register their classes: imported on the first lookup (they import torch;
# the package's torch-free modules, such as st.py and numpy_bert.py, do not need them)
FAMILIES: tuple[str, ...] = ("bert", "xlm_roberta", "modernbert", "qwen3")


def register(*model_types: str) -> Callable[[M], M]:
    """Class decorator: `@register("bert")` makes the loader build this class for that model_type."""

    def deco(cls: M) -> M:
        for name in model_types:
            if name in MODEL_REGISTRY:
                raise ValueError(f"model_type {name!r} is already registered to {MODEL_REGISTRY[name].__name__}")
            MODEL_REGISTRY[name] = cls
        return cls

    return deco


def load_families() -> dict[str, type[nn.Module]]:
    """Import every family module (each registers its classes) once; returns MODEL_REGISTRY."""
    for name in FAMILIES:
        importlib.import_module(f"embedpipe.models.{name}")
    return MODEL_REGISTRY


def model_class(model_type: str | None) -> type[nn.Module]:
    """The class registered for config.json's ``model_type``; the error names the supported ones and the fix."""
    load_families()
    if model_type in MODEL_REGISTRY:
        return MODEL_REGISTRY[model_type]
    problem = "has no model_type" if model_type is None else f"model_type {model_type!r} is not supported"
    raise ValueError(
        f"config.json {problem}; embedpipe implements {', '.join(sorted(MODEL_REGISTRY))}: use a model of one of "
        f"these architectures (a fine-tune keeps its base model's model_type), or add an encoder for it with "
        f"@register in embedpipe/models")
