"""CPU speed: sentence-transformers `encode` against our packed engine, in one process.

Same corpus (a seeded sample of Linux kernel docs paragraphs), same model (the packaged
all-MiniLM-L6-v2), same torch thread count. Prints, for sentence-transformers at its best batch
size and for our engine in float32 and bfloat16: real (unpadded) tokens per second, the ratio to
sentence-transformers, peak memory, cosine against sentence-transformers' vectors, and model-FLOPs
utilisation against this machine's measured fp32 / bf16 matmul rate (the report's probe, embedpipe/report/bench.py).

The machine may be shared, so absolute timings are noisy: the corpus is cut into chunks and the
contenders run interleaved on each chunk, several times; each (contender, chunk) keeps its best
time. The ratio therefore compares best case with best case, measured over the same minutes.

    .venv/bin/python scripts/bench_cpu.py                   # ~2-3 minutes on 2 quiet cores
    .venv/bin/python scripts/bench_cpu.py --rows 500 --repeats 2 --batch-sizes 32   # a quick look
    .venv/bin/pip install -e '.[bench]' && .venv/bin/python scripts/bench_cpu.py --peers --cli   # every row

``--peers`` adds ONNX Runtime and OpenVINO (fp32, and bf16 where the CPU has it) on the packaged model exported
offline in this run (scripts/bench_peers.py says why not through sentence-transformers' own backends);
``--cli`` adds the product end to end: `embedpipe run` on a local Ray, 1 worker x --threads, the same rows,
start-up subtracted (scripts/bench_pipeline.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from bench_sample import add_sample_arguments, cpu_description, load_texts

ROOT = Path(__file__).resolve().parents[1]
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_arguments(p, rows=2000)
    p.add_argument("--threads", type=int, default=2, help="torch threads for every contender")
    p.add_argument("--chunks", type=int, default=8, help="the corpus is timed in this many interleaved chunks")
    p.add_argument("--repeats", type=int, default=3, help="timed passes; each (contender, chunk) keeps its best")
    p.add_argument("--batch-sizes", default="16,32,64", help="sentence-transformers batch sizes to try")
    p.add_argument("--max-tokens", type=int, default=None, help="our batching.max_tokens (default: the job default)")
    p.add_argument("--ablations", action="store_true",
                   help="also time our fp32 engine with runtime.cpu_linears torch (MKL) and auto (measured), and "
                        "with the sdpa attention backend")
    p.add_argument("--peers", action="store_true", help="also time ONNX Runtime and OpenVINO (the bench extra)")
    p.add_argument("--cli", action="store_true", help="also time `embedpipe run` end to end (1 worker x --threads)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--memory-of", choices=list(MEMORY_RUNS), default=None,
                   help="(internal) measure one contender's peak memory in this process and print it")
    return p.parse_args()


# --------------------------------------------------------------------------- measuring


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every 5 ms from /proc (Linux)."""

    def __init__(self) -> None:
        self.peak = 0

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> "PeakRSS":
        self.base, self.peak, self._stop = self.rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.rss() - self.base)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss() - self.base)


@dataclass
class Contender:
    name: str
    run: Callable[[list[str]], np.ndarray]  # texts -> vectors [N, D]
    best: dict[int, float] = field(default_factory=dict)  # chunk -> best seconds
    cpu: dict[int, float] = field(default_factory=dict)  # chunk -> process CPU seconds of the best run
    vectors: np.ndarray | None = None


def time_interleaved(contenders: list[Contender], chunks: list[list[str]], *, repeats: int) -> None:
    for rep in range(repeats):
        for c, texts in enumerate(chunks):
            for contender in contenders:
                wall, cpu = time.perf_counter(), time.process_time()
                contender.run(texts)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                if wall < contender.best.get(c, float("inf")):
                    contender.best[c], contender.cpu[c] = wall, cpu
        print(f"  pass {rep + 1}/{repeats}: " + ", ".join(
            f"{k.name} {sum(k.best.values()):.1f}s" for k in contenders), file=sys.stderr, flush=True)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


# --------------------------------------------------------------------------- main

