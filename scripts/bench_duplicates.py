"""The duplicate-id check on the driver (preflight), before and after text ids were hashed in numpy: the same
ids, the same units, side by side in one run.

    .venv/bin/python scripts/bench_duplicates.py --rows 2000000 [--dup-share 0.01] [--repeats 3] \
        [--tree before=/tmp/tree_before]   # git worktree add /tmp/tree_before <commit>

The ids are the real corpora's (``../shared/data``: ``kerneldocs:N``, ``wordnet:N``), copied under a night
prefix (``night-C/``) up to ``--rows``, with ``--dup-share`` of the rows replaced by an earlier row's id, written
as Parquet files of 100,000 rows. Each contender runs preflight's whole check (``_resolve_duplicates``: read the
id column of every unit, key it, spill, sort, and for text ids confirm the repeats by value) under
``on_duplicate_id: keep_first``, interleaved, best of ``--repeats``:

  - blake2b: each text id keyed by one blake2b call on its repr (``_repr_keys``, the keys the check used before);
  - numpy: the ids' bytes hashed from the Arrow buffers (``_text_keys``, as shipped);
  - each ``--tree NAME=DIR``: the whole check of another checkout (its own embedpipe, in a subprocess), on the
    same files: the check as it was, sort and all.

It prints the seconds of each, the keying alone per id, the ratio, and what 10^8 ids would take at that rate.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import embedpipe.io.duplicates as duplicates  # noqa: E402
from bench_sample import cpu_description  # noqa: E402
from embedpipe.config import InputConfig  # noqa: E402
from embedpipe.io.formats import UnitReader, plan_input  # noqa: E402
from embedpipe.preflight import _resolve_duplicates  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CORPORA = ("linux_kernel_docs_paragraphs.parquet", "wordnet_glosses.parquet")
FILE_ROWS = 100_000
CONTENDERS = {"blake2b": duplicates._repr_keys, "numpy": duplicates._text_keys}
TREE_CHECK = """
import sys, time
sys.path.insert(0, sys.argv[1])
from embedpipe.config import InputConfig
from embedpipe.io.formats import UnitReader, plan_input
from embedpipe.preflight import _resolve_duplicates
units = plan_input(InputConfig(path=sys.argv[2], unit_rows=int(sys.argv[3]))).units
started = time.perf_counter()
_, dropped = _resolve_duplicates(units, reader=UnitReader(text_column="text", id_column="id"), id_column="id",
                                 policy="keep_first")
print(time.perf_counter() - started, dropped)
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dup-share", type=float, default=0.01, help="rows given an earlier row's id")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="another checkout whose whole check runs on the same files (repeatable)")
    return p.parse_args()


def make_ids(*, rows: int, dup_share: float, seed: int) -> pa.Array:
    real = pa.concat_arrays([pq.read_table(DATA / name, columns=["id"]).column(0).combine_chunks()
                             for name in CORPORA]).to_pylist()
    ids = [f"night-{c}/{i}" for c in range(-(-rows // len(real))) for i in real][:rows]
    rng = np.random.default_rng(seed)
    later = np.sort(rng.choice(np.arange(1, rows), int(rows * dup_share), replace=False))
    for row in later.tolist():
        ids[row] = ids[int(rng.integers(0, row))]
    return pa.array(ids)


def write_files(ids: pa.Array, folder: Path) -> None:
    for n, start in enumerate(range(0, len(ids), FILE_ROWS)):
        part = ids.slice(start, FILE_ROWS)
        pq.write_table(pa.table({"id": part, "text": pa.array([""] * len(part))}), folder / f"part-{n:05d}.parquet")


def tree_check(tree: str, folder: str) -> tuple[float, int]:
    """The whole check of the checkout ``tree`` on the files in ``folder``: its seconds and rows dropped."""
    out = subprocess.run([sys.executable, "-c", TREE_CHECK, tree, folder, str(FILE_ROWS)], check=True,
                         capture_output=True, text=True).stdout.split()
    return float(out[0]), int(out[1])


def check(units, *, keys) -> tuple[float, int]:
    duplicates._text_keys = keys  # id_keys' text path, for this pass
    started = time.perf_counter()
    _, dropped = _resolve_duplicates(units, reader=UnitReader(text_column="text", id_column="id"), id_column="id",
                                     policy="keep_first")
    return time.perf_counter() - started, dropped


def main() -> None:
    args = parse_args()
    shipped = duplicates._text_keys
    ids = make_ids(rows=args.rows, dup_share=args.dup_share, seed=args.seed)
    want = len(ids) - len(set(ids.to_pylist()))
    with tempfile.TemporaryDirectory(prefix="bench-dup-") as tmp:
        write_files(ids, Path(tmp))
        units = plan_input(InputConfig(path=tmp, unit_rows=FILE_ROWS)).units
        trees = dict(t.split("=", 1) for t in args.tree)
        best = {name: float("inf") for name in [*trees, *CONTENDERS]}
        for _ in range(args.repeats):
            for name in best:
                seconds, dropped = tree_check(trees[name], tmp) if name in trees else \
                    check(units, keys=CONTENDERS[name])
                assert dropped == want, f"{name} dropped {dropped} rows, the input repeats {want}"
                best[name] = min(best[name], seconds)
        duplicates._text_keys = shipped
    keying = {}
    for name, keys in CONTENDERS.items():
        keying[name] = min(_timed(keys, ids) for _ in range(args.repeats))
    print(f"{len(ids):,} string ids ({want:,} repeats, {len(units)} units); best of {args.repeats}; "
          f"CPU: {cpu_description()}\n")
    print("| contender | whole check | keying alone | µs per id (keying) | 10^8 ids (whole check) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in best:
        alone = f"{keying[name]:.2f} s | {keying[name] / len(ids) * 1e6:.2f}" if name in keying else "— | —"
        print(f"| {name} | {best[name]:.2f} s | {alone} | {best[name] / len(ids) * 1e8 / 60:.1f} min |")
    ratios = [f"{best[name] / best['numpy']:.1f}x {name}" for name in best if name != "numpy"]
    print(f"\nwhole check, numpy: {', '.join(ratios)}; keying alone {keying['blake2b'] / keying['numpy']:.1f}x "
          f"blake2b")


def _timed(keys, ids: pa.Array) -> float:
    started = time.perf_counter()
    keys(ids)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
