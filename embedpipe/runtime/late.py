"""Late chunking (input.chunking.mode: late): one forward pass over each whole document, then each chunk's vector
pooled from its own token span of that pass.

    documents -> Chunker (spans, as in split mode) -> plan_windows: the document as one sequence when it fits
    model.max_seq_len, else windows of it sharing the overlap, each holding whole chunks -> pack -> forward
    (token states [T, H]) -> per chunk: its rows of its window's states gathered -> the head (pool, Dense,
    normalize) over those rows -> [C, D]

An empty document's one chunk has no tokens: it is pooled over its whole sequence (its special tokens), the
vector split mode gives it.
"""

from __future__ import annotations

import numpy as np
import torch

from embedpipe.ranges import bounds, ranges
from embedpipe.report.counters import Counters
from embedpipe.text.chunking import Chunked, Chunker, Chunks, concat_chunks, frame_spans, plan_windows


class LatePooler:
    """Built once by the encoder (model, a head without the prompt skip, packer, chunker); called per list of
    documents."""

    def __init__(self, *, model: torch.nn.Module, head: torch.nn.Module, packer, chunker: Chunker, device: str,
                 context: int, dim: int, sort_window: int):
        self.model, self.head, self.packer, self.chunker = model, head, packer, chunker
        self.device, self.dim, self.sort_window = torch.device(device), dim, sort_window
        self.budget = context - chunker.tokenizer.framing  # text tokens per window
        self.lead = len(chunker.tokenizer.prefix) + len(chunker.tokenizer.prompt_ids)  # tokens before the text

    def __call__(self, texts: list[str], counters: Counters, *, per_window: list | None = None,
                 chunked: Chunked | None = None) -> tuple[Chunks, np.ndarray]:
        """``per_window``: given, each sort window's (document [W] into ``texts``, tokens [W]) of its forward
        passes is appended. ``chunked``: the chunker's output for ``texts``, when the caller chunked them already."""
        plans, outs = [], []
        for start in range(0, len(texts), self.sort_window):
            with counters.time("tokenize"):
                stop = start + self.sort_window
                docs, chunks = self.chunker.chunk_range(texts, start=start, stop=stop, given=chunked)
                windows = plan_windows(chunks, budget=self.budget)
                tok = frame_spans(self.chunker.tokenizer, docs, windows.doc, windows.first, windows.stop)
            with counters.time("pack"):
                batches = self.packer(tok)
            with counters.time("encode"):
                out = np.empty((len(chunks), self.dim), dtype=np.float32)
                for batch in batches:
                    self._encode(batch, chunks, windows, out)
                    counters.padded_tokens += batch.num_tokens
            counters.tokens += int(tok.lengths.sum())
            counters.tokens_squared += int((tok.lengths ** 2).sum())
            if per_window is not None:
                per_window.append((windows.doc + start, tok.lengths))
            plans.append(chunks)
            outs.append(out)
        chunks = concat_chunks(plans, offsets=range(0, len(texts), self.sort_window))
        return chunks, (np.concatenate(outs) if outs else np.empty((0, self.dim), dtype=np.float32))

    @torch.inference_mode()
    def _encode(self, batch, chunks: Chunks, windows, out: np.ndarray) -> None:
        """One packed batch of windows: forward, then each of their chunks pooled from its own rows."""
        dev = self.device
        cu = batch.cu_seqlens.to(dev)
        hidden = self.model(batch.input_ids.to(dev), batch.positions.to(dev), cu, batch.max_seqlen)  # [T, H]
        where = np.full(len(windows.doc), -1, dtype=np.int64)
        where[batch.rows] = np.arange(len(batch.rows))  # window -> its sequence in this batch
        sel = np.flatnonzero(where[windows.of_chunk] >= 0)  # [S] the chunks of this batch's windows
        w = windows.of_chunk[sel]
        seq = batch.cu_seqlens.numpy().astype(np.int64)
        begin, finish = seq[where[w]], seq[where[w] + 1]  # [S] each chunk's window sequence
        start = begin + self.lead + chunks.first[sel] - windows.first[w]  # [S] the chunk's first row
        end = start + chunks.stop[sel] - chunks.first[sel]
        empty = end == start  # an empty document: its whole sequence
        start, end = np.where(empty, begin, start), np.where(empty, finish, end)
        lengths = end - start
        rows = ranges(start, lengths)  # [R]
        span_cu = torch.from_numpy(bounds(lengths).astype(np.int32)).to(dev)  # [S+1]
        vectors = self.head(hidden[torch.from_numpy(rows).to(dev)], span_cu)  # [S, D]
        out[sel] = vectors.to("cpu", torch.float32).numpy()