MEMORY_RUNS = ("st", "float32", "bfloat16")
PEERS = {"ONNX Runtime fp32 (exported, ORT_ENABLE_ALL)": "onnx", "OpenVINO fp32": "openvino-f32",
         "OpenVINO bf16": "openvino-bf16"}


def matmul_dtype(kind: str) -> str:
    """The dtype whose matmul rate a contender's MFU is against."""
    if kind in ("st", "onnx", "openvino-f32", "cli"):
        return "float32"
    return "bfloat16" if kind == "openvino-bf16" else kind.partition("-")[0]


def build(kind: str, args: argparse.Namespace, *, st_batch_size: int = 32) -> Callable[[list[str]], np.ndarray]:
    """One contender's texts -> vectors function, its model loaded. kind: "st", a dtype, or an
    ablation "float32-torch" (runtime.cpu_linears: torch, torch's own linears), "float32-auto" (cpu_linears: auto, the
    library measured faster here) or "float32-sdpa" (the sdpa attention backend)."""
    from embedpipe.models.resolve import resolve_model_path

    model_dir = str(resolve_model_path(MODEL))
    if kind == "st":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(model_dir, device="cpu")
        return lambda texts: st.encode(texts, batch_size=st_batch_size)
    if kind in PEERS.values():
        import bench_peers

        onnx_path = args.work / "model.onnx"
        if not onnx_path.exists():
            print(f"ONNX export: {bench_peers.export_onnx(model_dir, onnx_path):.1f} s", file=sys.stderr)
        if kind == "onnx":
            return bench_peers.onnxruntime_runner(model_dir, onnx_path, threads=args.threads, batch_size=st_batch_size)
        return bench_peers.openvino_runner(model_dir, onnx_path, threads=args.threads, batch_size=st_batch_size,
                                           precision=kind.partition("-")[2])
    from embedpipe.runtime import Encoder, cpu

    dtype, _, ablation = kind.partition("-")
    extra = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    if ablation == "sdpa":
        extra["attention"] = "sdpa"
    elif ablation in ("torch", "auto"):
        extra["cpu_linears"] = ablation
    encoder = Encoder.from_options(model_dir, dtype=dtype, threads=args.threads, **extra)
    if ablation == "auto":
        on = "oneDNN" if any(isinstance(m, cpu.OneDNNLinear) for m in encoder.loaded.model.modules()) else "torch"
        print(f"cpu_linears auto chose {on}'s linears here", file=sys.stderr)
    return encoder.embed


def peak_memory(kind: str, args: argparse.Namespace, *, st_batch_size: int) -> int:
    """Peak RSS above the loaded model while one contender embeds one chunk, in a fresh process."""
    import subprocess

    cmd = [sys.executable, __file__, "--memory-of", kind, "--corpus", str(args.corpus), "--rows", str(args.rows),
           "--seed", str(args.seed), "--threads", str(args.threads), "--batch-sizes", str(st_batch_size),
           "--chunks", str(args.chunks)]
    if args.max_tokens is not None:
        cmd += ["--max-tokens", str(args.max_tokens)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1])


