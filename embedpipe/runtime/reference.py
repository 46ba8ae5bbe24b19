"""The warmup guard's float32 reference vectors, kept on this machine so that a worker's start computes them once.

The guard (runtime/warmup.py) compares a worker's fast path with an eager float32 copy of the model on a fixed
sample. Loading that copy and running it are most of the guard's cost (MiniLM in bf16 on 2 CPU cores: about 0.4 of
its 0.57 s, in every worker's start), and they give the same vectors to every worker that feeds the same tokens
through the same files and code. So the vectors are kept in ``$EMBEDPIPE_CACHE_DIR/warmup/<key>.npy``. The fast
path still runs and is compared at every start.

The key covers what the reference's vectors depend on: the model's files (their folder, names, sizes, times and
inodes: the staleness rule of the file-hash cache, io/manifest.py HashCache, without reading gigabytes of weights),
the sample's packed tokens, the head's settings, the device kind, torch's version, and embedpipe's sources (the digest
the worker's code identity uses, embedpipe/sources.py: hashed once per process). A kept file is only ever believed when the fast path agrees with it: on
a divergence the guard computes the reference again before it fails a worker. A cache that cannot be written or
read is skipped (the reference is then computed at every start, as before).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from embedpipe.io.cache import cache_dir
from embedpipe.io.manifest import model_files
from embedpipe.sources import own_sources_sha256
from embedpipe.text.packer import Batch

log = logging.getLogger(__name__)


def reference_key(*, model_dir: Path, batches: list[Batch], head: str, device: str) -> str:
    """sha256 (hex) of what the reference vectors of ``batches`` depend on; ``head``: the head's settings, as text."""
    digest = hashlib.sha256()

    def add(*parts: object) -> None:
        for part in parts:
            digest.update(str(part).encode() + b"\0")

    model_dir = Path(model_dir).resolve()
    add(model_dir, head, torch.device(device).type, torch.__version__, own_sources_sha256())
    for path in model_files(model_dir):
        stat = path.stat()
        add(path.relative_to(model_dir).as_posix(), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    for b in batches:
        for tensor in (b.input_ids, b.positions, b.cu_seqlens):
            digest.update(tensor.cpu().numpy().tobytes())
        digest.update(np.asarray(b.rows, dtype=np.int64).tobytes())
    return digest.hexdigest()


def _path(key: str) -> Path:
    return cache_dir() / "warmup" / f"{key}.npy"


def load_reference(key: str) -> Tensor | None:
    """The kept vectors of ``key`` ([rows, D] float32), or None (none kept, or unreadable)."""
    try:
        return torch.from_numpy(np.load(_path(key), allow_pickle=False))
    except (OSError, ValueError, EOFError):  # none kept, or a damaged file (an empty one raises EOFError)
        return None


def keep_reference(key: str, vectors: Tensor) -> None:
    """Keep ``vectors`` ([rows, D] float32) under ``key``: written whole to a temporary name, then renamed."""
    path = _path(key)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(tmp, vectors.float().cpu().numpy(), allow_pickle=False)
        os.replace(tmp, path)
    except OSError as exc:
        log.info("warmup guard: reference vectors not kept in %s (%s)", path.parent, exc)
        tmp.unlink(missing_ok=True)
