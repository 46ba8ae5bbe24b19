"""Warmup guard: before real work, the fast path must agree with an eager float32 reference.

A fixed sample of texts (every length class up to max_seq_len) goes through the encoder's own
runner (bucketed, graphed, bfloat16 on GPU) and through a float32 copy of the model run eagerly
with SDPA attention; any sequence whose cosine divergence (1 - cos) exceeds `tolerance`
(0.1 %) fails the worker with `WarmupDivergence`. The guard also captures the graphs of the
sample's shapes, so the first real unit starts warm.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from embedpipe.errors import RunError
from embedpipe.runtime.reference import keep_reference, load_reference, reference_key
from embedpipe.runtime.runners import EagerRunner, Runner
from embedpipe.text.packer import Batch

log = logging.getLogger(__name__)

TOLERANCE = 1e-3  # largest allowed 1 - cosine between fast path and reference, per sequence

_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if more no out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three embedding vector index search query document passage 2024 "
    "GPU kernel attention token batch graph memory throughput latency-critical naïve café Zürich 東京 ☃"
).split()


def sample_texts(*, n: int = 48, seed: int = 0) -> list[str]:
    """Deterministic texts whose lengths cover short queries to passages longer than any max_seq_len."""
    rng = random.Random(seed)
    lengths = [1, 2, 4, 8, 16, 32, 64, 128, 256, 600]
    return [" ".join(rng.choice(_WORDS) for _ in range(lengths[i % len(lengths)] + rng.randrange(4)))
            for i in range(n)]


@dataclass(frozen=True)
class ParityReport:
    min_cosine: float
    worst_row: int
    rows: int
    tolerance: float

    @property
    def max_divergence(self) -> float:
        return 1.0 - self.min_cosine

    @property
    def ok(self) -> bool:
        return self.max_divergence <= self.tolerance  # NaN compares False: fails


class WarmupDivergence(RunError, RuntimeError):
    """The fast path disagrees with the float32 reference: this worker must not produce vectors."""


def cosines(fast: Tensor | np.ndarray, ref: Tensor | np.ndarray) -> np.ndarray:
    """Row-wise cosine in float64 [N]; a zero row matches only a zero row; NaN/inf rows give NaN."""
    a, b = (torch.as_tensor(x).double() for x in (fast, ref))
    if a.shape != b.shape:
        raise ValueError(f"fast path gave {tuple(a.shape)}, reference {tuple(b.shape)}")
    na, nb = a.norm(dim=-1), b.norm(dim=-1)  # [N]
    cos = (a * b).sum(-1) / (na * nb)
    both_zero = (na == 0) & (nb == 0)
    cos = torch.where(both_zero, torch.ones_like(cos), torch.nan_to_num(cos, nan=0.0, posinf=0.0, neginf=0.0))
    cos = torch.where(torch.isfinite(a).all(-1) & torch.isfinite(b).all(-1), cos, torch.full_like(cos, float("nan")))
    return cos.numpy()


def compare(fast: Tensor | np.ndarray, ref: Tensor | np.ndarray, *, tolerance: float = TOLERANCE) -> ParityReport:
    cos = cosines(fast, ref)
    worst = int(np.argmin(np.nan_to_num(cos, nan=-np.inf))) if cos.size else 0
    return ParityReport(min_cosine=float(cos[worst]) if cos.size else 1.0, worst_row=worst, rows=int(cos.size),
                        tolerance=tolerance)


def run_batches(runner: Runner, batches: list[Batch], rows: int) -> Tensor:
    """All batches through a runner, back in input order: [rows, D] float32."""
    results = [(b.rows, runner.submit(b)) for b in batches]
    out = None
    for idx, result in results:
        value = result.get()
        out = torch.empty(rows, value.shape[1]) if out is None else out
        out[torch.as_tensor(idx)] = value
    return out


def check(*, fast: Runner, reference: Runner, batches: list[Batch], rows: int, tolerance: float = TOLERANCE,
          what: str = "fast path") -> ParityReport:
    """Run both, compare, raise WarmupDivergence with the numbers and the ways out."""
    report = compare(run_batches(fast, batches, rows), run_batches(reference, batches, rows), tolerance=tolerance)
    return judged(report, tolerance=tolerance, what=what)


def judged(report: ParityReport, *, tolerance: float, what: str) -> ParityReport:
    """``report`` when it is ok; else WarmupDivergence with its numbers and the ways out."""
    if not report.ok:
        raise WarmupDivergence(
            f"warmup guard: the {what} diverges from the eager float32 reference: min cosine "
            f"{report.min_cosine:.6f} (row {report.worst_row} of {report.rows}), allowed 1 - cos <= {tolerance:g}. "
            "This worker stops before writing vectors. Try runtime.cuda_graphs: false, then model.dtype: float32 "
            "or runtime.attention: sdpa, to find the culprit, and report it; runtime.warmup_check: false "
            "skips this check at your own risk.")
    log.info("warmup guard: %s agrees with float32 eager (min cosine %.6f over %d sequences)",
             what, report.min_cosine, report.rows)
    return report


class FullFloat32:
    """A synchronous runner whose matmuls run in full float32 even where runtime.tf32 set TF32 for the process:
    the reference must not share the fast path's shortcuts."""

    def __init__(self, runner: EagerRunner):
        self.runner, self.name = runner, runner.name

    def submit(self, batch: Batch):
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            return self.runner.submit(batch)  # EagerRunner: the result is on the host when this returns
        finally:
            torch.set_float32_matmul_precision(previous)


