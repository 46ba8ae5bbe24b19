"""What the CPU benchmarks share (bench_cpu.py, bench_pipeline.py, bench_trees.py, profile_cpu.py): the seeded
sample of the corpus every contender gets (its options and its reading), the line that names the machine, and
the in-process engine's timed passes."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "linux_kernel_docs_paragraphs.parquet"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def add_sample_arguments(parser: argparse.ArgumentParser, *, rows: int) -> None:
    """--corpus, --rows (default ``rows``) and --seed: what ``load_texts`` reads."""
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="Parquet file with a `text` column")
    parser.add_argument("--rows", type=int, default=rows, help="rows sampled from the corpus (seeded)")
    parser.add_argument("--seed", type=int, default=0)


def load_texts(args) -> list[str]:
    """``args.rows`` texts of the Parquet file ``args.corpus`` (its ``text`` column), drawn with ``args.seed``,
    in file order."""
    import pyarrow.parquet as pq

    table = pq.read_table(args.corpus, columns=["text"])
    rows = np.random.default_rng(args.seed).choice(table.num_rows, min(args.rows, table.num_rows), replace=False)
    return table["text"].take(np.sort(rows)).to_pylist()


def cpu_description() -> str:
    """The CPU's model name and its matmul-relevant flags (/proc/cpuinfo, Linux)."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
    have = [f for f in wanted if f in flags]
    return f"{model}, {os.cpu_count()} logical CPUs; flags: {' '.join(have) or 'none of ' + ' '.join(wanted)}"


def engine_passes(texts: list[str], *, dtype: str, threads: int, repeats: int) -> tuple[float, int, np.ndarray]:
    """The in-process engine (the job defaults but ``dtype``) on ``texts``: best real tokens/s over ``repeats``
    passes after a warm-up pass, the real tokens, and the last pass's vectors."""
    import time

    from embedpipe.report.counters import Counters
    from embedpipe.runtime import Encoder

    encoder = Encoder.from_options(MODEL, dtype=dtype, threads=threads)
    encoder.embed(texts[:256])
    best, tokens, vectors = float("inf"), 0, None
    for _ in range(repeats):
        counters = Counters()
        began = time.perf_counter()
        vectors = encoder.embed(texts, counters)
        best, tokens = min(best, time.perf_counter() - began), counters.tokens
    return tokens / best, tokens, vectors
