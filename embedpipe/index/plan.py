"""What index to build: the job's factory string or ``auto``, checked against the corpus and the model.

Runs in preflight, before any worker starts (``embedpipe validate`` and ``run``), so a bad index setting fails
with the field to fix. ``auto`` rules (docs/index.md):

1. exact ``Flat`` while the corpus has at most ``EXACT_MAX_ROWS`` rows and fits the budget;
2. ``HNSW32`` while it fits the budget;
3. ``IVF{nlist},Flat`` while it fits (nlist about 4*sqrt(rows), a power of two, >= 39 rows per list);
4. compressed IVF, the largest code that fits: ``SQfp16``, ``SQ8``, ``SQ6``, ``SQ4``, then
   ``OPQ{M}_{d},IVF{nlist},PQ{M}`` with the largest M that fits, only when it trains on at least
   ``PQ_MIN_TRAIN_ROWS`` vectors (``cheap_to_train``).

Sizes are what the index holds (``IndexSpec.memory_bytes``: codes, ids, centroids, trained tables),
with no allowance on top, so a small budget gets the SQ6 or SQ4 index that fits it.

The build measures the chosen index and tunes its search to ``output.target_recall``; when it
misses, uncompressed indexes of another kind that also fit are tried (docs/index.md says why
smaller codes are not, and why no refine stage is added inside a budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from embedpipe.config import JobError, JobSpec
from embedpipe.index.factory import FactoryError, IndexSpec, check_spec, parse_factory
from embedpipe.io.layout import OutputLayout

EXACT_MAX_ROWS = 50_000  # auto: exact search below this many rows (a flat scan stays in milliseconds)
HNSW_M = 32
QUERIES = 1_000  # hold-out queries for the recall measurement
GB = 1e9
AUTO_TRIES = 3
PQ_MIN_TRAIN_ROWS = 10_000  # auto: PQ/OPQ only with this many training vectors (cheap_to_train)


@dataclass(frozen=True)
class ModelFacts:
    """What the index needs from the model (``RunPlan.model.index_facts()``: read once by preflight)."""

    dim: int
    normalize: bool
    query_prompt: str


@dataclass(frozen=True)
class IndexPlan:
    candidates: tuple[IndexSpec, ...]  # built in order until one reaches the target (explicit: one)
    auto: bool
    rows: int
    dim: int
    metric: str  # "inner_product" (normalised vectors) or "l2"
    budget_bytes: int
    target_recall: float
    query_prompt: str
    warnings: tuple[str, ...] = ()
    upgrade: str = ""  # auto: the next better index and the budget it needs ("" when none is better)

    @property
    def queries(self) -> int:
        return min(QUERIES, self.rows)

    def on_disk(self, spec: IndexSpec) -> bool:
        """IVF larger than the budget keeps its inverted lists on disk (merged with OnDiskInvertedLists)."""
        return spec.memory_bytes(self.rows, self.dim) > self.budget_bytes

    def train_rows(self, spec: IndexSpec) -> int:
        return train_rows(spec, rows=self.rows, dim=self.dim, budget_bytes=self.budget_bytes)


def train_rows(spec: IndexSpec, *, rows: int, dim: int, budget_bytes: int) -> int:
    """Uniform sample size: up to 256 rows per centroid, at most half the budget as float32,
    never below 39 per centroid (FAISS's minimum for a useful k-means)."""
    want = spec.training_rows(rows)
    cap = max(int(budget_bytes / 2 / (4 * dim)), 39 * spec.train_centroids)
    return min(want, cap, rows)


def cheap_to_train(spec: IndexSpec, *, rows: int, dim: int, budget_bytes: int) -> bool:
    """auto takes PQ codes and OPQ rotations only with at least ``PQ_MIN_TRAIN_ROWS`` training vectors: below
    that their k-means see a few points per centroid (recall drops under SQ4's) and OPQ's iterations cost
    minutes for a corpus that encodes in seconds. FAISS caps what they train on (OPQ 65,536 points, PQ 256
    per centroid), so their training stays small beside the corpus above it."""
    if not (spec.pq_m or spec.opq_m):
        return True
    return train_rows(spec, rows=rows, dim=dim, budget_bytes=budget_bytes) >= PQ_MIN_TRAIN_ROWS


def plan_for_vectors(job: JobSpec, plan: IndexPlan, *, rows: int) -> IndexPlan:
    """The plan for the vectors the parts really hold (``rows``, read from them after the run). A chunked run's
    auto index is chosen again for its chunk count: preflight could count only the documents, and a
    corpus of N documents may be cut into several times N chunks (another index, or over the budget:
    JobError names output.index_memory_gb). Otherwise the same candidates, with the rows updated."""
    if plan.auto and job.input.chunking.mode != "off" and rows != plan.rows:
        facts = ModelFacts(dim=plan.dim, normalize=plan.metric == "inner_product", query_prompt=plan.query_prompt)
        return plan_index(job, rows=rows, model=facts)
    return replace(plan, rows=rows)


def plan_index(job: JobSpec, *, rows: int, model: ModelFacts) -> IndexPlan:
    """Check the index settings against the corpus size and the model (its facts from the run's
    plan, embedpipe/preflight.py); raise JobError naming the field."""
    out = job.output
    budget = int(out.index_memory_gb * GB)
    metric = "inner_product" if model.normalize else "l2"
    if rows < 2:
        raise JobError("input.path", f"holds {rows} row(s); an index needs at least 2",
                       "add rows or set output.format: parquet")
    if out.index == "auto":
        ladder = [s for s in auto_ladder(rows, model.dim)
                  if cheap_to_train(s, rows=rows, dim=model.dim, budget_bytes=budget)]
        fitting = [s for s in ladder if s.memory_bytes(rows, model.dim) <= budget]
        if not fitting:
            smallest = min(ladder, key=lambda s: s.memory_bytes(rows, model.dim))
            need = smallest.memory_bytes(rows, model.dim) / GB
            raise JobError("output.index_memory_gb",
                           f"{out.index_memory_gb:g} GB is too small for any index of {rows:,} vectors of "
                           f"dimension {model.dim}: the smallest, {smallest.factory}, needs {need:.3g} GB",
                           f"raise output.index_memory_gb to at least {_round_up(need)}")
        chosen = fitting[0]
        # fallbacks: uncompressed indexes of another kind (HNSW missing -> IVF-Flat); a smaller code
        # of the same ladder cannot do better than the one that missed
        fallbacks = [s for s in fitting[1:] if s.code == "Flat" and not s.transform and s.kind != chosen.kind]
        better = ladder[: ladder.index(chosen)]
        upgrade = ""
        if better:
            up = better[-1]
            upgrade = (f"{up.factory} fits with output.index_memory_gb: "
                       f"{_round_up(up.memory_bytes(rows, model.dim) / GB)}")
        return IndexPlan((chosen, *fallbacks[: AUTO_TRIES - 1]), True, rows, model.dim, metric, budget,
                         out.target_recall, model.query_prompt, upgrade=upgrade)
    try:
        spec = parse_factory(out.index)
        warnings = check_spec(spec, dim=model.dim, rows=rows)
    except FactoryError as exc:
        raise JobError("output.index", str(exc), "write a valid factory string or output.index: auto") from None
    need = spec.memory_bytes(rows, model.dim) / GB
    if need * GB > budget:
        if not spec.sharded:
            raise JobError("output.index_memory_gb",
                           f"{spec.factory} for {rows:,} vectors of dimension {model.dim} needs about {need:.3g} GB "
                           f"in memory, over the {out.index_memory_gb:g} GB budget (only IVF indexes can stay on disk)",
                           f"raise output.index_memory_gb to {_round_up(need)}, or use a smaller index "
                           f"(an IVF with PQ codes, or output.index: auto)")
        resident = spec.memory_bytes(0, model.dim)
        if resident > budget:
            raise JobError("output.index_memory_gb",
                           f"{out.index_memory_gb:g} GB does not even hold {spec.factory}'s quantizers "
                           f"({resident / GB:.3g} GB)", f"raise output.index_memory_gb or use fewer IVF lists")
        warnings.append(f"{spec.factory} needs about {need:.3g} GB, over output.index_memory_gb="
                        f"{out.index_memory_gb:g}: its inverted lists are merged on disk (index.ivfdata)")
    return IndexPlan((spec,), False, rows, model.dim, metric, budget, out.target_recall, model.query_prompt,
                     tuple(warnings))


def auto_nlist(rows: int) -> int:
    """IVF lists: a power of two near 4*sqrt(rows), with at least 39 training rows per list."""
    nlist = 2 ** round(math.log2(max(4 * math.sqrt(rows), 1)))
    while nlist > 1 and rows < 39 * nlist:
        nlist //= 2
    return nlist


def auto_ladder(rows: int, dim: int) -> list[IndexSpec]:
    """Every configuration auto may choose, best first (before the memory budget is applied)."""
    nlist = auto_nlist(rows)
    ivf = f"IVF{nlist}" + (f"_HNSW{HNSW_M}" if nlist >= 65536 else "")
    bits = 8 if rows >= 39 * 256 else 4  # 8-bit PQ needs ~10k training rows
    pq = "" if bits == 8 else f"x{bits}"
    ladder = (["Flat"] if rows <= EXACT_MAX_ROWS else []) + [f"HNSW{HNSW_M}", f"{ivf},Flat", f"{ivf},SQfp16"]
    ladder += [f"{ivf},SQ8", f"{ivf},SQ6", f"{ivf},SQ4"]
    for m in _pq_sizes(dim):
        ladder.append(f"OPQ{m}_{dim},{ivf},PQ{m}{pq}")
    return [parse_factory(s) for s in ladder]


def _pq_sizes(dim: int) -> list[int]:
    """PQ sub-quantizer counts dividing ``dim``, largest code first: 4 to 32 dimensions per sub-vector
    (narrower sub-vectors cost more bytes than SQ4 and train slowly)."""
    return [m for m in range(dim // 4, 0, -1) if dim % m == 0 and 4 <= dim // m <= 32 and m <= 256]


def _round_up(gb: float) -> str:
    digits = max(0, -math.floor(math.log10(gb)) + 1) if gb > 0 else 0
    return f"{math.ceil(gb * 10 ** digits) / 10 ** digits:g}"


def index_dir(job: JobSpec) -> Path:
    return OutputLayout(job.output.path).index_dir


def describe_plan(plan: IndexPlan) -> str:
    """One line per decision, for ``embedpipe validate``."""
    first = plan.candidates[0]
    size = first.memory_bytes(plan.rows, plan.dim) / GB
    line = (f"index: {first.factory}{' (auto)' if plan.auto else ''}, about {size:.3g} GB"
            f"{' (inverted lists on disk)' if first.sharded and plan.on_disk(first) else ''}, metric {plan.metric}, "
            f"target recall@10 {plan.target_recall}")
    fallbacks = [s.factory for s in plan.candidates[1:]]
    if fallbacks:
        line += f"; if it misses the target: {', then '.join(fallbacks)}"
    return "\n".join([line, *(f"warning: {w}" for w in plan.warnings)])
