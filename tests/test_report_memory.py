"""report/memory.py: a process's own peak memory, not its parent's (the report's driver, worker and task figures)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

CHILD = ("import resource; from embedpipe.report.memory import peak_rss_mb; "
         "print(peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
HELD_MB = 400


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the inherited ru_maxrss is Linux's")
def test_a_process_started_by_a_big_one_reports_its_own_peak():
    held = bytearray(HELD_MB << 20)
    held[::4096] = b"\1" * len(held[::4096])  # resident, page by page
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, check=True)
    ours, inherited = map(float, done.stdout.split())
    assert inherited > HELD_MB  # what the report used to say: the parent's peak, carried across fork and exec
    assert 5 < ours < HELD_MB / 2, ours  # the child's own: an interpreter and one small module
    del held


def test_it_follows_what_the_process_holds():
    grow = ("from embedpipe.report.memory import peak_rss_mb; before = peak_rss_mb(); held = bytearray(200 << 20); "
            "held[::4096] = b'\\1' * len(held[::4096]); print(before, peak_rss_mb())")
    done = subprocess.run([sys.executable, "-c", grow], cwd=ROOT, capture_output=True, text=True, check=True)
    before, after = map(float, done.stdout.split())
    assert 195 < after - before < 260, (before, after)  # its 200 MiB, and little else