def memory_only(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    texts = load_texts(args)[::args.chunks]  # the first chunk
    run = build(args.memory_of, args, st_batch_size=int(args.batch_sizes.split(",")[0]))
    run(texts[:8])  # lazy initialisation is not part of the peak
    with PeakRSS() as mem:
        run(texts)
    print(mem.peak)
    return 0


def main() -> int:
    args = parse_args()
    if not args.corpus.is_file():
        print(f"skipped: corpus {args.corpus} is absent (it lives in ../shared/data next to the repository; "
              f"pass --corpus PATH to a Parquet file with a `text` column)")
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.memory_of:
        return memory_only(args)
    import torch

    from embedpipe.models.resolve import resolve_model_path
    from embedpipe.report.bench import matmul_peak, model_flops
    from embedpipe.report.flops import read_model_config
    from embedpipe.text.tokenizer import TextTokenizer

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}; load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    import tempfile

    args.work = Path(tempfile.mkdtemp(prefix="bench_cpu_"))
    sys.path.insert(0, str(Path(__file__).parent))  # bench_peers, bench_pipeline
    texts = load_texts(args)
    order = chunk_order(len(texts), chunks=args.chunks)  # every chunk spans the whole length range
    chunks = [[texts[i] for i in part] for part in order]
    model_dir = resolve_model_path(MODEL)
    lengths = TextTokenizer(model_dir, max_seq_len=256)(texts).lengths
    real_tokens = int(lengths.sum())
    print(f"corpus: {len(texts):,} rows of {args.corpus.name} (seed {args.seed}), {real_tokens:,} real tokens, "
          f"mean {lengths.mean():.1f}, max {lengths.max()}; torch {torch.__version__}, {args.threads} threads",
          file=sys.stderr)

    # sentence-transformers' best batch size, on one chunk, interleaved and best of 2
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    trial = [Contender(f"st bs={bs}", build("st", args, st_batch_size=bs)) for bs in sizes]
    time_interleaved(trial, chunks[:1], repeats=2)
    best_bs = sizes[int(np.argmin([c.best[0] for c in trial]))]
    print("sentence-transformers batch sizes: " + ", ".join(f"{bs}: {c.best[0]:.2f}s" for bs, c in zip(sizes, trial))
          + f" -> {best_bs}", file=sys.stderr)

    kinds = {"embedpipe fp32": "float32", "embedpipe bf16": "bfloat16"}
    if args.ablations:
        kinds |= {"embedpipe fp32, cpu_linears torch (MKL)": "float32-torch",
                  "embedpipe fp32, cpu_linears auto (measured)": "float32-auto",
                  "embedpipe fp32, sdpa attention": "float32-sdpa"}
    contenders = [Contender(f"sentence-transformers fp32 (batch {best_bs})", trial[sizes.index(best_bs)].run)]
    contenders += [Contender(name, build(kind, args)) for name, kind in kinds.items()]
    if args.peers:
        for name, kind in PEERS.items():
            run = build(kind, args, st_batch_size=best_bs)
            if run is None:
                print(f"{name}: not measured here (the CPU has no bf16 matmul OpenVINO uses)", file=sys.stderr)
                continue
            contenders.append(Contender(f"{name} (batch {best_bs})", run))
            kinds[contenders[-1].name] = kind
    del trial
    for c in contenders:  # warm up, and the vectors for the cosine
        c.vectors = np.concatenate([c.run(chunk) for chunk in chunks])
    time_interleaved(contenders, chunks, repeats=args.repeats)

    # model FLOPs: per token at each sequence's own length, over the corpus (the family's rule, no weights)
    flops = model_flops(read_model_config(str(model_dir)), lengths) / real_tokens
    # the machine's best matmul rate per dtype: the report's probe (torch and oneDNN, square matmuls)
    rates = {dt: matmul_peak("cpu", dt) for dt in ("float32", "bfloat16")}
    st_padded = sum(int(lengths[b].max()) * len(b) for b in _st_batches(texts, best_bs))
    with ThreadPoolExecutor(len(MEMORY_RUNS)) as pool:  # one fresh process each, its peak its own: side by side
        peaks = dict(zip(MEMORY_RUNS, pool.map(lambda kind: peak_memory(kind, args, st_batch_size=best_bs),
                                                MEMORY_RUNS)))

    base = sum(contenders[0].best.values())
    results = []
    if args.cli:
        contenders.append(cli_contender(texts, args, order=np.concatenate(order)))
        kinds[contenders[-1].name] = "cli"
    for c, kind in zip(contenders, ["st", *kinds.values()]):
        dt = matmul_dtype(kind)
        peak = peaks.get(kind)
        seconds = sum(c.best.values())
        tps = real_tokens / seconds
        cos = cosine(c.vectors, contenders[0].vectors)
        results.append({
            "contender": c.name, "seconds": round(seconds, 3), "tokens_per_s": round(tps, 1),
            "tokens_per_cpu_s": round(real_tokens / sum(c.cpu.values()), 1) if c.cpu else None, "ratio": round(base / seconds, 3),
            "peak_mib": None if peak is None else round(peak / 2**20, 1), "cos_min": float(cos.min()), "cos_mean": float(cos.mean()),
            "mfu": round(tps * flops / rates[dt], 4), "matmul_dtype": dt,
        })
    print_table(results, flops=flops, rates=rates, padded_fraction=1 - real_tokens / st_padded, args=args,
                rows=len(texts), tokens=real_tokens)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "flops_per_token": flops, "matmul_flops": rates,
                                         "st_batch_size": best_bs}, indent=2))
    return 0


