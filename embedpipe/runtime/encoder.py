"""An encoder replica: built once (model, head, tokenizer, packer on one device), called per batch."""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from typing import Any, Callable

import numpy as np
import torch

from embedpipe.config import (BatchingConfig, ChunkingConfig, JobError, JobSpec, ModelConfig, RuntimeConfig,
                              resolve_dtype)
from embedpipe.kernels.attention import PADDED_ROWS
from embedpipe.models import load_model
from embedpipe.models.defaults import effective_max_seq_len
from embedpipe.models.resolve import resolve_model_path
from embedpipe.models.st import resolve_prompt
from embedpipe.report.counters import Counters, DocumentCost
from embedpipe.runtime.cpu import keep_freed_memory, padded_rows, place_linears
from embedpipe.runtime.late import LatePooler
from embedpipe.runtime.prefetch import Prefetcher
from embedpipe.runtime.runners import build_runner
from embedpipe.runtime.warmup import warmup_guard
from embedpipe.text.chunking import Chunked, Chunker, Chunks, concat_chunks
from embedpipe.text.packer import Batch, TokenPacker
from embedpipe.text.tokenizer import Tokenized, TextTokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Window = tuple[int, Tokenized, list[Batch]]  # (first row, its tokens, its packed batches): one sort window
ENCODER_SECTIONS = ("model", "batching", "runtime")  # the job sections an encoder reads, with output.dim


def matmul_precision(*, tf32: bool, dtype: str, device: str) -> str | None:
    """torch.set_float32_matmul_precision's value when runtime.tf32 asks for TF32 (a float32 model on CUDA), else
    None: torch's own setting stays (full float32 unless the process changed it)."""
    return "high" if tf32 and dtype == "float32" and torch.device(device).type == "cuda" else None


