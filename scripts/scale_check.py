"""Nightly reindex at scale: plan, preflight, resume with nothing to do, and the incremental diff, timed.

For each size: a synthetic corpus of real text (WordNet glosses and kernel-docs paragraphs from
../shared/data, else the quickstart corpus) with random UUID ids (``--ids ordered``: sequential ones
of the same 36 characters), in ``--files`` files of ``--row-groups`` row groups each; night 1 through the real CLI
on an embedded local Ray with a tiny random BERT (MiniLM's tokenizer, width 32, 32 tokens: encoding is not
what is measured); a churn (changed, deleted, added and moved-to-another-file rows); night 2 (the
incremental night: its report's ``incremental.diff``); then a resume with nothing to do (night 2's
version reopened as unfinished and the same command run again). Plan (``plan_input``: listing, footers,
units) and preflight (``preflight``: plan, duplicate-id check, model) each run in a fresh process so their
peak memory is their own.

    .venv/bin/python scripts/scale_check.py --rows 100000 1000000 3000000
    .venv/bin/python scripts/scale_check.py --rows 1000000 --ids ordered
    .venv/bin/python scripts/scale_check.py --plan-files 10000     # planning alone, 10^4 small files
    .venv/bin/python scripts/scale_check.py --compare-lookups --rows 100000 300000   # per-unit scan vs diff

Prints one Markdown table row per size (docs/performance.md, "Nightly at scale").
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
TEXTS = [SHARED / "wordnet_glosses.parquet", SHARED / "linux_kernel_docs_paragraphs.parquet"]
QUICKSTART = ROOT / "examples" / "data" / "quickstart.parquet"
sys.path.insert(0, str(ROOT))


def real_texts() -> np.ndarray:
    files = [f for f in TEXTS if f.is_file()] or [QUICKSTART]
    return np.concatenate([pq.read_table(f, columns=["text"])["text"].to_numpy(zero_copy_only=False) for f in files])


def make_ids(n: int, *, kind: str, rng: np.random.Generator, start: int = 0) -> np.ndarray:
    if kind == "ordered":  # the same 36 characters as a UUID, in order: only the order differs
        return np.array([str(uuid.UUID(int=i)) for i in range(start, start + n)], dtype=object)
    raw = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    raw[:, 6] = (raw[:, 6] & 0x0F) | 0x40  # version 4
    raw[:, 8] = (raw[:, 8] & 0x3F) | 0x80  # variant
    hexed = [r.tobytes().hex() for r in raw]
    return np.array([f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" for h in hexed], dtype=object)


def write_corpus(folder: Path, ids: np.ndarray, texts: np.ndarray, file_of: np.ndarray, *, files: int,
                 row_groups: int) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    order = np.argsort(file_of, kind="stable")
    cuts = np.searchsorted(file_of[order], np.arange(files + 1))
    for f in range(files):
        rows = order[cuts[f]:cuts[f + 1]]
        table = pa.table({"id": pa.array(ids[rows], pa.string()), "text": pa.array(texts[rows], pa.string())})
        pq.write_table(table, folder / f"part-{f:05d}.parquet", row_group_size=max(1, -(-len(rows) // row_groups)))


def churn(ids, texts, file_of, *, changed: float, deleted: float, added: float, moved: float, files: int,
          kind: str, pool: np.ndarray, rng: np.random.Generator):
    """Night 2's rows: some texts revised, some rows gone, some moved to another file, new rows at files' ends."""
    n = len(ids)
    pick = rng.permutation(n)
    c, d, m = (int(n * x) for x in (changed, deleted, moved))
    texts = texts.copy()
    texts[pick[:c]] = texts[pick[:c]] + " (revised)"
    file_of = file_of.copy()
    file_of[pick[c + d:c + d + m]] = rng.integers(0, files, m)
    keep = np.ones(n, bool)
    keep[pick[c:c + d]] = False
    a = int(n * added)
    new_ids = make_ids(a, kind=kind, rng=rng, start=n)
    new_texts = pool[rng.integers(0, len(pool), a)]
    return (np.concatenate([ids[keep], new_ids]), np.concatenate([texts[keep], new_texts]),
            np.concatenate([file_of[keep], rng.integers(0, files, a)])), {"changed": c, "deleted": d, "moved": m,
                                                                          "added": a}


def tiny_model(folder: Path) -> Path:
    from scripts.memory_check import tiny_model as build

    return build(folder)


def job_file(path: Path, *, data: Path, out: Path, model: Path, unit_rows: int) -> Path:
    import yaml

    sections = dict(name="scale-check", input={"path": str(data), "unit_rows": unit_rows},
                    model={"path": str(model), "max_seq_len": 32, "dtype": "float32"},
                    batching={"max_tokens": 16384},
                    output={"path": str(out), "versioned": True, "incremental": True}, cluster={"workers": 2})
    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path


def cli_run(job: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / "embedpipe"), "run", str(job), "--no-progress"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"embedpipe run {job} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def phase(name: str, job: Path) -> dict:
    """Plan or preflight in a fresh process: seconds and that process's peak memory."""
    done = subprocess.run([sys.executable, __file__, "--phase", name, "--job", str(job)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} of {job} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_phase(name: str, job_path: Path) -> None:
    from embedpipe.config import load_job
    from embedpipe.io.formats import plan_input
    from embedpipe.preflight import preflight
    from embedpipe.report.memory import peak_rss_mb

    job = load_job(job_path)
    base = peak_rss_mb()
    started = time.perf_counter()
    units = plan_input(job.input).units if name == "plan" else preflight(job).units
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": round(seconds, 2), "units": len(units),
                      "peak_mb": round(peak_rss_mb(), 1),
                      "before_mb": round(base, 1)}))


