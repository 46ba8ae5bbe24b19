"""The quickstart end to end, one tree against another in the same minutes: start-up, wall and whole-wall scaling.

Each round runs ``embedpipe run examples/quickstart.yaml`` from every tree, then from every tree again in reverse
order (a b b a), each in a fresh process from its own folder with ``PYTHONPATH`` set to it, its output in a scratch
folder (removed before each run, so every run is a new one), with the ``--set`` overrides given (the same for every
tree: ``--set output.dtype=int8`` runs the quickstart with its calibration). Prints every run's command wall (the
process's start to its exit), the report's start-up (its run_job to the first unit), wall and scaling efficiency
(whole wall, and after start-up), then each tree's medians and its median wall and start-up against the first
tree's. A tree is any checkout holding an ``embedpipe`` package and ``examples/`` (a git worktree).

It also says where the machine's CPU went during each command (Linux ``/proc/stat``, the whole machine: keep it
otherwise quiet): CPU-seconds busy, idle and stolen by the hypervisor, against the worker-seconds the report
counts on units. Idle near zero means the whole-wall scaling is bound by CPU the units do not use (Ray's
processes, the driver, the workers' start), not by waits that an overlap could fill. And how each run ends: the
report's wall after its last unit (the parts finished, the index, Ray shut down) and the command after the wall.

    .venv/bin/python scripts/bench_quickstart.py --tree before=/tmp/tree_before              # this tree vs before
    .venv/bin/python scripts/bench_quickstart.py --tree before=/tmp/tree_before --set output.dtype=int8 --rounds 2
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_sample import cpu_description  # noqa: E402

BIN_S = 0.5  # the machine's idle CPU is also told in steps of this many seconds of each command
FIGURES = ("command_s", "startup_s", "wall_s", "scaling", "scaling_after_startup", "busy_cpu_s", "idle_cpu_s",
           "stolen_cpu_s", "unit_s", "tail_s", "after_wall_s")


def cpu_seconds() -> dict[str, float]:
    """The machine's CPU-seconds so far, all CPUs: busy (user, nice, system, irq, softirq), idle (idle, iowait),
    stolen (steal). Linux only."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]  # cpu user nice system idle iowait irq softirq steal
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    hz = os.sysconf("SC_CLK_TCK")
    return {"busy": (user + nice + system + irq + softirq) / hz, "idle": (idle + iowait) / hz, "stolen": steal / hz}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH: another checkout to run the CLI from")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="a job override for every run (repeatable), as embedpipe run's --set")
    p.add_argument("--rounds", type=int, default=3, help="rounds of a b b a (default 3)")
    return p.parse_args()


