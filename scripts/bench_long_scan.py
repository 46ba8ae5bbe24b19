"""Start-up of a run whose duplicate-id scan is long: what starting Ray, the model's shipping and the workers beside
the scan gains, one tree against another in the same minutes.

The corpus: ``--rows`` rows of random UUID ids over ``--files`` Parquet files (the scan's cost is its ids': about
1 µs an id), each text one word (the encoding is short), ``--units-per-file`` units a file. The model:
scale_check's tiny random BERT (MiniLM's real tokenizer), so a worker's start is its process, ``import torch`` and
a small load. Each round runs ``embedpipe run JOB --overwrite --no-progress`` from every tree, then from every
tree again in reverse order (a b b a), each from its own folder with ``PYTHONPATH`` set to it. Prints every run's
start-up (the report's ``startup_seconds``: the command's run_job to its first unit) and wall, each tree's
medians, and each tree's median start-up against the first tree's.

    .venv/bin/python scripts/bench_long_scan.py --tree before=/tmp/tree_before              # this tree vs before
    .venv/bin/python scripts/bench_long_scan.py --rows 6000000 --files 24 --tree before=/tmp/tree_before
    .venv/bin/python scripts/bench_long_scan.py --dtype int8 --tree before=/tmp/tree_before   # with its calibration
    .venv/bin/python scripts/bench_long_scan.py --incremental --tree before=/tmp/tree_before  # nights: with the diff
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_sample import cpu_description  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000, help="rows in all (default 2,000,000)")
    p.add_argument("--files", type=int, default=8, help="Parquet files (default 8)")
    p.add_argument("--units-per-file", type=int, default=4, help="units (and row groups) a file (default 4)")
    p.add_argument("--workers", type=int, default=2, help="cluster.workers (default 2)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of a b b a (default 4)")
    p.add_argument("--dtype", default="float32", help="output.dtype (default float32; int8 adds its calibration)")
    p.add_argument("--incremental", action="store_true",
                   help="a versioned incremental output per tree: one untimed first night, then every run a night "
                        "on the same corpus (its diff before the first unit; every row reused)")
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH: another checkout to run the CLI from")
    p.add_argument("--work", type=Path, default=None, help="where the corpus, model and outputs go (default: a "
                                                               "temporary folder)")
    return p.parse_args()


def uuids(n: int, rng: np.random.Generator) -> np.ndarray:
    raw = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    hexed = [r.tobytes().hex() for r in raw]
    return np.array([f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" for h in hexed], dtype=object)


def write_corpus(folder: Path, *, rows: int, files: int, units_per_file: int) -> int:
    """One-word texts with random UUID ids; returns the rows of a unit."""
    folder.mkdir(parents=True, exist_ok=True)
    rng, per = np.random.default_rng(0), rows // files
    words = np.array(["kernel", "memory", "driver", "page", "device", "queue", "thread", "lock"], dtype=object)
    for f in range(files):
        ids = uuids(per, rng)
        table = pa.table({"id": pa.array(ids, pa.string()), "text": pa.array(words[np.arange(per) % len(words)],
                                                                            pa.string())})
        pq.write_table(table, folder / f"part-{f:05d}.parquet", row_group_size=-(-per // units_per_file))
    return -(-per // units_per_file)


def write_job(path: Path, *, data: Path, model: Path, out: Path, unit_rows: int, workers: int, dtype: str,
              incremental: bool) -> Path:
    import yaml

    output = {"path": str(out), "dtype": dtype} | ({"versioned": True, "incremental": True} if incremental else {})
    job = {"name": "long-scan", "input": {"path": str(data / "*.parquet"), "unit_rows": unit_rows},
           "model": {"path": str(model), "max_seq_len": 32, "dtype": "float32"}, "batching": {"max_tokens": 16384},
           "output": output, "cluster": {"workers": workers}}
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def cli_run(job: Path, *, tree: Path, out: Path, incremental: bool) -> dict:
    """One run of ``job`` from ``tree``: a new output (``--overwrite``), or the next night of an incremental one."""
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
    flags = ["--no-progress"] + ([] if incremental else ["--overwrite"])
    done = subprocess.run([sys.executable, "-c", "from embedpipe.cli import main; main()", "run", str(job), *flags],
                          cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{job} from {tree} failed ({done.returncode}): {done.stderr[-2000:]}")
    folder = out / "versions" / (out / "CURRENT").read_text().strip() if incremental else out
    report = json.loads((folder / "report.json").read_text())
    diff = (report.get("incremental") or {}).get("diff") or {}
    return {"startup_s": report["startup_seconds"], "wall_s": report["wall_seconds"], "diff_s": diff.get("seconds")}


def main() -> int:
    args = parse_args()
    trees = {"this": ROOT} | {name: Path(path) for name, path in (t.split("=", 1) for t in args.tree)}
    with tempfile.TemporaryDirectory(prefix="bench_long_scan_") as scratch:
        work = args.work or Path(scratch)
        data, model = work / "data", work / "model"
        unit_rows = write_corpus(data, rows=args.rows, files=args.files, units_per_file=args.units_per_file)
        if not (model / "model.safetensors").exists():
            from scripts.memory_check import tiny_model

            tiny_model(model)
        outs = {name: work / f"out_{name}" for name in trees}  # each tree's own: an incremental output's nights
        jobs = {name: write_job(work / f"job_{name}.yaml", data=data, model=model, out=outs[name], unit_rows=unit_rows,
                                workers=args.workers, dtype=args.dtype, incremental=args.incremental)
                for name in trees}
        print(f"CPU: {cpu_description()}; {os.cpu_count()} CPUs")
        print(f"{args.rows:,} rows, {args.files} files, {args.files * args.units_per_file} units, "
              f"{args.workers} workers, output.dtype {args.dtype}, {args.rounds} rounds"
              + (", incremental nights on an unchanged corpus" if args.incremental else ""))
        if args.incremental:  # each tree's first night: the previous version the timed nights diff against
            for name in trees:
                shutil.rmtree(outs[name], ignore_errors=True)
                cli_run(jobs[name], tree=trees[name], out=outs[name], incremental=True)
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for round_ in range(args.rounds):
            for name in [*trees, *reversed(trees)]:
                r = cli_run(jobs[name], tree=trees[name], out=outs[name], incremental=args.incremental)
                runs[name].append(r)
                diff = f", diff {r['diff_s']:.2f} s" if r["diff_s"] is not None else ""
                print(f"round {round_ + 1} {name}: start-up {r['startup_s']:.2f} s, wall {r['wall_s']:.2f} s{diff}",
                      flush=True)
    first = statistics.median(r["startup_s"] for r in runs[next(iter(trees))])
    print("\n| tree | start-up, median (range) | wall, median | start-up × first tree's |")
    print("| --- | ---: | ---: | ---: |")
    for name, rs in runs.items():
        starts = [r["startup_s"] for r in rs]
        median = statistics.median(starts)
        print(f"| {name} | {median:.2f} s ({min(starts):.2f}-{max(starts):.2f}) | "
              f"{statistics.median(r['wall_s'] for r in rs):.2f} s | {median / first:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
