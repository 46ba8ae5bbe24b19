"""Model classes keyed by config.json's `model_type` (the types and their configs: embedpipe/models/families.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, TypeVar

from embedpipe.models.families import FAMILIES, family

if TYPE_CHECKING:
    from torch import nn

M = TypeVar("M", bound=type)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {}


def register(*model_types: str) -> Callable[[M], M]:
    """Class decorator: `@register("bert")` makes the loader build this class for that model_type, which
    families.py must list with this class's config_class."""

    def deco(cls: M) -> M:
        for name in model_types:
            if name not in FAMILIES or FAMILIES[name].config_class is not cls.config_class:
                raise ValueError(f"model_type {name!r}: add it to embedpipe/models/families.py with config class "
                                 f"{cls.config_class.__name__} and module {cls.__module__.rsplit('.', 1)[-1]!r}")
            if name in MODEL_REGISTRY:
                raise ValueError(f"model_type {name!r} is already registered to {MODEL_REGISTRY[name].__name__}")
            MODEL_REGISTRY[name] = cls
        return cls

    return deco


def load_families() -> dict[str, type[nn.Module]]:
    """Import every family's encoder module (each registers its classes) once; returns MODEL_REGISTRY."""
    for module in sorted({f.module for f in FAMILIES.values()}):
        importlib.import_module(f"embedpipe.models.{module}")
    return MODEL_REGISTRY


def model_class(model_type: str | None) -> type[nn.Module]:
    """The torch class registered for config.json's ``model_type``; the error names the supported ones and the fix."""
    importlib.import_module(f"embedpipe.models.{family(model_type).module}")
    return MODEL_REGISTRY[model_type]
