"""FAISS factory strings: parse the forms embedpipe builds, check them, estimate their memory.

embedpipe builds a subset of FAISS's ``index_factory`` grammar, one comma-separated stage each:

    [OPQ{M}[_{D}] | PCA[R]{D},]  Flat | HNSW{M}[_Flat|_SQ8|_SQ6|_SQ4|_SQfp16|_PQ{M}]
                                 | IVF{nlist}[_HNSW{M}],{Flat | SQ8 | SQ6 | SQ4 | SQfp16 | PQ{M}[x{bits}][fs]}
                                 | SQ8 | SQfp16 | PQ{M}[x{bits}]           (exhaustive search on codes)
                                 [,RFlat | ,Refine({Flat|SQ8|SQfp16|...})]

A leading ``IDMap,``/``IDMap2,`` is accepted and dropped: embedpipe adds the ID map itself where the
index needs one. Parsing needs no FAISS and no dimension (job-file validation); :func:`check_spec`
adds the checks that need the vector dimension and the corpus size (the model and the input).
FAISS itself has the last word: ``faiss.index_factory`` must accept the string too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from embedpipe.errors import BadJob

SUPPORTED = ("Flat, HNSW32, HNSW32_SQ8, IVF1024,Flat, IVF4096,SQ8, IVF4096,SQfp16, IVF4096,PQ32, IVF4096,PQ32x4fs, "
             "OPQ16_64,IVF65536_HNSW32,PQ16, IVF4096,PQ32,RFlat, IVF4096,PQ32,Refine(SQ8), PQ32, SQ8")

_TRANSFORM = re.compile(r"(?:OPQ(?P<opq>\d+)(?:_(?P<opq_d>\d+))?|PCAR?(?P<pca>\d+))$")
_IVF = re.compile(r"IVF(?P<nlist>\d+)(?:_HNSW(?P<coarse>\d+))?$")
_HNSW = re.compile(r"HNSW(?P<m>\d+)(?:_(?P<storage>Flat|SQ8|SQ6|SQ4|SQfp16|PQ\d+))?$")
_CODE = re.compile(r"(?:Flat|SQ8|SQ6|SQ4|SQfp16|SQbf16|PQ(?P<pq>\d+)(?:x(?P<bits>\d+))?(?P<fs>fsr|fs)?)$")
_REFINE = re.compile(r"(?:RFlat|Refine\((?P<code>[A-Za-z0-9]+)\))$")

SQ_BITS = {"SQ4": 4, "SQ6": 6, "SQ8": 8, "SQfp16": 16, "SQbf16": 16, "Flat": 32}
IDMAP2_BYTES = 48  # per vector: the id (8) and IndexIDMap2's reverse hash map entry (~40)
IVF_ID_BYTES = 8  # per vector: the id stored beside the code in the inverted list
HEADER_BYTES = 4096  # an index's headers and small tables


class FactoryError(BadJob, ValueError):
    """A factory string embedpipe cannot build; the message says what is wrong and what works."""


@dataclass(frozen=True)
class IndexSpec:
    """One parsed factory string. ``factory`` is what FAISS gets (without any IDMap prefix)."""

    factory: str
    transform: str = ""  # "OPQ16_64", "PCA64" or ""
    transform_dim: int = 0  # the transform's output dimension; 0: no transform or same dimension
    opq_m: int = 0
    nlist: int = 0  # IVF lists; 0: not an IVF index
    coarse_hnsw: int = 0  # IVF coarse quantizer as HNSW with this M; 0: flat coarse quantizer
    hnsw_m: int = 0  # HNSW graph index with this M; 0: no graph
    code: str = "Flat"  # how each vector is stored: Flat, SQ8, ..., PQ16, PQ16x4, PQ16x4fs
    pq_m: int = 0
    pq_bits: int = 0
    refine: str = ""  # "" or the refine stage's code ("Flat", "SQ8", ...)

    # ---------------------------------------------------------------- what kind of index

    @property
    def kind(self) -> str:
        """flat (exact), hnsw, ivf, or codes (exhaustive search on compressed codes)."""
        if self.nlist:
            return "ivf"
        if self.hnsw_m:
            return "hnsw"
        return "flat" if self.code == "Flat" else "codes"

    @property
    def sharded(self) -> bool:
        """Workers add to per-unit shards merged by inverted list (IVF without a refine stage);
        other indexes are built on the driver from the vector parts, in unit order."""
        return self.kind == "ivf" and not self.refine

    @property
    def exact(self) -> bool:
        return self.kind == "flat" and not self.transform

    @property
    def tuned_parameter(self) -> str | None:
        return {"ivf": "nprobe", "hnsw": "efSearch"}.get(self.kind)

    @property
    def train_centroids(self) -> int:
        """The largest k-means the training runs (IVF lists, PQ/OPQ sub-quantizer centroids)."""
        ks = [self.nlist, 2 ** self.pq_bits if self.pq_m else 0, 256 if self.opq_m else 0]
        refine_pq = re.fullmatch(r"PQ(\d+)(?:x(\d+))?", self.refine)
        if refine_pq:
            ks.append(2 ** int(refine_pq.group(2) or 8))
        return max(ks)

    def needs_training(self) -> bool:
        return bool(self.train_centroids or self.transform or self.code.startswith("SQ")
                    or self.refine.startswith(("SQ", "PQ")))

    # ---------------------------------------------------------------- sizes

    def stored_dim(self, dim: int) -> int:
        return self.transform_dim or dim

    def code_bytes(self, dim: int) -> float:
        """Bytes of one vector's code (refine stage included), not counting ids or graph links."""
        return _code_bytes(self.code, self.stored_dim(dim)) + (_code_bytes(self.refine, dim) if self.refine else 0)

    def memory_bytes(self, rows: int, dim: int) -> int:
        """What the built index takes in memory (and about what it takes on disk)."""
        d = self.stored_dim(dim)
        per_vector = self.code_bytes(dim)
        fixed = HEADER_BYTES  # what the index itself holds, no allowance: a small budget can take SQ6 or SQ4
        if self.transform:
            fixed += 4 * dim * d + 4 * d  # the matrix and its bias
        if self.pq_m:
            fixed += 4 * d * 2 ** self.pq_bits
        for code, width in ((self.code, d), (self.refine, dim)):
            if code.startswith("SQ") and code not in ("SQfp16", "SQbf16"):
                fixed += 2 * 4 * width  # the trained range: a minimum and a width per dimension
        if self.kind == "ivf":
            per_vector += IVF_ID_BYTES
            fixed += 4 * d * self.nlist + (8 * self.coarse_hnsw + 12) * self.nlist * (self.coarse_hnsw > 0)
            fixed += 48 * self.nlist  # one std::vector of codes and one of ids per list
        if self.hnsw_m:
            per_vector += 8 * self.hnsw_m + 12  # level-0 links (2M ints) and the level tables
        if not self.sharded:
            per_vector += IDMAP2_BYTES
        return int(fixed + math.ceil(per_vector * rows))

    def training_rows(self, rows: int) -> int:
        """Vectors to train on: up to 256 per centroid (FAISS's cap), never more than the corpus."""
        if not self.needs_training():
            return 0
        k = self.train_centroids
        return min(rows, max(256 * k, 10_000) if k else 10_000)


