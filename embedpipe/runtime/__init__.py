"""The encoder replica on one device: texts -> tokens -> packed batches -> vectors.

Importable without Ray or FAISS: the notebook API and the GPU check script use it directly.
"""

from embedpipe.runtime.encoder import Encoder, EncoderSettings

__all__ = ["Encoder", "EncoderSettings"]
