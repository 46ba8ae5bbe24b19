"""The ``hidden_act`` names embedpipe implements, torch-free: a config is checked against them when it is read
(on the driver too), before any torch encoder is built. The functions behind them are the torch encoder's
(embedpipe/models/layers.py: ACTIVATIONS) and the numpy query encoder's (numpy_bert.py: NUMPY_ACTIVATIONS);
both tables have exactly these keys (tests/test_numpy_query.py pins it).
"""

from __future__ import annotations

# config.json `hidden_act` names, as transformers' ACT2FN spells them
ACTIVATION_NAMES: tuple[str, ...] = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish")


def check_activation(name: str) -> str:
    """``name`` when embedpipe implements it; else the error names the ones it does."""
    if name not in ACTIVATION_NAMES:
        raise ValueError(f"activation {name!r} is not supported; known: {sorted(ACTIVATION_NAMES)}")
    return name