class Encoder:
    """Built from the job's ``model``, ``batching`` and ``runtime`` sections (their defaults live in
    embedpipe/config.py only) and ``output.dim``; ``threads``: torch intra-op threads, None leaves torch's."""

    def __init__(self, *, model: ModelConfig, batching: BatchingConfig, runtime: RuntimeConfig,
                 output_dim: int | None = None, threads: int | None = None,
                 chunking: ChunkingConfig | None = None):
        self.model_config, self.batching, self.runtime = model, batching, runtime
        if threads:
            torch.set_num_threads(threads)
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if runtime.device == "auto" else runtime.device
        if self.device == "cpu" and runtime.cpu_keep_memory:
            keep_freed_memory()  # no page faults on every step's activations (see runtime/cpu.py)
        self.dtype = resolve_dtype(model.dtype, device=self.device)  # model.dtype auto: bfloat16 on CUDA, float32 on CPU
        precision = matmul_precision(tf32=runtime.tf32, dtype=self.dtype, device=self.device)
        if precision is not None:
            torch.set_float32_matmul_precision(precision)  # the whole process: a worker runs one encoder
            log.info("runtime.tf32: float32 matmuls may use TF32 tensor cores on %s", self.device)
        self.model_dir = resolve_model_path(model.path, storage_options=model.storage_options)
        self.loaded = load_model(self.model_dir, dtype=DTYPES[self.dtype], device=self.device,
                                 attention_backend=runtime.attention, allow_pickle=model.allow_pickle)
        rows_for = None  # the CPU runner's row padding: one per forward instead of a copy in every linear
        self.linears = ""  # the CPU linears' GEMM library, "onednn" or "torch" (the report's device.linears)
        if self.device == "cpu":
            self.linears = place_linears(self.loaded.model, choice=runtime.cpu_linears)  # runtime/cpu.py
            if self.linears == "onednn" and getattr(self.loaded.model, "attention_backend", None) in PADDED_ROWS:
                rows_for = padded_rows
        spec = self.loaded.spec
        self.prompt = resolve_prompt(spec, prompt=model.prompt, prompt_name=model.prompt_name)
        self.max_seq_len = effective_max_seq_len(model.max_seq_len, spec=spec, max_positions=self.loaded.max_positions)
        if self.max_seq_len > batching.max_tokens:
            raise ValueError(f"model.max_seq_len={self.max_seq_len} exceeds batching.max_tokens="
                             f"{batching.max_tokens}: raise batching.max_tokens or lower model.max_seq_len")
        self.tokenizer = TextTokenizer(self.model_dir, max_seq_len=self.max_seq_len, lower_case=spec.do_lower_case,
                                       prompt=self.prompt)
        self.packer = TokenPacker(max_tokens=batching.max_tokens, sort_window=batching.sort_window)
        self.chunker = self._chunker(chunking) if chunking is not None and chunking.mode != "off" else None
        self.late = None
        # sentence-transformers' include_prompt=false: the prompt's tokens stay out of the pool
        skip = 0 if spec.include_prompt else self.tokenizer.prompt_length
        self.head = self.loaded.build_head(pooling=model.pooling, normalize=model.normalize, dim=output_dim,
                                           skip_tokens=skip)
        self.dim = output_dim or self.loaded.dim
        if self.chunker is not None and chunking.mode == "late":  # chunks pooled from one pass: no prompt skip
            late_head = self.loaded.build_head(pooling=model.pooling, normalize=model.normalize, dim=output_dim,
                                               skip_tokens=0)
            self.late = LatePooler(model=self.loaded.model, head=late_head.to(self.device), packer=self.packer,
                                   chunker=self.chunker, device=self.device, context=self.max_seq_len, dim=self.dim,
                                   sort_window=batching.sort_window)
        self.runner = build_runner(self.loaded.model, self.head, device=self.device, max_seq_len=self.max_seq_len,
                                   batching=batching, runtime=runtime, rows_for=rows_for)
        log.info("encoder %s on %s (%s, %s runner), dim %d, max_seq_len %d", self.model_dir.name, self.device,
                 self.dtype, self.runner.name, self.dim, self.max_seq_len)
        self.warmup = warmup_guard(self) if runtime.warmup_check else None  # raises WarmupDivergence

    def _chunker(self, chunking: ChunkingConfig) -> Chunker:
        """input.chunking against this model (ChunkingConfig.tokens_for: null is max_seq_len, never above it)."""
        max_tokens = chunking.tokens_for(max_seq_len=self.max_seq_len)  # a JobError (ValueError) above it
        return Chunker(tokenizer=self.tokenizer, max_tokens=max_tokens, overlap=chunking.overlap,
                       window=chunking.boundary_window)

    @classmethod
    def from_job(cls, job: JobSpec, *, threads: int | None = None) -> "Encoder":
        """The encoder of a job's workers (chunking as the job's input.chunking says)."""
        return cls(model=job.model, batching=job.batching, runtime=job.runtime, output_dim=job.output.dim,
                   threads=threads, chunking=job.input.chunking)

    @classmethod
    def from_options(cls, model_path: str, *, threads: int | None = None, **options: Any) -> "Encoder":
        """For code with a model path and a few options: ``embed()``'s keyword options of the encoder's
        sections (``max_seq_len=128``, ``dtype="bfloat16"``, ``max_tokens``, ``device``, ...) and ``dim``
        (output.dim), checked by the job schema; every other setting is config.py's default."""
        from embedpipe.config import job_from_options, option_names

        source = "Encoder.from_options"
        names = option_names()
        for key in options:
            if key in names and names[key][0] not in ENCODER_SECTIONS and names[key] != ("output", "dim"):
                raise JobError(key, "is not an encoder option", f"pass {key}= to embed(), or leave it out: the "
                               "encoder takes the model, batching and runtime fields and dim", source=source)
        job = job_from_options(model_path, options, source=source)
        return cls.from_job(job, threads=threads)

    def prepare(self, texts: list[str], counters: Counters | None = None) -> list[Window]:
        """Tokenize and pack ``texts`` whole, ahead of ``embed(texts, prepared=...)``: a worker prepares its next
        unit this way while it encodes the current one (the read-ahead). Memory: the unit's token ids, twice."""
        counters = counters if counters is not None else Counters()
        tokenize_at = self._tokenized(texts)
        return [self._window(start, counters, tokenize_at) for start in range(0, len(texts), self.batching.sort_window)]

    def _tokenized(self, texts: list[str]) -> Callable[[int], Tokenized]:
        """The sort window of ``texts`` that starts at a given text, tokenized: a sequence per text."""
        return lambda start: self.tokenizer(texts[start:start + self.batching.sort_window])

    def _window(self, start: int, counters: Counters, tokenize_at: Callable[[int], Tokenized]) -> Window:
        """One sort window, tokenized (``tokenize_at(start)``: a sequence per output row) and packed."""
        with counters.time("tokenize"):
            tok = tokenize_at(start)
        with counters.time("pack"):
            return start, tok, self.packer(tok)

    def embed(self, texts: list[str], counters: Counters | None = None, *,
              prepared: list[Window] | None = None, per_document: list | None = None) -> np.ndarray:
        """Texts to vectors [N, D] float32, in input order.

        A prefetch thread tokenizes and packs one sort window ahead while the runner encodes
        (the packer sorts within windows, so the batches are those of the whole list); results
        are read back as they complete. Stage times overlap: tokenize + pack + encode > wall.
        ``prepared``: ``prepare(texts)``'s windows, when the caller tokenized them already.
        ``per_document``: given, what each text cost is appended, as ``DocumentCost`` (a row each).
        """
        counters = counters if counters is not None else Counters()
        sequences: list = []  # each sort window's (real tokens [n], truncated [n])
        vectors = self._encode(texts, counters, self._tokenized(texts), prepared=prepared, per_row=sequences)
        counters.rows += len(texts)
        if per_document is not None:
            per_document.append(_cost(sequences, doc=np.arange(len(texts)), chunks=np.ones(len(texts), np.int64)))
        return np.concatenate(vectors) if vectors else np.empty((0, self.dim), dtype=np.float32)

    def embed_chunks(self, texts: list[str], counters: Counters | None = None, *,
                     per_document: list | None = None, chunked: Chunked | None = None) -> tuple[Chunks, np.ndarray]:
        """Documents to chunks (embedpipe/text/chunking.py, ``input.chunking``) and one vector per chunk [C, D]
        float32, documents in input order, chunks in text order; each chunk's vector is that of its text.
        ``per_document``: given, what each document cost is appended, as ``DocumentCost``. ``chunked``: the
        chunker's output for ``texts``, when the caller chunked them already (they are not tokenized again)."""
        if self.chunker is None:
            raise ValueError("embed_chunks needs input.chunking.mode split or late")
        counters = counters if counters is not None else Counters()
        sequences: list = []  # each sort window's (real tokens [n], truncated [n]): a chunk each; late: a window
        if self.late is not None:
            windows: list = []  # each sort window's (document [W], tokens [W])
            chunks, vectors = self.late(texts, counters, per_window=windows, chunked=chunked)
            sequences = [(lengths, np.zeros(len(lengths), dtype=bool)) for _, lengths in windows]
            doc = np.concatenate([d for d, _ in windows]) if windows else np.zeros(0, np.int64)
        else:
            plans: list[Chunks] = []

            def tokenize_at(start: int) -> Tokenized:  # prefetch thread
                stop = start + self.batching.sort_window
                docs, chunks = self.chunker.chunk_range(texts, start=start, stop=stop, given=chunked)
                plans.append(chunks)
                return self.chunker.framed(docs, chunks)

            outs = self._encode(texts, counters, tokenize_at, per_row=sequences)
            chunks = concat_chunks(plans, offsets=range(0, len(texts), self.batching.sort_window))
            vectors = np.concatenate(outs) if outs else np.empty((0, self.dim), dtype=np.float32)
            doc = chunks.doc
        per = chunks.per_document_of(len(texts))
        counters.rows += len(chunks)
        counters.add_documents(per)
        if per_document is not None:
            per_document.append(_cost(sequences, doc=doc, chunks=per))
        return chunks, vectors

    def _encode(self, texts: list[str], counters: Counters, tokenize_at: Callable[[int], Tokenized], *,
                prepared: list[Window] | None = None, per_row: list | None = None) -> list[np.ndarray]:
        """The vectors of each sort window of ``texts``: ``tokenize_at(start) -> Tokenized``, the window that
        starts at text ``start`` (one sequence per output row), on the prefetch thread (or ``prepared``: the windows
        tokenized already), then pack, encode and pool."""
        outs: list[np.ndarray] = []
        pending: deque = deque()  # (out, rows, LazyResult), oldest first

        def collect(force: bool) -> None:
            while pending and (force or pending[0][2].done()):
                out, rows, result = pending.popleft()
                out[rows] = result.get().numpy()
                counters.padded_tokens += result.computed_tokens

        starts = range(0, len(texts), self.batching.sort_window)
        source = (contextlib.nullcontext(prepared) if prepared is not None
                  else Prefetcher(starts, lambda start: self._window(start, counters, tokenize_at)))
        with counters.time("encode"), source as ready:
            for _start, tok, batches in ready:
                outs.append(np.empty((len(tok.lengths), self.dim), dtype=np.float32))
                for batch in batches:
                    pending.append((outs[-1], batch.rows, self.runner.submit(batch)))
                    collect(force=False)
                counters.tokens += int(tok.lengths.sum())
                counters.tokens_squared += int((tok.lengths.astype(np.int64) ** 2).sum())
                counters.truncated_rows += int(tok.truncated.sum())
                if per_row is not None:
                    per_row.append((tok.lengths, tok.truncated))
            collect(force=True)
        return outs


def _cost(sequences: list, *, doc: np.ndarray, chunks: np.ndarray) -> DocumentCost:
    """What each of N documents cost: ``sequences``, (real tokens [n], truncated [n]) of consecutive groups of the
    sequences embedded, ``doc`` [S] the document of each, ``chunks`` [N] the rows of each."""
    lengths = np.concatenate([n for n, _ in sequences]) if sequences else np.zeros(0, np.int64)
    cut = np.concatenate([c for _, c in sequences]) if sequences else np.zeros(0, bool)
    return DocumentCost.of(doc=doc, lengths=lengths, truncated=cut, chunks=chunks)