def _code_bytes(code: str, d: int) -> float:
    if code in SQ_BITS:
        return d * SQ_BITS[code] / 8
    m = re.fullmatch(r"PQ(\d+)(?:x(\d+))?(fsr|fs)?", code)
    if m:
        return int(m.group(1)) * int(m.group(2) or (4 if m.group(3) else 8)) / 8
    raise AssertionError(f"unknown code {code!r}")  # parse_factory only lets known codes through


def parse_factory(text: str) -> IndexSpec:
    """Parse a factory string; :class:`FactoryError` names what is wrong. No FAISS, no dimension."""
    stages = [s.strip() for s in text.split(",")]
    if stages and stages[0] in ("IDMap", "IDMap2"):
        stages = stages[1:]
    if not stages or not all(stages):
        raise FactoryError(f"{text!r} has an empty stage; write stages separated by single commas, e.g. {SUPPORTED}")
    fields: dict = {}
    i = 0
    t = _TRANSFORM.match(stages[0])
    if t:
        i = 1
        fields["transform"] = stages[0]
        if t["opq"]:
            fields["opq_m"] = int(t["opq"])
            fields["transform_dim"] = int(t["opq_d"] or 0)
        else:
            fields["transform_dim"] = int(t["pca"])
    rest = stages[i:]
    if not rest:
        raise FactoryError(f"{text!r} has a transform but no index after it (e.g. {stages[0]},IVF1024,PQ16)")
    main = rest[0]
    ivf, hnsw, code = _IVF.match(main), _HNSW.match(main), _CODE.match(main)
    if ivf:
        if len(rest) < 2 or not _CODE.match(rest[1]):
            raise FactoryError(f"{text!r}: {main} must be followed by how vectors are stored in its lists "
                               f"(Flat, SQ8, SQfp16, PQ{{M}}, PQ{{M}}x{{bits}}), e.g. {main},PQ16")
        fields.update(nlist=int(ivf["nlist"]), coarse_hnsw=int(ivf["coarse"] or 0))
        code, used = _CODE.match(rest[1]), 2
        fields.update(_code_fields(rest[1], code))
    elif hnsw:
        storage = hnsw["storage"] or "Flat"
        fields.update(hnsw_m=int(hnsw["m"]), **_code_fields(storage, _CODE.match(storage)))
        used = 1
    elif code:
        fields.update(_code_fields(main, code))
        used = 1
    else:
        raise FactoryError(f"{text!r}: stage {main!r} is not an index embedpipe builds; supported forms: {SUPPORTED}")
    tail = rest[used:]
    if tail:
        r = _REFINE.match(tail[0])
        if not r or len(tail) > 1:
            raise FactoryError(f"{text!r}: unexpected stage {tail[0]!r} after {','.join(rest[:used])}; only a refine "
                               f"stage may follow (RFlat or Refine(SQ8)); supported forms: {SUPPORTED}")
        refine = r["code"] or "Flat"
        if not _CODE.match(refine):
            raise FactoryError(f"{text!r}: Refine({refine}) is not a code (use Flat, SQfp16, SQ8 or PQ{{M}})")
        fields["refine"] = refine
    for name in ("nlist", "hnsw_m", "pq_m", "opq_m", "transform_dim"):
        if name in fields and fields[name] == 0 and (name != "transform_dim" or fields.get("transform", "")[:3] == "PCA"):
            raise FactoryError(f"{text!r}: the number in each stage must be at least 1")
    if fields.get("pq_bits") and not 1 <= fields["pq_bits"] <= 16:
        raise FactoryError(f"{text!r}: PQ codes have 1 to 16 bits per sub-quantizer (e.g. PQ16x8)")
    canonical = ",".join(stages)
    return IndexSpec(factory=canonical, **fields)


