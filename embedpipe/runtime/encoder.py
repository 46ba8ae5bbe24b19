"""An encoder replica: built once (model, head, tokenizer, packer on one device), called per batch."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from embedpipe.models import load_model
from embedpipe.models.resolve import resolve_model_path
from embedpipe.models.st import resolve_prompt
from embedpipe.report.counters import Counters
from embedpipe.runtime.cpu import keep_freed_memory, use_onednn_linears
from embedpipe.runtime.prefetch import Prefetcher
from embedpipe.runtime.runners import RunnerSettings, build_runner
from embedpipe.runtime.warmup import warmup_guard
from embedpipe.text.packer import TokenPacker
from embedpipe.text.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EncoderSettings:
    """Everything that decides which vectors come out, plus where and how fast they are computed."""

    model_path: str
    max_seq_len: int | None = None  # None: the model's sentence-transformers max length, else its position limit
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    pooling: Literal["auto", "mean", "cls", "last"] = "auto"
    normalize: bool | Literal["auto"] = "auto"
    prompt: str | None = None  # a literal prefix; None: prompt_name, else the model's default prompt
    prompt_name: str | None = None  # one of the model's named prompts
    output_dim: int | None = None  # keep the first output_dim dimensions (Matryoshka); None: all
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention: str = "auto"
    max_tokens: int = 8192
    sort_window: int = 4096
    threads: int | None = None  # torch intra-op threads; None leaves torch's default
    allow_pickle: bool = False  # also read pytorch_model.bin (torch.load(weights_only=True))
    runner: RunnerSettings = RunnerSettings()  # GPU: buckets, CUDA graphs, staging depth
    warmup_check: bool = True  # compare the fast path with float32 eager before any real work
    cpu_keep_memory: bool = True  # CPU: freed blocks stay in the malloc heap (see runtime/cpu.py)

    @classmethod
    def from_job(cls, job, *, threads: int | None = None) -> "EncoderSettings":
        m, b, r = job.model, job.batching, job.runtime
        runner = RunnerSettings(cuda_graphs=r.cuda_graphs, buckets=tuple(b.buckets) if b.buckets else None,
                                max_graphs=r.max_graphs, graph_memory_mb=r.graph_memory_mb)
        return cls(model_path=m.path, max_seq_len=m.max_seq_len, dtype=m.dtype, pooling=m.pooling,
                   normalize=m.normalize, prompt=m.prompt, prompt_name=m.prompt_name, output_dim=job.output.dim,
                   device=r.device, attention=r.attention, max_tokens=b.max_tokens,
                   sort_window=b.sort_window, threads=threads, allow_pickle=m.allow_pickle, runner=runner,
                   warmup_check=r.warmup_check, cpu_keep_memory=r.cpu_keep_memory)


class Encoder:
    def __init__(self, settings: EncoderSettings):
        self.settings = settings
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if settings.device == "auto" else settings.device
        if self.device == "cpu" and settings.cpu_keep_memory:
            keep_freed_memory()  # no page faults on every step's activations (see runtime/cpu.py)
        self.model_dir = resolve_model_path(settings.model_path)
        self.loaded = load_model(self.model_dir, dtype=DTYPES[settings.dtype], device=self.device,
                                 attention_backend=settings.attention, allow_pickle=settings.allow_pickle)
        if self.device == "cpu":
            use_onednn_linears(self.loaded.model)  # AVX-512 float32 GEMMs where MKL runs AVX2 (see runtime/cpu.py)
        spec = self.loaded.spec
        self.prompt = resolve_prompt(spec, prompt=settings.prompt, prompt_name=settings.prompt_name)
        self.max_seq_len = settings.max_seq_len or spec.max_seq_len or min(self.loaded.max_positions, 8192)
        if self.max_seq_len > settings.max_tokens:
            raise ValueError(f"model.max_seq_len={self.max_seq_len} exceeds batching.max_tokens="
                             f"{settings.max_tokens}: raise batching.max_tokens or lower model.max_seq_len")
        self.tokenizer = TextTokenizer(self.model_dir, max_seq_len=self.max_seq_len, lower_case=spec.do_lower_case,
                                       prompt=self.prompt)
        self.packer = TokenPacker(max_tokens=settings.max_tokens, sort_window=settings.sort_window)
        # sentence-transformers' include_prompt=false: the prompt's tokens stay out of the pool
        skip = 0 if spec.include_prompt else self.tokenizer.prompt_length
        self.head = self.loaded.build_head(pooling=settings.pooling, normalize=settings.normalize,
                                           dim=settings.output_dim, skip_tokens=skip)
        self.dim = settings.output_dim or self.loaded.dim
        self.runner = build_runner(self.loaded.model, self.head, device=self.device, max_tokens=settings.max_tokens,
                                   max_seq_len=self.max_seq_len, settings=settings.runner)
        log.info("encoder %s on %s (%s, %s runner), dim %d, max_seq_len %d", self.model_dir.name, self.device,
                 settings.dtype, self.runner.name, self.dim, self.max_seq_len)
        self.warmup = warmup_guard(self) if settings.warmup_check else None  # raises WarmupDivergence

    def embed(self, texts: list[str], counters: Counters | None = None) -> np.ndarray:
        """Texts to vectors [N, D] float32, in input order.

        A prefetch thread tokenizes and packs one sort window ahead while the runner encodes
        (the packer sorts within windows, so the batches are those of the whole list); results
        are read back as they complete. Stage times overlap: tokenize + pack + encode > wall.
        """
        counters = counters if counters is not None else Counters()
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        window = self.settings.sort_window

        def prepare(start: int):  # prefetch thread: CPU only
            with counters.time("tokenize"):
                tok = self.tokenizer(texts[start:start + window])
            with counters.time("pack"):
                return start, tok, self.packer(tok)

        pending: deque = deque()  # (rows, LazyResult), oldest first

        def collect(force: bool) -> None:
            while pending and (force or pending[0][1].done()):
                rows, result = pending.popleft()
                out[rows] = result.get().numpy()
                counters.padded_tokens += result.computed_tokens

        with counters.time("encode"), Prefetcher(range(0, len(texts), window), prepare) as ready:
            for start, tok, batches in ready:
                for batch in batches:
                    pending.append((batch.rows + start, self.runner.submit(batch)))
                    collect(force=False)
                counters.tokens += int(tok.lengths.sum())
                counters.tokens_squared += int((tok.lengths.astype(np.int64) ** 2).sum())
                counters.truncated_rows += int(tok.truncated.sum())
            collect(force=True)
        counters.rows += len(texts)
        return out
