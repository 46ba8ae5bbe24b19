"""The Python API for notebooks and scripts: ``embed()`` in process, ``Job`` on Ray."""

from embedpipe.api.inprocess import ChunkVectors, embed
from embedpipe.api.job import Job

__all__ = ["ChunkVectors", "Job", "embed"]
