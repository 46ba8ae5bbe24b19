"""A process's own peak resident memory: the report's driver and worker figures, and the diff's task figure."""

from __future__ import annotations

import resource
import sys

STATUS = "/proc/self/status"  # Linux: this process's memory counters, VmHWM among them


def peak_rss_mb() -> float:
    """This process's peak resident memory, in MiB.

    On Linux, ``VmHWM``: the high-water mark of this process's own memory since it was exec'd. Not ``ru_maxrss``: Linux
    carries that across fork and exec, so a driver started by a big process (a notebook, a benchmark holding its
    corpus) reported the parent's peak (813 MiB for a child holding 13 under an 800 MiB parent). Elsewhere
    ``ru_maxrss`` (bytes on macOS, KiB on the other systems)."""
    try:
        with open(STATUS, encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # "VmHWM:   13508 kB"
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024
