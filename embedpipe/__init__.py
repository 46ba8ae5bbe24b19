"""embedpipe: offline batch embedding on Ray — Parquet in, packed encoders, vectors and indexes out.

Importing the package is cheap: torch, Ray and FAISS load only when a function needs them.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "embed": ("embedpipe.api", "embed"),
    "ChunkVectors": ("embedpipe.api", "ChunkVectors"),
    "Job": ("embedpipe.api", "Job"),
    "load_job": ("embedpipe.config", "load_job"),
    "JobSpec": ("embedpipe.config", "JobSpec"),
    "run_job": ("embedpipe.cluster.driver", "run_job"),
    "Encoder": ("embedpipe.runtime", "Encoder"),
    "open_index": ("embedpipe.index.search", "open_index"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'embedpipe' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
