"""The in-process engine of several source trees on the same rows: what one change to the encoder buys.

Each (tree, dtype) runs in a fresh process (``PYTHONPATH`` set to the tree: its ``embedpipe`` package is the
one imported), rounds alternate the trees so the machine's drift falls on all of them, and each process keeps
its best of ``--repeats`` passes over the sample after a warm-up. Prints real tokens/s per tree and round,
each tree's ratio to the first, and whether the vectors are bit-identical to the first tree's (else the
minimum cosine). A tree is any folder holding an ``embedpipe`` package: a worktree, or ``git archive REV
embedpipe | tar -x -C DIR``.

    .venv/bin/python scripts/bench_trees.py --tree before=/tmp/before --tree after=. --dtypes bfloat16,float32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_sample import add_sample_arguments, cpu_description, engine_passes, load_texts


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_arguments(p, rows=2000)
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH, two or more; the first is the base")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="alternations of every tree")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per process; the best is kept")
    p.add_argument("--child", nargs=3, metavar=("DTYPE", "TEXTS_JSON", "VECTORS_NPY"), help=argparse.SUPPRESS)
    return p.parse_args()


def child(args: argparse.Namespace) -> None:
    """One process: this tree's engine on the texts; prints tokens/s and saves the vectors."""
    import numpy as np

    import embedpipe

    tree = Path(os.environ["PYTHONPATH"])
    if tree not in Path(embedpipe.__file__).resolve().parents:  # the tree's package, not the installed one
        raise SystemExit(f"embedpipe was imported from {embedpipe.__file__}, not from the tree {tree}")
    dtype, texts_path, vectors_path = args.child
    rate, _, vectors = engine_passes(json.loads(Path(texts_path).read_text()), dtype=dtype, threads=args.threads,
                                     repeats=args.repeats)
    np.save(vectors_path, vectors)
    print(json.dumps({"tokens_per_s": rate}))


def main() -> int:
    args = parse_args()
    if args.child:
        child(args)
        return 0
    import numpy as np

    trees = [tuple(t.split("=", 1)) for t in args.tree]
    if len(trees) < 2:
        raise SystemExit("give two or more --tree NAME=PATH: the first is the base the others are compared with")
    print(cpu_description())
    with tempfile.TemporaryDirectory() as tmp:
        texts_path = Path(tmp) / "texts.json"
        texts_path.write_text(json.dumps(load_texts(args)))
        for dtype in args.dtypes.split(","):
            rates: dict[str, list[float]] = {name: [] for name, _ in trees}
            for _ in range(args.rounds):
                for name, path in trees:
                    env = {**os.environ, "PYTHONPATH": str(Path(path).resolve()), "TOKENIZERS_PARALLELISM": "false"}
                    out = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--repeats",
                                          str(args.repeats), "--child", dtype, str(texts_path),
                                          f"{tmp}/{name}_{dtype}.npy"], env=env, capture_output=True, text=True,
                                         check=True).stdout
                    rates[name].append(json.loads(out.strip().splitlines()[-1])["tokens_per_s"])
            base = np.load(f"{tmp}/{trees[0][0]}_{dtype}.npy")
            print(f"\n{dtype}, {args.rows:,} rows, {args.threads} threads, best of {args.repeats} per process")
            print("| tree | real tokens/s per round | × first (median) | vectors vs first |")
            print("| --- | --- | ---: | --- |")
            for name, _ in trees:
                v = np.load(f"{tmp}/{name}_{dtype}.npy")
                cos = (base * v).sum(1) / np.linalg.norm(base, axis=1) / np.linalg.norm(v, axis=1)
                same = "bit-identical" if np.array_equal(base, v) else f"min cos {cos.min():.7f}"
                ratio = np.median(rates[name]) / np.median(rates[trees[0][0]])
                print(f"| {name} | {', '.join(f'{r:,.0f}' for r in rates[name])} | {ratio:.3f}× | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