def _code_fields(stage: str, m: re.Match) -> dict:
    if m["pq"]:
        bits = int(m["bits"] or (4 if m["fs"] else 8))
        return {"code": stage, "pq_m": int(m["pq"]), "pq_bits": bits}
    return {"code": stage}


def check_spec(spec: IndexSpec, *, dim: int, rows: int) -> list[str]:
    """Checks that need the dimension and the corpus size. Raises :class:`FactoryError`;
    returns warnings (quality, not correctness)."""
    warnings: list[str] = []
    d = spec.stored_dim(dim)
    if spec.transform_dim and spec.transform.startswith("PCA") and spec.transform_dim > dim:
        raise FactoryError(f"{spec.factory}: PCA to {spec.transform_dim} dimensions, but the vectors have {dim}")
    if spec.opq_m and d % spec.opq_m:
        raise FactoryError(f"{spec.factory}: OPQ{spec.opq_m} needs a dimension divisible by {spec.opq_m}, "
                           f"got {d} (use an OPQ M dividing {d}, e.g. {_divisor_near(d, spec.opq_m)})")
    for m, what in ((spec.pq_m, spec.code), (_refine_pq(spec.refine), f"Refine({spec.refine})")):
        stored = d if what == spec.code else dim
        if m and stored % m:
            raise FactoryError(f"{spec.factory}: {what} splits vectors into {m} sub-vectors, but {m} does not "
                               f"divide the dimension {stored} (use PQ{_divisor_near(stored, m)}, a divisor of {stored})")
    k = spec.train_centroids
    if k and rows < k:
        raise FactoryError(f"{spec.factory}: training needs at least {k:,} vectors (one per centroid), the corpus "
                           f"has {rows:,} rows (use fewer IVF lists or PQ bits, or output.index: auto)")
    if k and rows < 39 * k:
        warnings.append(f"{spec.factory}: {rows:,} rows train {k:,} centroids with fewer than the 39 points per "
                        f"centroid FAISS asks for; expect lower recall (fewer IVF lists or PQ bits fit better)")
    _faiss_accepts(spec, dim)
    return warnings


def _refine_pq(refine: str) -> int:
    m = re.fullmatch(r"PQ(\d+)(?:x\d+)?", refine)
    return int(m.group(1)) if m else 0


def _divisor_near(d: int, m: int) -> int:
    divisors = [x for x in range(1, d + 1) if d % x == 0]
    return min(divisors, key=lambda x: (abs(x - m), -x))


def _faiss_accepts(spec: IndexSpec, dim: int) -> None:
    import faiss

    try:
        faiss.index_factory(dim, spec.factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1]
        raise FactoryError(f"FAISS rejects {spec.factory!r} for dimension {dim}: {reason}") from None
