"""What a worker runs on, and how fast that device can multiply: the denominator of MFU.

``describe_device`` names the device (GPU name, or CPU model and threads) and measures its peak
rate with a short square-matmul probe, through every matmul the encoder may use there (on CPU:
torch's own mm and linear, i.e. MKL, and oneDNN's linear op, which the CPU encoder runs; the fastest counts), so
MFU is against the best this device does, never above 100% because the probe took a slower path. The probe runs once per machine: its result is cached in
``~/.cache/embedpipe/peak_flops.json`` (``EMBEDPIPE_CACHE_DIR`` moves it), keyed by host, device,
threads, dtype and torch version, under a file lock so that workers starting together on one host
measure once instead of slowing each other down. Delete the file to measure again.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from embedpipe.io.cache import cache_dir

log = logging.getLogger(__name__)

# square matmul sizes probed and the seconds of timed repeats per size and matmul: the fastest repeat wins. CPU: 0.1 s
# measured within 1.5 % of 0.25 s (1 thread of a Zen 4: 108.7-112.9 against 109.8-113.4 GFLOP/s) and saves a
# machine's first run 0.9 s; GPUs keep 0.25 s for their clocks to settle
PROBE_SIZES: dict[str, tuple[int, ...]] = {"cpu": (512, 1024), "cuda": (4096, 8192)}
PROBE_SECONDS: dict[str, float] = {"cpu": 0.1, "cuda": 0.25}
PROBE_VERSION = 3  # in the cache key: 2 added the oneDNN matmul to the CPU probe, 3 torch's linear


@dataclass(frozen=True)
class DeviceInfo:
    kind: Literal["cpu", "cuda"]
    name: str  # "NVIDIA H100 80GB HBM3", or the CPU model
    count: int = 1  # priced devices this worker holds: its GPUs, or 1 CPU slot
    threads: int = 1  # torch intra-op threads of the worker
    host: str = ""
    peak_flops: dict[str, float] = field(default_factory=dict)  # dtype -> measured FLOP/s of this worker's devices
    linears: str = ""  # CPU: the GEMM library its linear layers ran on, "onednn" or "torch" (runtime.cpu_linears)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceInfo":
        return cls(**{**data, "peak_flops": dict(data.get("peak_flops", {}))})


def cpu_model() -> str:
    """The CPU model name as /proc/cpuinfo spells it (falls back to platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_device(device: str, *, dtypes: tuple[str, ...] = ("float32",), probe: bool = True,
                    linears: str = "") -> DeviceInfo:
    """Name this process's device ("cpu" or "cuda") and its measured peak FLOP/s per dtype (model.dtype values:
    "auto" is probed as what it resolves to on this device, and keyed by that name); ``linears``: the encoder's
    CPU GEMM library (Encoder.linears), reported as it is."""
    import torch

    from embedpipe.config import resolve_dtype

    threads = torch.get_num_threads()
    if device == "cuda":
        name, count = torch.cuda.get_device_name(torch.cuda.current_device()), 1
    else:
        name, count = cpu_model(), 1
    info = DeviceInfo(kind="cuda" if device == "cuda" else "cpu", name=name, count=count,
                      threads=threads, host=socket.gethostname(), linears=linears)
    if not probe:
        return info
    try:
        names = dict.fromkeys(resolve_dtype(d, device=info.kind) for d in ("float32", *dtypes))
        peaks = {dtype: cached_peak(info, dtype) for dtype in names}
    except Exception as exc:  # a failed probe costs the MFU figure, never the run
        log.warning("peak FLOP/s probe failed on %s (%s): MFU will be unknown", name, exc)
        return info
    return DeviceInfo(**{**asdict(info), "peak_flops": peaks})


def slower_than_float32(info: DeviceInfo, dtype: str, *, setting: str = "model.dtype", subject: str = "this run",
                        fix: str = "model.dtype: float32 (or auto)") -> str | None:
    """One warning line when ``dtype`` (a model.dtype) measured a slower matmul peak on this device than float32
    (a CPU with no native bfloat16 or float16 matmul computes them in emulation, several times slower), else None.
    ``setting``, ``subject`` and ``fix`` word it for the caller: a job's run and its model.dtype, or ``embed()`` and
    its ``dtype=`` option. Measured by the probe, not assumed from the CPU's vendor or flags."""
    from embedpipe.config import resolve_dtype

    resolved = resolve_dtype(dtype, device=info.kind)
    low, full = info.peak_flops.get(resolved), info.peak_flops.get("float32")
    if resolved == "float32" or not low or not full or low >= full:
        return None
    return (f"{setting} {resolved} on {info.name}: its {resolved} matmul measured {low / 1e9:,.0f} GFLOP/s against "
            f"{full / 1e9:,.0f} in float32 (no native {resolved} matmul here), so {subject} is slower than float32, "
            f"whose vectors are exact: set {fix} for this machine")


def cache_path() -> Path:
    return cache_dir() / "peak_flops.json"


def cache_key(info: DeviceInfo, dtype: str) -> str:
    """The cache's key of one probe: host, device, threads, dtype, torch and the probe's version."""
    import torch

    return (f"{info.host}|{info.kind}|{info.name}|threads={info.threads}|{dtype}|torch={torch.__version__}"
            f"|probe={PROBE_VERSION}")


def cached_peak(info: DeviceInfo, dtype: str) -> float:
    """The cached peak for this device and dtype, measured (under a lock) when missing."""
    import fcntl

    key = cache_key(info, dtype)
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one probe per host at a time; the others then read the cache
        table = _read(path)
        if key not in table:
            table[key] = max(measure_peak_flops(info.kind, dtype, size=n) for n in PROBE_SIZES[info.kind])
            log.info("peak %s %s: %.3g FLOP/s (cached in %s)", info.name, dtype, table[key], path)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
    return float(table[key])


def measure_peak_flops(kind: str, dtype: str, *, size: int, seconds: float | None = None) -> float:
    """FLOP/s of the fastest of a few size x size matmuls (2 n^3 FLOPs each) on this process's device,
    over each matmul implementation the encoder may run there."""
    import torch

    seconds = PROBE_SECONDS[kind] if seconds is None else seconds
    n = size
    dev = "cuda" if kind == "cuda" else "cpu"
    dt = getattr(torch, dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dt, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dt, generator=g)
    small = (a[:64, :64].contiguous(), b[:64, :64].contiguous())  # [64, 64] x 2
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    best = float("inf")
    with torch.inference_mode():
        for mm in _matmuls(kind, dt):
            mm(*small)  # warm-up (library load, dispatch) on a small product: a full-size one costs an emulated
            sync()  # bfloat16 torch.mm 2 s at 1024 on an AVX2 CPU, and the first timed repeat pays the rest
            deadline = time.perf_counter() + seconds
            for _ in range(200):
                start = time.perf_counter()
                mm(a, b)
                sync()
                best = min(best, time.perf_counter() - start)
                if time.perf_counter() > deadline:
                    break
    return 2.0 * n**3 / best


def _matmuls(kind: str, dtype) -> list:
    """(a, b) -> an n x n product of them (2 n^3 FLOPs), for each implementation the encoder may use here."""
    import torch

    found = [torch.mm]
    if kind == "cpu":
        # torch's linear (a @ b^T), what the encoder's linears run where oneDNN's op is not used: on a CPU with no
        # native bfloat16 its transposed-B kernel runs far faster than torch.mm (2-core AVX2 EPYC: 21 against 1 GFLOP/s)
        found.append(torch.nn.functional.linear)
        from embedpipe.runtime.cpu import ONEDNN_DTYPES, onednn_linear_works

        if dtype in ONEDNN_DTYPES and onednn_linear_works(dtype):
            op = torch.ops.mkldnn._linear_pointwise
            found.append(lambda a, b: op(a, b, None, "none", [], ""))  # a @ b^T: same FLOPs, same shapes
    return found


def _read(path: Path) -> dict[str, float]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}
