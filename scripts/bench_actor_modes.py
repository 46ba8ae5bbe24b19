"""The engine inside a Ray actor, by how the actor runs its calls: why EmbedWorker is not a threaded actor.

Each mode is a fresh actor of 2 CPUs on an embedded Ray that builds the float32 Encoder (2 threads) and
encodes the same real paragraphs in units of 500, one call per unit, the calls made one after another:

- ``plain``: max_concurrency 1 (calls run on the actor's main thread);
- ``plain+thread``: the same, each call naming the next unit, read and tokenized on a thread of the worker's
  own while the call encodes (what EmbedWorker does);
- ``threaded``: max_concurrency 2 (calls run on Ray's pool threads);
- ``groups``: a concurrency group for the reads, the next unit read by a call in that group beside the encode.

Printed per mode and round: tokens/s over the calls' wall, and the actor's CPU-seconds per second (how many of
its 2 cores it kept busy). The rounds interleave the modes.

    .venv/bin/python scripts/bench_actor_modes.py --rows 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

from bench_sample import add_sample_arguments, cpu_description, load_texts

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
MODES = ("plain", "plain+thread", "threaded", "groups")


class Worker:
    def __init__(self):
        from embedpipe.cluster.worker import ReadAhead
        from embedpipe.runtime import Encoder

        self.encoder = Encoder.from_options(MODEL, dtype="float32", threads=2)
        self.encoder.embed(["warm up"] * 64)
        self.ahead = ReadAhead()  # the embedding worker's own read-ahead

    def prepare(self, texts: list[str]):
        return self.encoder.prepare(texts)

    def unit(self, index: int, texts: list[str], prepared=None, following: list[str] | None = None) -> tuple[int, float]:
        """Encode unit ``index`` (``texts``; ``prepared``: tokenized already); ``following``: unit ``index + 1``,
        read by ReadAhead meanwhile. Returns (tokens, CPU-seconds of this process during the call)."""
        import torch

        torch.set_num_threads(2)
        began = os.times()
        prepared = self.ahead.take(SimpleNamespace(id=index)) or prepared or self.encoder.prepare(texts)
        if following is not None:
            self.ahead.start(SimpleNamespace(id=index + 1), lambda _unit: self.encoder.prepare(following))
        self.encoder.embed(texts, prepared=prepared)
        ended = os.times()
        tokens = sum(int(tok.lengths.sum()) for _, tok, _ in prepared)
        return tokens, (ended.user - began.user) + (ended.system - began.system)


def run_mode(ray, mode: str, units: list[list[str]]) -> tuple[float, float]:
    options = {"num_cpus": 2}
    if mode == "threaded":
        options["max_concurrency"] = 2
    if mode == "groups":
        options["concurrency_groups"] = {"read": 1}
    actor = ray.remote(**options)(Worker).remote()
    ray.get(actor.__ray_ready__.remote())
    began, results = time.perf_counter(), []
    if mode == "groups":
        prepared = ray.get(actor.prepare.options(concurrency_group="read").remote(units[0]))
        for i, texts in enumerate(units):
            ref = actor.unit.remote(i, texts, prepared)
            nxt = actor.prepare.options(concurrency_group="read").remote(units[i + 1]) if i + 1 < len(units) else None
            results.append(ray.get(ref))
            prepared = ray.get(nxt) if nxt is not None else None
    else:
        for i, texts in enumerate(units):
            following = units[i + 1] if mode == "plain+thread" and i + 1 < len(units) else None
            results.append(ray.get(actor.unit.remote(i, texts, None, following)))
    wall = time.perf_counter() - began
    ray.kill(actor)
    tokens, cpu = sum(r[0] for r in results), sum(r[1] for r in results)
    return tokens / wall, cpu / wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sample_arguments(p, rows=2000)
    p.add_argument("--unit-rows", type=int, default=500)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if not args.corpus.is_file():
        print(f"skipped: corpus {args.corpus} is absent")
        return 0
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import ray

    texts = load_texts(args)
    units = [texts[s:s + args.unit_rows] for s in range(0, len(texts), args.unit_rows)]
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    rows: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for rnd in range(args.rounds):
        for mode in MODES:
            rate, cores = run_mode(ray, mode, units)
            rows[mode].append((rate, cores))
            print(f"  round {rnd + 1} {mode}: {rate:,.0f} tokens/s, {cores:.2f} cores busy", file=sys.stderr, flush=True)
            time.sleep(2)
    print(f"\n{len(texts):,} rows in units of {args.unit_rows}, {args.rounds} rounds; CPU: {cpu_description()}\n")
    print("| actor mode | tokens/s, each round | best | cores busy, each round | × plain (best) |")
    print("| --- | --- | ---: | --- | ---: |")
    plain = max(r for r, _ in rows["plain"])
    for mode, got in rows.items():
        best = max(r for r, _ in got)
        print(f"| {mode} | {' / '.join(f'{r:,.0f}' for r, _ in got)} | {best:,.0f} | "
              f"{' / '.join(f'{c:.2f}' for _, c in got)} | {best / plain:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