def report_of(root: Path) -> dict:
    version = (root / "CURRENT").read_text().strip()
    return json.loads((root / "versions" / version / "report.json").read_text())


def check_size(rows: int, *, files: int, row_groups: int, kind: str, work: Path, model: Path, pool: np.ndarray,
               churns: dict) -> dict:
    rng = np.random.default_rng(rows)
    per_file = -(-rows // files)
    ids = make_ids(rows, kind=kind, rng=rng)
    texts = pool[rng.integers(0, len(pool), rows)]
    file_of = np.arange(rows) // per_file
    data, out = work / f"corpus-{rows}-{kind}", work / f"out-{rows}-{kind}"
    write_corpus(data, ids, texts, file_of, files=files, row_groups=row_groups)
    job = job_file(work / f"job-{rows}-{kind}.yaml", data=data, out=out, model=model, unit_rows=per_file)
    night1 = cli_run(job)
    (ids, texts, file_of), counts = churn(ids, texts, file_of, files=files, kind=kind, pool=pool, rng=rng, **churns)
    write_corpus(data, ids, texts, file_of, files=files, row_groups=row_groups)
    plan, pre = phase("plan", job), phase("preflight", job)
    night2 = cli_run(job)
    r2 = report_of(out)
    # resume with nothing to do: night 2's version reopened as unfinished, CURRENT back on night 1
    night2_id = (out / "CURRENT").read_text().strip()
    (out / "versions" / night2_id / "VALIDATED").unlink()
    night1_id = min(p.name for p in (out / "versions").iterdir())
    (out / "CURRENT").write_text(night1_id + "\n")
    resume = cli_run(job)
    r3 = report_of(out)
    assert r3["units"]["skipped_as_done"] == r3["units"]["total"], r3["units"]
    diff = r2["incremental"]["diff"]
    shutil.rmtree(out)
    shutil.rmtree(data)
    return {"rows": rows, "files": files, "units": plan["units"], "ids": kind, **counts,
            "night1_s": round(night1, 1), "plan_s": plan["seconds"], "plan_mb": plan["peak_mb"],
            "preflight_s": pre["seconds"], "preflight_mb": pre["peak_mb"], "night2_s": round(night2, 1),
            "resume_s": round(resume, 1), "diff": diff, "reuse_worker_s": r2["stages"].get("reuse"),
            "reused": r2["incremental"]["reused"], "encoded": r2["incremental"]["encoded"],
            "driver_mb": r2["peak_rss_mb"]["driver"], "workers_mb": r2["peak_rss_mb"]["workers"]}


def plan_many_files(files: int, *, work: Path) -> dict:
    """Planning alone over ``files`` small files (100 rows, 2 row groups each)."""
    from embedpipe.config import InputConfig
    from embedpipe.io.formats import plan_input

    folder = work / f"many-{files}"
    folder.mkdir(parents=True)
    for f in range(files):
        pq.write_table(pa.table({"id": [f"{f}-{i}" for i in range(100)], "text": ["some text"] * 100}),
                       folder / f"part-{f:05d}.parquet", row_group_size=50)
    started = time.perf_counter()
    units = plan_input(InputConfig(path=str(folder), unit_rows=100)).units
    return {"files": files, "units": len(units), "plan_s": round(time.perf_counter() - started, 2)}


def compare_lookups(rows: int, *, files: int, kind: str, work: Path, pool: np.ndarray, churns: dict,
                    scan: bool) -> dict:
    """In this process, no Ray, no model: a previous version's parts written directly (one per unit, width 32),
    tonight's churned corpus, and every unit's lookup done two ways: the per-unit scan of every part
    (``PreviousVectors.lookup``, before the diff) and the diff (``diff_locally``) then ``lookup_unit``."""
    from embedpipe.io.diff import diff_locally, unit_key
    from embedpipe.io.formats import UnitReader
    from embedpipe.io.reuse import PreviousVectors, content_hashes
    from embedpipe.units import plan_units

    rng, salt = np.random.default_rng(rows), b"s" * 32
    ids = make_ids(rows, kind=kind, rng=rng)
    texts = pool[rng.integers(0, len(pool), rows)]
    file_of = np.arange(rows) // -(-rows // files)
    data, vectors = work / f"cmp-{rows}-{kind}", work / f"cmp-{rows}-{kind}-vectors"
    write_corpus(data, ids, texts, file_of, files=files, row_groups=1)
    vectors.mkdir()
    units = plan_units(sorted(str(p) for p in data.glob("*.parquet")), unit_rows=rows)
    reader = UnitReader(text_column="text", id_column="id")
    parts, previous = [], {}
    for unit in units:
        table = reader.columns(unit, ["id", "text"])
        flat = pa.array(rng.standard_normal(table.num_rows * 32).astype(np.float32))
        parts.append(str(vectors / f"part-{unit.id}.parquet"))
        pq.write_table(pa.table({"id": table["id"], "embedding": pa.FixedSizeListArray.from_arrays(flat, 32),
                                 "content_hash": content_hashes(table["text"].to_pylist(), salt=salt)}), parts[-1])
        previous[unit_key(unit.file, unit.id)] = len(parts) - 1
    (ids, texts, file_of), _ = churn(ids, texts, file_of, files=files, kind=kind, pool=pool, rng=rng, **churns)
    write_corpus(data, ids, texts, file_of, files=files, row_groups=1)
    units = plan_units(sorted(str(p) for p in data.glob("*.parquet")), unit_rows=rows)
    batches = [reader(u) for u in units]
    hashes = [content_hashes(b.texts, salt=salt) for b in batches]
    lookup = PreviousVectors(vectors, parts=tuple(parts))
    out = {"rows": rows, "files": files, "ids": kind}
    started = time.perf_counter()
    diff = diff_locally(units, parts=tuple(parts), previous=previous, id_column="id", reader=reader, threads=2)
    out["diff_s"] = round(time.perf_counter() - started, 2)
    reused = 0
    for unit, batch, h in zip(units, batches, hashes):
        reuse, _, _ = lookup.lookup_unit(batch.ids, h, same_part=diff.same_part.get(unit.id),
                                         moved=diff.moved.get(unit.id))
        reused += int(reuse.sum())
    out["diff_and_lookups_s"] = round(time.perf_counter() - started, 2)
    out["reused"] = reused
    if scan:
        started = time.perf_counter()
        assert sum(int(lookup.lookup(b.ids, h)[0].sum()) for b, h in zip(batches, hashes)) == reused
        out["per_unit_scan_s"] = round(time.perf_counter() - started, 2)
    shutil.rmtree(data)
    shutil.rmtree(vectors)
    return out


def check_planning(rows: int, *, files: int, row_groups: int, kind: str, work: Path, model: Path,
                   pool: np.ndarray) -> dict:
    """Plan and preflight alone (no run): the corpus, then each phase in a fresh process."""
    rng = np.random.default_rng(rows)
    data = work / f"plan-{rows}-{kind}"
    write_corpus(data, make_ids(rows, kind=kind, rng=rng), pool[rng.integers(0, len(pool), rows)],
                 np.arange(rows) // -(-rows // files), files=files, row_groups=row_groups)
    job = job_file(work / f"plan-{rows}.yaml", data=data, out=work / f"plan-out-{rows}", model=model,
                   unit_rows=-(-rows // files))
    plan, pre = phase("plan", job), phase("preflight", job)
    shutil.rmtree(data)
    return {"rows": rows, "files": files, "ids": kind, "units": plan["units"], "plan_s": plan["seconds"],
            "plan_mb": plan["peak_mb"], "preflight_s": pre["seconds"], "preflight_mb": pre["peak_mb"]}


def table_row(r: dict) -> str:
    d = r["diff"]
    per_row_us = 1e6 * d["seconds"] / max(d["looked_up"], 1)
    workers = "/".join(f"{m:.0f}" for m in r["workers_mb"] if m is not None)
    return (f"| {r['rows']:,} | {r['files']:,} | {r['ids']} | {r['plan_s']} | {r['preflight_s']} | "
            f"{r['resume_s']} | {d['seconds']} | {per_row_us:.2f} | {d['same_unit']:,} / {d['joined']:,} / "
            f"{d['new']:,} | {r['reuse_worker_s']} | {r['night2_s']} | {r['driver_mb']:.0f} | "
            f"{d['task_peak_rss_mb']:.0f} | {workers} |")


HEADER = ("| rows | files | ids | plan s | preflight s | resume (nothing to do) s | diff s | diff µs/row | "
          "same unit / join / new | reuse worker-s | night 2 s | driver peak MiB | diff task peak MiB | "
          "worker peak MiB |\n" + "| ---: " * 3 + "| ---: " * 11 + "|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[1_000_000])
    parser.add_argument("--files", type=int, default=0, help="input files (default: one per 3,000 rows)")
    parser.add_argument("--row-groups", type=int, default=3, help="row groups per file")
    parser.add_argument("--ids", choices=["random", "ordered"], default="random")
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--deleted", type=float, default=0.005)
    parser.add_argument("--added", type=float, default=0.005)
    parser.add_argument("--moved", type=float, default=0.001, help="rows moved to another file")
    parser.add_argument("--plan-files", type=int, default=0, help="also time planning this many small files")
    parser.add_argument("--compare-lookups", action="store_true",
                        help="instead: each size's lookups in process, per-unit scan vs diff (no Ray, no model)")
    parser.add_argument("--planning-only", action="store_true", help="instead: plan and preflight alone")
    parser.add_argument("--no-scan", action="store_true", help="with --compare-lookups: skip the per-unit scan")
    parser.add_argument("--json", type=Path, help="append each size's figures to this JSON-lines file")
    parser.add_argument("--phase", choices=["plan", "preflight"], help=argparse.SUPPRESS)
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        run_phase(args.phase, args.job)
        return
    churns = {"changed": args.changed, "deleted": args.deleted, "added": args.added, "moved": args.moved}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.plan_files:
            print(plan_many_files(args.plan_files, work=work), flush=True)
        if not args.rows:
            return
        if args.compare_lookups:
            pool = real_texts()
            for rows in args.rows:
                print(compare_lookups(rows, files=args.files or max(10, rows // 3000), kind=args.ids, work=work,
                                      pool=pool, churns=churns, scan=not args.no_scan), flush=True)
            return
        model, pool = tiny_model(work / "model"), real_texts()
        if args.planning_only:
            for rows in args.rows:
                files = args.files or max(10, rows // 3000)
                print(check_planning(rows, files=files, row_groups=args.row_groups, kind=args.ids, work=work,
                                     model=model, pool=pool), flush=True)
            return
        print(HEADER, flush=True)
        for rows in args.rows:
            files = args.files or max(10, rows // 3000)
            r = check_size(rows, files=files, row_groups=args.row_groups, kind=args.ids, work=work,
                           model=model, pool=pool, churns=churns)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(r) + "\n")
            print(table_row(r), flush=True)


if __name__ == "__main__":
    main()