def cli_run(*, tree: Path, out: Path, overrides: list[str]) -> dict:
    """The quickstart from ``tree`` into ``out`` (a new output) in a fresh process; its figures."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    sets = [arg for o in [*overrides, f"output.path={out}"] for arg in ("--set", o)]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        began, cpu = time.perf_counter(), cpu_seconds()
        proc = subprocess.Popen([sys.executable, "-c", "from embedpipe.cli import main; main()", "run",
                                 "examples/quickstart.yaml", "--no-progress", "-q", *sets], cwd=tree, env=env,
                                stdout=stdout, stderr=stderr, text=True)
        idle, last = [], cpu  # the machine's idle CPU-seconds in each BIN_S of the command, the last one partial
        while True:
            try:
                proc.wait(timeout=max(0.0, began + (len(idle) + 1) * BIN_S - time.perf_counter()))
                break
            except subprocess.TimeoutExpired:
                now = cpu_seconds()
                idle.append(now["idle"] - last["idle"])
                last = now
        command, used = time.perf_counter() - began, cpu_seconds()
        idle.append(used["idle"] - last["idle"])
        stderr.seek(0)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr.read())
    if done.returncode != 0:
        raise SystemExit(f"the quickstart from {tree} failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    return {"command_s": command, "startup_s": report["startup_seconds"], "wall_s": report["wall_seconds"],
            "scaling": report["scaling_efficiency"],
            "scaling_after_startup": report["scaling_efficiency_after_startup"],
            "busy_cpu_s": used["busy"] - cpu["busy"], "idle_cpu_s": used["idle"] - cpu["idle"],
            "stolen_cpu_s": used["stolen"] - cpu["stolen"],
            "unit_s": report["scaling_efficiency"] * len(report["per_worker"]) * report["wall_seconds"],
            "tail_s": report["wall_seconds"] - max(span[1] for w in report["per_worker"] for span in w["timeline"]),
            "after_wall_s": command - report["wall_seconds"],
            "idle_by_step": idle}


def main() -> int:
    args = parse_args()
    trees = {"this": ROOT} | {name: Path(path).resolve() for name, path in (t.split("=", 1) for t in args.tree)}
    print(f"CPU: {cpu_description()}; {os.cpu_count()} CPUs; overrides: {args.overrides or 'none'}; "
          f"{args.rounds} rounds a b b a")
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="bench_quickstart_") as scratch:
        for round_ in range(args.rounds):
            for name in [*trees, *reversed(trees)]:
                r = cli_run(tree=trees[name], out=Path(scratch) / name, overrides=args.overrides)
                runs[name].append(r)
                print(f"round {round_ + 1} {name}: command {r['command_s']:.2f} s, start-up {r['startup_s']:.2f} s, "
                      f"wall {r['wall_s']:.2f} s, scaling {r['scaling']:.1%} ({r['scaling_after_startup']:.1%} after "
                      f"start-up); CPU-s busy {r['busy_cpu_s']:.1f}, idle {r['idle_cpu_s']:.1f}, stolen "
                      f"{r['stolen_cpu_s']:.1f}, worker-s on units {r['unit_s']:.1f}; the wall after the last unit "
                      f"{r['tail_s']:.2f} s, the command after the wall {r['after_wall_s']:.2f} s", flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in FIGURES} for name, rs in runs.items()}
    first = medians[next(iter(trees))]
    print("\n| tree | command | start-up (range) | report wall | scaling, whole wall (range) | after start-up | "
          "wall × first tree's | start-up × first tree's |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, m in medians.items():
        starts, scalings = [r["startup_s"] for r in runs[name]], [r["scaling"] for r in runs[name]]
        print(f"| {name} | {m['command_s']:.2f} s | {m['startup_s']:.2f} s ({min(starts):.2f}-{max(starts):.2f}) | "
              f"{m['wall_s']:.2f} s | {m['scaling']:.1%} ({min(scalings):.1%}-{max(scalings):.1%}) | "
              f"{m['scaling_after_startup']:.1%} | {m['wall_s'] / first['wall_s']:.2f} | "
              f"{m['startup_s'] / first['startup_s']:.2f} |")
    print("\nThe run's end (medians): the report's wall after the last unit ended (the parts finished, the index, Ray "
          "shut down), and the command after the report's wall (the CLI's imports before its clock, the report "
          "written, the process's exit):\n")
    print("| tree | wall after the last unit (range) | command after the wall (range) |")
    print("| --- | ---: | ---: |")
    for name, m in medians.items():
        tails, afters = [r["tail_s"] for r in runs[name]], [r["after_wall_s"] for r in runs[name]]
        print(f"| {name} | {m['tail_s']:.2f} s ({min(tails):.2f}-{max(tails):.2f}) | {m['after_wall_s']:.2f} s "
              f"({min(afters):.2f}-{max(afters):.2f}) |")
    print("\nThe machine's CPU-seconds during each command (medians; busy + idle + stolen = CPUs × command):\n")
    print("| tree | busy | idle | stolen | worker-seconds on units | busy, not on units | idle, of all |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, m in medians.items():
        total = m["busy_cpu_s"] + m["idle_cpu_s"] + m["stolen_cpu_s"]
        print(f"| {name} | {m['busy_cpu_s']:.1f} | {m['idle_cpu_s']:.1f} | {m['stolen_cpu_s']:.1f} | "
              f"{m['unit_s']:.1f} | {m['busy_cpu_s'] - m['unit_s']:.1f} | {m['idle_cpu_s'] / total:.1%} |")
    print(f"\nThe machine's idle CPU-seconds in each {BIN_S} s of each tree's first command (of "
          f"{os.cpu_count() * BIN_S:.1f}; the last step partial):")
    for name, rs in runs.items():
        print(f"{name}: " + " ".join(f"{v:.1f}" for v in rs[0]["idle_by_step"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