def warmup_guard(encoder, *, tolerance: float = TOLERANCE) -> ParityReport | None:
    """The check for a built Encoder; None when its runner is the float32 eager reference itself. The reference's
    vectors are kept on this machine (runtime/reference.py): a later start compares with them, and computes them
    again only where the fast path disagrees."""
    if isinstance(encoder.runner, EagerRunner) and encoder.dtype == "float32":  # the resolved dtype (model.dtype auto)
        return None
    texts = sample_texts()
    batches = encoder.packer(encoder.tokenizer(texts))
    what = f"{encoder.runner.name} {encoder.dtype} path on {encoder.device}"
    fast = run_batches(encoder.runner, batches, len(texts))  # [rows, D]; the first use of the sample's shapes (graphs)
    settings, head = encoder.model_config, encoder.head
    key = reference_key(model_dir=encoder.model_dir, batches=batches, device=encoder.device,
                        head=f"{settings.pooling}|{settings.normalize}|{head.dim}|{head.skip_tokens}")
    kept = load_reference(key)
    if kept is not None and kept.shape == fast.shape:
        report = compare(fast, kept, tolerance=tolerance)
        if report.ok:
            log.info("warmup guard: %s agrees with the kept float32 reference (min cosine %.6f over %d sequences)",
                     what, report.min_cosine, report.rows)
            return report
    reference = _reference_vectors(encoder, batches, len(texts))  # none kept, or the fast path disagrees with it
    keep_reference(key, reference)
    return judged(compare(fast, reference, tolerance=tolerance), tolerance=tolerance, what=what)


def _reference_vectors(encoder, batches: list[Batch], rows: int) -> Tensor:
    """The sample's vectors from an eager float32 copy of the encoder's model (SDPA attention): [rows, D]."""
    from embedpipe.models import load_model

    settings = encoder.model_config
    ref = load_model(encoder.model_dir, dtype=torch.float32, device=encoder.device, attention_backend="sdpa",
                     allow_pickle=settings.allow_pickle)
    head = ref.build_head(pooling=settings.pooling, normalize=settings.normalize,
                          dim=encoder.head.dim, skip_tokens=encoder.head.skip_tokens)
    try:
        return run_batches(FullFloat32(EagerRunner(ref.model, head, device=encoder.device)), batches, rows)
    finally:
        del ref, head
        if torch.device(encoder.device).type == "cuda":
            torch.cuda.empty_cache()
