"""Object-store outputs: the same job on local paths and on S3 (moto's S3 API server on loopback), one Ray.

Prints, per run: wall seconds, tokens/s, the workers' seconds per stage (read includes the input's
GETs, write the part's PUT; the record's PUT is in the unit's time, in no stage) and the wall split
into startup (preflight, manifest, the workers' model load), the units, and after the last unit
(manifest listing, orphan cleanup, skipped rows, reports and runs/ written). The two runs alternate
``--repeats`` times (a fresh output each) and each keeps its fastest, since the machine may be
shared. Loopback S3 has no network latency or bandwidth limit: it measures embedpipe's own overhead
per request, not a real bucket's.

    .venv/bin/python scripts/s3_check.py                      # 600 rows, 2 workers, 2 repeats: ~5 minutes on 2 cores
    .venv/bin/python scripts/s3_check.py --rows 3000 --workers 2 --unit-rows 250
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUICKSTART = ROOT / "examples" / "data" / "quickstart.parquet"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
KEY, SECRET = "s3-check-key", "s3-check-secret"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=600)
    p.add_argument("--unit-rows", type=int, default=100)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(job_dict: dict) -> tuple[dict, float]:
    from embedpipe.cluster.driver import run_job
    from embedpipe.config import parse_job

    started = time.perf_counter()
    result = run_job(parse_job(job_dict), progress=False)
    return result.report, time.perf_counter() - started


def main() -> None:
    args = parse_args()
    import ray
    import s3fs
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    options = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}
    s3 = s3fs.S3FileSystem(**options)
    s3.mkdir("s3-check")
    ray.init(address="local", num_cpus=max(args.workers, 2), include_dashboard=False, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            corpus = Path(tmp) / "corpus.parquet"
            pq.write_table(pq.read_table(QUICKSTART).slice(0, args.rows), corpus, row_group_size=args.unit_rows)
            s3.put(str(corpus), "s3-check/in/corpus.parquet")
            base = {"model": {"path": MODEL}, "batching": {"max_tokens": args.max_tokens},
                    "cluster": {"workers": args.workers, "cpus_per_worker": 1}}
            results: dict[str, tuple[dict, float]] = {}
            for repeat in range(args.repeats):
                jobs = {
                    "local": {**base, "input": {"path": str(corpus), "unit_rows": args.unit_rows},
                              "output": {"path": str(Path(tmp) / f"out-{repeat}")}},
                    "s3": {**base, "input": {"path": "s3://s3-check/in/corpus.parquet", "unit_rows": args.unit_rows,
                                             "storage_options": options},
                           "output": {"path": f"s3://s3-check/out-{repeat}", "storage_options": options}},
                }
                for name, job in jobs.items():
                    report, wall = run(job)
                    print(json.dumps({"repeat": repeat, "run": name, "wall_s": round(wall, 2)}), file=sys.stderr)
                    if name not in results or wall < results[name][1]:
                        results[name] = (report, wall)
    finally:
        ray.shutdown()
        server.stop()
    rows = []
    for name, (report, wall) in results.items():
        stages = report["stages"]
        spans = [t for w in report.get("per_worker") or [] for t in w["timeline"]]  # [start, end, rows, tokens]
        first, last = min(t[0] for t in spans), max(t[1] for t in spans)
        rows.append({"run": name, "wall_s": round(wall, 2), "tokens_per_s": report["tokens_per_second"],
                     "startup_s": round(first, 2), "units_s": round(last - first, 2), "after_units_s": round(wall - last, 2),
                     "read_s": stages.get("read"), "write_s": stages.get("write"), "encode_s": stages.get("encode")})
    ratio = results["s3"][0]["tokens_per_second"] / max(results["local"][0]["tokens_per_second"], 1e-9)
    for row in rows:
        print(json.dumps(row))
    print(json.dumps({"rows": args.rows, "units": -(-args.rows // args.unit_rows), "workers": args.workers,
                      "s3_over_local_tokens_per_s": round(ratio, 3)}))


if __name__ == "__main__":
    main()
