"""Model classes keyed by config.json's `model_type`."""

from __future__ import annotations

from typing import Callable, TypeVar

from torch import nn

M = TypeVar("M", bound=type[nn.Module])

MODEL_REGISTRY: dict[str, type[nn.Module]] = {}


def register(*model_types: str) -> Callable[[M], M]:
    """Class decorator: `@register("bert")` makes the loader build this class for that model_type."""

    def deco(cls: M) -> M:
        for name in model_types:
            if name in MODEL_REGISTRY:
                raise ValueError(f"model_type {name!r} is already registered to {MODEL_REGISTRY[name].__name__}")
            MODEL_REGISTRY[name] = cls
        return cls

    return deco


def model_class(model_type: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported; embedpipe implements {sorted(MODEL_REGISTRY)}"
        ) from None
