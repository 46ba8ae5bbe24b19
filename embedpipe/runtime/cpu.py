"""Process settings and matmul choice for an encoder replica on CPU.

glibc malloc hands blocks above its mmap threshold (128 KiB, adapting up to 32 MiB) to the
kernel on free and maps fresh zeroed pages on the next allocation, so every encoder step
page-faults its activations back in: an 8192-token MiniLM step allocates [8192, 1536] float32
(48 MiB) several times per layer. Measured (all-MiniLM-L6-v2, 1,000 kernel-docs paragraphs,
8192-token steps): ~600k minor faults, and 7% more fp32 tokens per CPU-second without them
(3,949 -> 4,209 on one thread); on two threads bf16 8192-token steps were slower than 4096-token
ones with the faults and faster without. With the oneDNN linears below the faults weigh more: the
quickstart's 3,000 rows on one thread took 21.1 s without the setting and 16.2 s with it, for a peak
resident memory of 1.69 GiB instead of 1.14 GiB. Keeping freed memory in the heap removes them; the
process then holds its peak memory until it exits, which suits a dedicated embedding worker
(``runtime.cpu_keep_memory: false`` turns it off).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import socket
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

# oneDNN keeps every primitive it builds (by default up to 1,024) with its buffers, and the encoder hands it a new
# token count in almost every batch: before the linears padded their rows (padded_rows), a worker's memory grew
# with the corpus (a tiny BERT over 1M rows: worker peak 708 -> 1,247 MiB). With no cache at all, though, every
# call rebuilds its primitive: on 2 cores of an Intel Xeon with AMX-BF16, MiniLM's bf16 linears then ran at
# ~1,050 GFLOP/s instead of ~2,500 and the whole bf16 encoder at 13.4-13.8k tokens/s instead of 16.2-16.6k (3%
# on AMD in fp32). A small cache keeps a batch's primitives (a layer's few linear shapes at one padded row count,
# reused by every layer) and a few batches' more, and is bounded by its capacity, not the corpus (the matmul
# attention keeps its varying shapes off oneDNN: kernels/cpu.py). Read by oneDNN when it first builds a
# primitive, so it is set on import; an explicit setting wins (0 turns the cache off).
ONEDNN_CACHE_CAPACITY = 64
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h> mallopt parameters
_applied: list[bool] = []


def keep_freed_memory(*, limit_bytes: int = 1 << 30) -> bool:
    """Serve blocks up to ``limit_bytes`` from the malloc heap and never trim it (glibc only;
    a no-op elsewhere). Idempotent; returns whether the settings are in effect."""
    if _applied:
        return _applied[0]
    ok = False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator alone
        mallopt = None
    if mallopt is not None:
        ok = bool(mallopt(M_MMAP_THRESHOLD, limit_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, limit_bytes))
    log.info("CPU allocator: freed blocks up to %d MiB stay in the heap: %s", limit_bytes >> 20, ok)
    _applied.append(ok)
    return ok


class OneDNNLinear(nn.Module):
    """An nn.Linear computed by oneDNN (torch's mkldnn linear op) instead of MKL's sgemm.

    torch sends float32 matmuls to MKL, which on AMD CPUs runs its AVX2 code; oneDNN uses
    AVX-512 there. Measured on 2 Zen 5 cores, MiniLM shapes ([8192, 384] x [384, 1536] and
    [8192, 1536] x [1536, 384]): MKL 170-218 GFLOP/s, oneDNN 287-490 GFLOP/s. The parameters
    are shared with the module it replaces; results differ by float32 summation order only.

    The weight is also held reordered into oneDNN's blocked layout (``packed``), so no call reorders it: the same
    bits, MiniLM on an AMX Xeon fp32 1.05x, bf16 1.01-1.03x (docs/performance.md, 2026-12-04), for a second copy of
    the linears' weights in memory. It is packed again if the weight changes in place (its version counter) or is
    replaced (its storage).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # [out, in], [out] or None
        self._packed: tuple[tuple[int, int], Tensor] | None = None  # ((storage, version) packed from, blocked weight)

    @property
    def packed(self) -> Tensor:
        """The weight in oneDNN's blocked layout for PACK_ROWS-row inputs (any row count gives the plain weight's bits,
        frozen and in inference mode as the encoder runs: with autograd on, oneDNN may take its reference kernel)."""
        source = (self.weight.data_ptr(), self.weight._version)  # a new tensor, or the same one changed in place
        if self._packed is None or self._packed[0] != source:
            with torch.no_grad():
                self._packed = (source, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS))
        return self._packed[1]

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_packed": None}  # a oneDNN tensor does not pickle; packed again on use

    def forward(self, x: Tensor) -> Tensor:
        return self._pointwise(x, "none", "")

    def activated(self, x: Tensor, *, act: str) -> Tensor | None:
        """``act``(self(x)) in one call, the activation a oneDNN post-op on the accumulator (ONEDNN_ACTIVATIONS);
        None for an activation it has no exact post-op for (models/layers.py linear_act then applies it)."""
        post = ONEDNN_ACTIVATIONS.get(act)
        return None if post is None else self._pointwise(x, *post)

    def add_to(self, x: Tensor, residual: Tensor) -> Tensor | None:
        """residual + self(x) in one call (oneDNN's binary add post-op: the add on the accumulator, one rounding in
        bf16); None where the residual's dtype differs (models/layers.py linear_add then adds)."""
        if residual.dtype != x.dtype:
            return None
        n = x.numel() // x.shape[-1]
        rows, other = _padded(x.reshape(n, -1)), _padded(residual.reshape(n, -1))  # [N', in], [N', out]
        out = torch.ops.mkldnn._linear_pointwise.binary(rows, other, self.packed, self.bias, "add")[:n]  # [N, out]
        return out.view(*x.shape[:-1], out.shape[-1])

    def _pointwise(self, x: Tensor, attr: str, algorithm: str) -> Tensor:
        n = x.numel() // x.shape[-1]
        rows = _padded(x.reshape(n, -1))  # [N', in]
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, attr, [], algorithm)[:n]  # [N, out]
        return out.view(*x.shape[:-1], out.shape[-1])


