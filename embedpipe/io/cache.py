"""Where embedpipe keeps what it can recompute or fetch again: ``$EMBEDPIPE_CACHE_DIR``, else
``$XDG_CACHE_HOME/embedpipe``, else ``~/.cache/embedpipe`` (file hashes, device peaks, downloaded indexes)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder of this process (read from the environment at each call: tests move it)."""
    base = os.environ.get("EMBEDPIPE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "embedpipe"
    return Path(base).expanduser()