def chunk_order(rows: int, *, chunks: int) -> list[np.ndarray]:
    """The rows of each timed chunk, every ``chunks``-th row: the in-process contenders' vectors are their chunks'
    concatenated, so any other contender's vectors are put in this order before the cosine."""
    return [np.arange(i, rows, chunks) for i in range(chunks)]


def cli_contender(texts: list[str], args: argparse.Namespace, *, order: np.ndarray) -> Contender:
    """`embedpipe run` on these rows (1 worker x --threads, float32, 500-row units), best of --repeats by encoding
    time (the first unit's start to the last one's end: start-up subtracted, stated on stderr). Its vectors, read
    back by id (the rows' order), are returned in ``order``: the chunks' order of the other contenders."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    import bench_pipeline

    data = args.work / "cli.parquet"
    pq.write_table(pa.table({"id": [f"r{i:06d}" for i in range(len(texts))], "text": texts}), data, row_group_size=250)
    job = bench_pipeline.write_job(args.work, "cli", data=data, unit_rows=500, workers=1, cpus=args.threads,
                                   dtype="float32")  # the row is embedpipe fp32 through the CLI
    best = None
    for rep in range(args.repeats):
        r = bench_pipeline.cli_run(job, tree=ROOT, output=args.work / "out_cli")
        print(f"  cli pass {rep + 1}/{args.repeats}: {r}", file=sys.stderr, flush=True)
        if best is None or r["encoding_s"] < best["encoding_s"]:
            best = r
    table = ds.dataset(args.work / "out_cli" / "vectors", format="parquet").to_table().sort_by("id")
    c = Contender(f"embedpipe fp32 through `embedpipe run`, 1 worker × {args.threads} (start-up {best['startup_s']:.1f} s "
                  f"subtracted; wall {best['wall_s']:.1f} s)", run=lambda texts: None)
    c.best = {0: best["encoding_s"]}  # its CPU time is the workers': not measured here
    c.vectors = np.asarray(table["embedding"].to_pylist(), dtype=np.float32)[order]
    return c


def _st_batches(texts: list[str], bs: int) -> list[np.ndarray]:
    """sentence-transformers' own batches: sorted by character length, longest first, cut every `bs`."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    return [order[i:i + bs] for i in range(0, len(order), bs)]


def print_table(results: list[dict], *, flops: float, rates: dict, padded_fraction: float, args, rows: int,
                tokens: int) -> None:
    print(f"\n{rows:,} rows, {tokens:,} real tokens, {args.threads} threads; sentence-transformers pads "
          f"{padded_fraction:.0%} of the tokens it computes at its best batch size")
    rate = ", ".join(f"{dt} {r / 1e9:.0f}" for dt, r in rates.items())
    print(f"model: {flops / 1e6:.1f} MFLOP/token (all-MiniLM-L6-v2, token-weighted over the sample); "
          f"measured matmul GFLOP/s (the report's probe: the best of torch and oneDNN): {rate}\n")
    print("| contender | real tokens/s | × sentence-transformers | tokens per CPU-second | peak memory | cos vs ST (min / mean) | MFU (vs matmul rate) |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for r in results:
        print(f"| {r['contender']} | {r['tokens_per_s']:,.0f} | {r['ratio']:.2f}× | "
              f"{'—' if r['tokens_per_cpu_s'] is None else format(r['tokens_per_cpu_s'], ',.0f')} | "
              f"{'—' if r['peak_mib'] is None else format(r['peak_mib'], ',.0f') + ' MiB'} | {r['cos_min']:.7f} / {r['cos_mean']:.7f} | "
              f"{r['mfu']:.0%} of {r['matmul_dtype']} |")


if __name__ == "__main__":
    sys.exit(main())
