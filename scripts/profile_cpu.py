"""Where a CPU encoder step spends its time: torch.profiler's per-op share, float32 and bfloat16, on real paragraphs.

Also times the same rows with each BertLayer under ``torch.compile(dynamic=True)`` (inductor's CPU backend fuses
the elementwise chains: residual adds, layer norms, GELU), its compile time reported, and the cosine of its
vectors against the eager ones.

    .venv/bin/python scripts/profile_cpu.py --rows 1000 --threads 2 [--compile]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from bench_sample import add_sample_arguments, load_texts

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sample_arguments(p, rows=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--top", type=int, default=12, help="ops listed per dtype")
    p.add_argument("--repeats", type=int, default=3, help="timed passes (best kept) for eager vs compiled")
    p.add_argument("--compile", action="store_true", help="also time torch.compile(dynamic=True) of each layer")
    return p.parse_args()


def profile(encoder, texts: list[str], *, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    encoder.embed(texts)  # the whole pass first: its heap grown, so the profile is of the steady state
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        encoder.embed(texts)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\n{encoder.dtype}, linears on {type(next(m for m in encoder.loaded.model.modules() if 'Linear' in type(m).__name__)).__name__}"
          f": {total / 1e6:.2f} s of self CPU time over {len(texts):,} rows")
    print("| op | self CPU share | self CPU ms | calls |")
    print("| --- | ---: | ---: | ---: |")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"| `{e.key}` | {e.self_cpu_time_total / total:.1%} | {e.self_cpu_time_total / 1e3:,.0f} | {e.count:,} |")


def best_seconds(run, texts, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        run(texts)
        best = min(best, time.perf_counter() - began)
    return best


def compiled_vs_eager(encoder, texts: list[str], *, repeats: int) -> None:
    import torch

    eager = encoder.embed(texts)
    eager_s = best_seconds(encoder.embed, texts, repeats)
    layers = [m for m in encoder.loaded.model.modules() if type(m).__name__.endswith("Layer")]
    originals = [layer.forward for layer in layers]
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    began = time.perf_counter()
    compiled = encoder.embed(texts)  # compiles (once per distinct guard set)
    first_s = time.perf_counter() - began
    compiled_s = best_seconds(encoder.embed, texts, repeats)
    for layer, forward in zip(layers, originals):
        layer.forward = forward
    cos = (eager * compiled).sum(1) / np.linalg.norm(eager, axis=1) / np.linalg.norm(compiled, axis=1)
    tokens = int(encoder.tokenizer(texts).lengths.sum())
    print(f"\n{encoder.dtype}: eager {tokens / eager_s:,.0f} tokens/s, torch.compile(dynamic=True) per layer "
          f"{tokens / compiled_s:,.0f} tokens/s ({eager_s / compiled_s:.2f}x); first pass with compiling "
          f"{first_s:.1f} s; min cos vs eager {cos.min():.7f}")


def main() -> int:
    args = parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from embedpipe.runtime import Encoder

    torch.set_num_threads(args.threads)
    texts = load_texts(args)
    print(f"{len(texts):,} rows of {args.corpus.name}, {args.threads} threads, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    for dtype in args.dtypes.split(","):
        encoder = Encoder.from_options(MODEL, dtype=dtype, threads=args.threads)
        profile(encoder, texts, top=args.top)
        if args.compile:
            compiled_vs_eager(encoder, texts, repeats=args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