def _padded(rows: Tensor) -> Tensor:
    """[N, w] -> [padded_rows(N), w]: zero rows below (few distinct shapes, see padded_rows); ``rows`` itself when it is
    that tall already (the CPU runner pads its pack once: runtime/runners.py)."""
    n = rows.shape[0]
    padded = padded_rows(n)
    if padded == n:
        return rows
    grown = rows.new_empty(padded, rows.shape[1])  # [N', w]: F.pad zeroed all of it before copying
    grown[:n].copy_(rows)  # (its fill was 5% of the fp32 step on an AMX CPU)
    grown[n:].zero_()
    return grown


# config.json `hidden_act` -> oneDNN's post-op (attr, algorithm) for OneDNNLinear.activated: only those bit-identical
# in fp32 to the activation applied after the linear (tests/test_runtime_cpu.py); tanh-GELU and SiLU differ by an ulp
ONEDNN_ACTIVATIONS: dict[str, tuple[str, str]] = {"gelu": ("gelu", "none"), "relu": ("relu", "")}


PACK_ROWS = 8192  # the input rows OneDNNLinear's blocked weight layout is chosen for: a full batch at max_tokens 8192
ROW_STEPS = ((2048, 256), (256, 64), (0, 16))  # (above this many rows, pad to a multiple of this)


