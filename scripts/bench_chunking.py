"""Chunking's cost and what it saves: tokens/s with input.chunking on vs off, and truncation's loss.

1. Truncation: every row of the kernel-docs corpus tokenized whole with the model's tokenizer: the share of
   its tokens that truncation at model.max_seq_len (256 for all-MiniLM-L6-v2, specials counted) drops,
   and the rows it cuts. Chunking (split, max_tokens = max_seq_len) keeps every token.
2. Throughput: one process, one encoder per mode (the packaged all-MiniLM-L6-v2, fp32), the same seeded
   sample of the corpus; the sample is cut into slices and the two modes run interleaved on each slice,
   several passes, each (mode, slice) keeping its best time (the machine may be shared). Tokens/s counts
   the real tokens each mode encodes (off: the truncated rows; split: every chunk's, overlap included).

    .venv/bin/python scripts/bench_chunking.py                      # ~5 minutes on 2 busy cores
    .venv/bin/python scripts/bench_chunking.py --rows 500 --repeats 2 --slices 4 --no-truncation   # a quick look
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "linux_kernel_docs_paragraphs.parquet"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=CORPUS, help="Parquet file with a `text` column")
    p.add_argument("--rows", type=int, default=1500, help="rows sampled (seeded) for the throughput comparison")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slices", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--overlap", type=int, default=0, help="input.chunking.overlap of the chunked run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-truncation", action="store_true", help="skip part 1 (a pass over the whole corpus)")
    return p.parse_args()


def truncation(texts: list[str], encoder) -> dict:
    """Tokens of each row whole (specials counted) against what truncation at max_seq_len keeps."""
    docs = encoder.tokenizer.documents(texts)
    whole = np.fromiter((len(d.ids) + encoder.tokenizer.framing for d in docs), np.int64, count=len(docs))
    kept = np.minimum(whole, encoder.max_seq_len)
    return {"rows": len(texts), "tokens": int(whole.sum()), "max_seq_len": encoder.max_seq_len,
            "truncated_rows": int((whole > kept).sum()), "dropped_tokens": int((whole - kept).sum()),
            "dropped_share": round(float((whole - kept).sum() / whole.sum()), 5),
            "longest_row_tokens": int(whole.max())}


def main() -> None:
    args = parse_args()
    import pyarrow.parquet as pq
    import torch

    from embedpipe.config import BatchingConfig, ChunkingConfig, ModelConfig, RuntimeConfig
    from embedpipe.report.counters import Counters
    from embedpipe.runtime import Encoder

    torch.set_num_threads(args.threads)
    texts = pq.read_table(args.corpus, columns=["text"]).column("text").to_pylist()
    make = lambda chunking: Encoder(model=ModelConfig(path=MODEL), batching=BatchingConfig(),  # noqa: E731
                                    runtime=RuntimeConfig(warmup_check=False), chunking=chunking,
                                    threads=args.threads)
    off, split = make(None), make(ChunkingConfig(mode="split", overlap=args.overlap))
    if not args.no_truncation:
        started = time.perf_counter()
        lost = truncation(texts, off)
        lost["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps({"truncation": lost}), flush=True)

    rng = np.random.default_rng(args.seed)
    sample = [texts[i] for i in sorted(rng.choice(len(texts), size=args.rows, replace=False))]
    slices = np.array_split(np.arange(len(sample)), args.slices)
    modes = {"off": lambda t, c: off.embed(t, c), "split": lambda t, c: split.embed_chunks(t, c)}
    best = {m: [float("inf")] * len(slices) for m in modes}
    tokens = {m: [0] * len(slices) for m in modes}
    for m, run in modes.items():  # warm-up
        run(sample[:32], Counters())
    for _ in range(args.repeats):
        for k, rows in enumerate(slices):
            for m, run in modes.items():
                counters = Counters()
                t0 = time.perf_counter()
                run([sample[i] for i in rows], counters)
                best[m][k] = min(best[m][k], time.perf_counter() - t0)
                tokens[m][k] = counters.tokens
    result = {}
    for m in modes:
        seconds, total = sum(best[m]), sum(tokens[m])
        result[m] = {"tokens": total, "seconds": round(seconds, 2), "tokens_per_second": round(total / seconds, 1)}
    result["split_over_off"] = round(result["split"]["tokens_per_second"] / result["off"]["tokens_per_second"], 4)
    _, plan = split.chunker(sample)
    result["rows"], result["chunks"] = len(sample), len(plan)
    print(json.dumps({"throughput": result}), flush=True)


if __name__ == "__main__":
    main()
