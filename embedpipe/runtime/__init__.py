"""The encoder replica on one device: texts -> tokens -> packed batches -> vectors.

Importable without Ray or FAISS: the notebook API and the GPU check script use it directly.
On CPU the encoder runs the model eagerly; on CUDA through pinned staging, token buckets and one
CUDA graph per bucket (runners.py), with a warmup guard against an eager float32 copy (warmup.py).
"""

from embedpipe.runtime.encoder import Encoder
from embedpipe.runtime.warmup import WarmupDivergence

__all__ = ["Encoder", "WarmupDivergence"]