def padded_rows(n: int) -> int:
    """Rows a oneDNN linear computes for ``n``: a multiple of 256 above 2,048 rows, of 64 above 256,
    else of 16. oneDNN keeps memory per input shape it has seen (even with its primitive cache off: a
    tiny BERT's worker grew ~90 MiB per 200k rows with one shape per 64 rows, ~10 with one per 256, as
    without oneDNN), and the packer makes a new token count in almost every batch; these steps allow
    68 shapes up to 8,192 rows for at most 3% padding on full batches (<= 24% on rare small ones). The CPU
    encoder's runner pads its pack to this once per forward (runtime/runners.py EagerRunner ``rows_for``), so the
    linears meet inputs already this tall and copy nothing (a copy per linear was ~10 % of MiniLM's bf16 step)."""
    step = next(step for above, step in ROW_STEPS if n > above)
    return -(-n // step) * step


ONEDNN_DTYPES = (torch.float32, torch.bfloat16)  # float16 has no fast path on these CPUs: left to torch


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every float32 / bfloat16 nn.Linear under ``model`` for a OneDNNLinear when torch has the op and it
    agrees with F.linear on a probe in that dtype (bfloat16 needs a CPU oneDNN has a bf16 kernel for: an
    AVX2-only CPU has none); returns how many were swapped (0: left as it was)."""
    twins = _onednn_twins(model)
    _place(twins, library="onednn")
    log.info("CPU matmuls through oneDNN: %d linear layers", len(twins))
    return len(twins)


Twin = tuple[nn.Module, str, nn.Linear, "OneDNNLinear"]  # (parent, attribute, torch's linear, its oneDNN twin)


def _onednn_twins(model: nn.Module) -> list[Twin]:
    """Every linear under ``model`` that oneDNN can run, with its OneDNNLinear (sharing its parameters)."""
    return [(parent, name, child, OneDNNLinear(child))
            for parent in list(model.modules()) for name, child in list(parent.named_children())
            if type(child) is nn.Linear and child.weight.dtype in ONEDNN_DTYPES and child.weight.device.type == "cpu"
            and onednn_linear_works(child.weight.dtype)]


def _place(twins: list[Twin], *, library: str) -> None:
    for parent, name, linear, twin in twins:
        setattr(parent, name, twin if library == "onednn" else linear)


def place_linears(model: nn.Module, *, choice: str) -> str:
    """runtime.cpu_linears on ``model``'s CPU linears: "onednn" (where it runs correctly), "torch" (left as they
    are) or "auto" (choose_linears: measured once per machine); returns the library used."""
    if choice == "auto":
        return choose_linears(model)
    if choice == "onednn":
        return "onednn" if use_onednn_linears(model) else "torch"
    return "torch"


def choose_linears(model: nn.Module) -> str:
    """Put ``model``'s CPU linears on the faster GEMM library here, measured (not assumed by CPU vendor): "onednn"
    (swapped, see use_onednn_linears) or "torch" (left to torch's own: MKL or its BLAS). The probe is the model's
    own forward (forward_timings), so it weighs what the model runs: oneDNN's fused post-ops, GELU and the residual
    add, included. oneDNN stays unless torch's forward measures faster by TORCH_MARGIN, and the answer is cached
    per machine, model shape and dtype (``cpu_linears.json`` in the embedpipe cache; whatever the thread count of
    the process that measured), so every worker of a machine makes the same choice and computes the same bits.
    Where oneDNN cannot run the model's dtype (bfloat16 on AVX2), nothing is timed."""
    twins = _onednn_twins(model)
    if not twins:
        return "torch"
    dtype, threads = twins[0][2].weight.dtype, torch.get_num_threads()
    dims = tuple(sorted({(linear.in_features, linear.out_features) for _, _, linear, _ in twins}))
    key = f"{socket.gethostname()}|{type(model).__name__}|{dtype}|{dims}|torch={torch.__version__}"
    choice = _cached_choice(key, lambda: _faster(forward_timings(model, twins)))
    _place(twins, library=choice)
    log.info("CPU linears (%s, %d threads): %s", dtype, threads, choice)
    return choice


# torch's GEMMs replace oneDNN's only when the model's forward on oneDNN takes 10% longer. MiniLM fp32 on 2 cores of
# an AVX2-only AMD EPYC (Zen 3): oneDNN's forward 1.20-1.22x torch's (MKL's AVX2 sgemm 180 GFLOP/s against oneDNN's
# 161, and oneDNN's GELU post-op at 109), end to end 1.20x; on AVX-512 CPUs oneDNN wins by far (Zen 5: 287-490
# GFLOP/s against MKL's 170-218), so neither is near the line (docs/performance.md, 2026-12-05)
TORCH_MARGIN = 1.10
PROBE_REPEATS = 3  # timed forwards per library at most, best kept, after one that warms up (primitives, packing, pages)
# after the first timed round, a oneDNN / torch ratio outside CLEAR decides without the other rounds: no slower, or
# slower by 20 %, is far enough from TORCH_MARGIN that a 4 % spread cannot cross it (MiniLM fp32 with one thread on a
# Zen 4: 0.89-0.92, every round within 4 % of its best; Zen 3: 1.20-1.25). Saves a machine's first run ~1 s
CLEAR = (1.0, 1.2)
PROBE_SEQ_LEN, PROBE_TOKENS = 64, 1024  # the probe's pack: 64-token sequences (a paragraph), 1,024 tokens at most
PROBE_FLOPS = 25e9  # fewer tokens (down to one sequence) where a forward would cost more: a large model's probe


def _faster(timings: dict[str, float]) -> str:
    choice = "torch" if timings["onednn"] > TORCH_MARGIN * timings["torch"] else "onednn"
    log.info("CPU linears measured, ms per forward: oneDNN %.1f, torch %.1f -> %s", timings["onednn"] * 1e3,
             timings["torch"] * 1e3, choice)
    return choice


def _cached_choice(key: str, measure) -> str:
    """The machine's answer for ``key`` from the cache file, measured under its lock when missing."""
    import fcntl
    import json

    from embedpipe.io.cache import cache_dir

    path = cache_dir() / "cpu_linears.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one measurement per machine at a time; the others read it
        try:
            table = dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            table = {}
        if key not in table:
            table[key] = measure()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
    return table[key]


def probe_pack(model: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
    """The probe's packed batch for ``model``: token ids, positions and cu_seqlens ([T], [T], [n + 1]) of n
    PROBE_SEQ_LEN-token sequences, T at most PROBE_TOKENS and at most PROBE_FLOPS of forward (at least one)."""
    per_sequence = model.flops_per_token(PROBE_SEQ_LEN) * PROBE_SEQ_LEN
    n = max(1, min(PROBE_TOKENS // PROBE_SEQ_LEN, int(PROBE_FLOPS // per_sequence)))
    tokens = n * PROBE_SEQ_LEN
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=g)  # [T]
    positions = torch.arange(PROBE_SEQ_LEN).repeat(n)  # [T]
    return ids, positions, torch.arange(0, tokens + 1, PROBE_SEQ_LEN, dtype=torch.int32)  # [n + 1]


def forward_timings(model: nn.Module, twins: list[Twin]) -> dict[str, float]:
    """Best-of-PROBE_REPEATS seconds of ``model``'s forward on probe_pack's batch with its linears on oneDNN (the
    ``twins``) and on torch's, interleaved (one timed round where its ratio is outside CLEAR); the model is left on
    torch's."""
    ids, positions, cu = probe_pack(model)
    best = {"onednn": float("inf"), "torch": float("inf")}
    with torch.inference_mode():
        for rep in range(PROBE_REPEATS + 1):  # pass 0 warms up (primitive creation, weight packing, page faults)
            for library in best:
                _place(twins, library=library)
                began = time.perf_counter()
                model(ids, positions, cu, PROBE_SEQ_LEN)
                if rep:
                    best[library] = min(best[library], time.perf_counter() - began)
            if rep == 1 and not CLEAR[0] <= best["onednn"] / best["torch"] <= CLEAR[1]:
                break
    _place(twins, library="torch")
    return best


@functools.cache
def onednn_linear_works(dtype: torch.dtype = torch.float32) -> bool:
    """Whether torch's oneDNN linear op runs here in ``dtype`` and agrees with F.linear on a probe."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if op is None or dtype not in ONEDNN_DTYPES:
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = (t.to(dtype) for t in (torch.randn(64, 96, generator=g), torch.randn(80, 96, generator=g),
                                     torch.randn(80, generator=g)))
    try:
        got = op(x, w, b, "none", [], "")
    except RuntimeError:  # e.g. bfloat16 on a CPU without AVX-512 BF16 / AMX: no primitive to create
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol))
