"""The CLI pipeline against its own engine: `embedpipe run` on a local Ray vs `Encoder.embed` in one process.

On a seeded sample of real paragraphs (Linux kernel docs), written as one Parquet file of small row groups:
each pass measures the in-process engine's real tokens/s (one process, workers x threads threads: the same
cores as the layout; best over the passes), then runs `embedpipe run` as a fresh process per (tree, workers x
threads) layout, each kept at its best. For each run: wall time from the command to its exit, start-up (the
command to its first unit's start), tokens/s over the run's encoding time (start-up subtracted: the first
unit's start to the last unit's end), its ratio to the engine on the same cores, and the report's scaling
efficiency. ``--tree`` adds another checkout (e.g. the code before a change) to
compare in the same minutes; the runs of every tree interleave.

    .venv/bin/python scripts/bench_pipeline.py                        # 5,000 rows, 1x2 and 2x1
    .venv/bin/python scripts/bench_pipeline.py --tree before=/tmp/old --quickstart
    .venv/bin/python scripts/bench_pipeline.py --dtype bfloat16       # the CLI and its engine in bf16 (AMX CPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_sample import MODEL, add_sample_arguments, cpu_description, engine_passes, load_texts

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_arguments(p, rows=5000)
    p.add_argument("--unit-rows", type=int, default=500, help="input.unit_rows of the sample's job")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="model.dtype of the sample's jobs and of the engine they are compared with")
    p.add_argument("--layouts", default="1x2,2x1", help="workers x cpus_per_worker, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="runs per (tree, layout); each keeps its best")
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH: another checkout to run the CLI from")
    p.add_argument("--quickstart", action="store_true", help="also run examples/quickstart.yaml (its own layout)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args()


def sample(args: argparse.Namespace, folder: Path) -> tuple[Path, list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = load_texts(args)
    path = folder / "sample.parquet"
    pq.write_table(pa.table({"id": [f"p{i:06d}" for i in range(len(texts))], "text": texts}), path,
                   row_group_size=max(args.unit_rows // 2, 1))
    return path, texts


def write_job(folder: Path, name: str, *, data: Path, unit_rows: int, workers: int, cpus: int, dtype: str) -> Path:
    import yaml

    job = {"name": name, "input": {"path": str(data), "text_column": "text", "id_column": "id", "unit_rows": unit_rows},
           "model": {"path": MODEL, "dtype": dtype}, "output": {"path": str(folder / f"out_{name}")},
           "cluster": {"workers": workers, "cpus_per_worker": cpus}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def cli_run(job: Path, *, tree: Path, output: Path) -> dict:
    """`embedpipe run JOB --overwrite` from ``tree`` in a fresh process; the figures of its report."""
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
    began = time.time()
    done = subprocess.run([sys.executable, "-c", "from embedpipe.cli import main; main()", "run", str(job),
                           "--no-progress", "--overwrite"], cwd=tree, env=env, capture_output=True, text=True)
    wall = time.time() - began
    if done.returncode != 0:
        raise SystemExit(f"{job} from {tree} failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads((output / "report.json").read_text())
    spans = [span for w in report["per_worker"] for span in w["timeline"]]  # [start, end, rows, tokens], run-relative
    # absolute times from the first part's mtime (written as its unit ends) and that unit's duration
    first_end = min(p.stat().st_mtime for p in (output / "vectors").rglob("*.parquet"))
    first_span = min(spans, key=lambda s: s[1])
    offset = first_end - first_span[1] - began  # the command's start to the run's clock (run-relative 0)
    first, last = min(s[0] for s in spans), max(s[1] for s in spans)
    tokens = report["tokens"]
    return {"wall_s": round(wall, 2), "startup_s": round(offset + first, 2), "encoding_s": round(last - first, 2),
            "tokens": tokens, "tokens_per_s": round(tokens / (last - first), 1),
            "scaling_efficiency": report.get("scaling_efficiency"), "units": len(spans),
            "workers": len(report["per_worker"])}


def main() -> int:
    args = parse_args()
    if not args.corpus.is_file():
        print(f"skipped: corpus {args.corpus} is absent")
        return 0
    trees = {"this": ROOT} | {name: Path(path) for name, path in (t.split("=", 1) for t in args.tree)}
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in args.layouts.split(",") if layout]
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        folder = Path(tmp)
        data, texts = sample(args, folder)
        # the engine on the same cores as a layout: one process with workers x cpus_per_worker threads
        engine: dict[int, float] = {}
        jobs = {f"{w}x{c}": (write_job(folder, f"s{w}x{c}", data=data, unit_rows=args.unit_rows, workers=w, cpus=c,
                                       dtype=args.dtype),
                             w * c) for w, c in layouts}
        if args.quickstart:
            jobs["quickstart"] = (QUICKSTART, None)
        best: dict[tuple[str, str], dict] = {}
        for rep in range(args.repeats):  # the engine measured again each pass, between the CLI runs
            for t in sorted({w * c for w, c in layouts}):
                engine[t] = max(engine.get(t, 0.0), engine_passes(texts, dtype=args.dtype, threads=t, repeats=1)[0])
            print(f"  pass {rep + 1}: engine (in process, {args.dtype}): "
                  + ", ".join(f"{t} threads {v:,.0f} tokens/s (best so far)" for t, v in engine.items()),
                  file=sys.stderr, flush=True)
            for layout, (job, _) in jobs.items():
                for name, tree in trees.items():  # interleaved: every tree in the same minutes
                    if layout == "quickstart":
                        out = tree / "out" / "quickstart"
                        job = tree / "examples" / "quickstart.yaml"
                    else:
                        out = folder / f"out_{job.stem}"
                    r = cli_run(job, tree=tree, output=out)
                    print(f"  pass {rep + 1}: {name} {layout}: {r}", file=sys.stderr, flush=True)
                    key = (name, layout)
                    if key not in best or r["wall_s"] < best[key]["wall_s"]:
                        best[key] = r
    print(f"\n{len(texts):,} rows of {args.corpus.name} (seed {args.seed}), unit_rows {args.unit_rows}, {args.dtype}; "
          f"best of {args.repeats}; load average at start {load:.2f}; CPU: {cpu_description()}\n")
    print("| tree | layout | wall | start-up | units | tokens/s (start-up subtracted) | × engine, same cores | scaling efficiency |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (name, layout), r in best.items():
        threads = jobs[layout][1]  # the engine's threads on the same cores
        ratio = f"{r['tokens_per_s'] / engine[threads]:.2f}" if threads in engine else "—"
        eff = "—" if r["scaling_efficiency"] is None else f"{r['scaling_efficiency']:.0%}"
        print(f"| {name} | {layout} | {r['wall_s']:.1f} s | {r['startup_s']:.1f} s | {r['units']} | "
              f"{r['tokens_per_s']:,.0f} | {ratio} | {eff} |")
    if args.json:
        args.json.write_text(json.dumps({"engine": engine, "runs": [{"tree": n, "layout": l, **r}
                                                                    for (n, l), r in best.items()]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
