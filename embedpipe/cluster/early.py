"""Ray's start and the model's shipping beside preflight's duplicate-id scan.

The scan reads every unit's ids (about 1 µs per id: a second per 10^6 rows, minutes at 10^8), and the run then waits
for Ray to start (an embedded Ray: 1.5-2.5 s on two cores) and for the model's files to go into the object store
(a second or more per GB). Neither needs the scan's answer, only the checks before it (output, input, model:
``preflight.check_job``), so the driver does them on its main thread while the scan runs on a helper thread:

    check_job (main thread) ─► scan_ids ───────────────────────────────────────────────► RunPlan
                             └► (after SCAN_ALONE_S) connect ─► ship_model ─► start_workers ─► EarlyRay (to the run)

A scan done within ``SCAN_ALONE_S`` (a small input's) starts nothing beside it: the run goes on as without this
module, and a bad input's error comes as fast. Ray starts on the main thread: an embedded Ray's processes die
with the thread that started them, and its signal handlers can only be set there. A scan that fails once Ray was
started shuts that Ray down before its error is raised: a large input with duplicate ids still fails with its own
one line, Ray's start and stop later. A Ctrl-C or SIGTERM meanwhile is held until the scan has stopped and Ray is
shut down (at most Ray's start, which nothing interrupts), then raised again.

``start_workers`` (the driver's) asks for the run's workers as soon as the model is shipped: their own start
(process, ``import torch``, the model's load, on GPU the CUDA context and warmup) goes on beside the rest of the scan
(and an incremental night's diff, whose tasks then run on the CPUs the idle workers hold: cluster/diff.py). They
are handed to the run with Ray, and ended with it on every way out that does not reach the run.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import ray

from embedpipe.cluster.connect import connect, disconnect
from embedpipe.cluster.modelship import ShippedModel, ship_model
from embedpipe.cluster.signals import handled
from embedpipe.preflight import CheckedJob, RunPlan, scan_ids

SCAN_ALONE_S = 0.5  # a scan done within this starts no Ray beside it (the quickstart's, 3,000 rows: 0.25 s)
JOIN_STEP_S = 0.05  # how soon a held signal is seen while the main thread waits for the scan


@dataclass(frozen=True)
class EarlyRay:
    """What the driver set up beside the scan: whether it started Ray (then the run shuts it down), the model in
    the object store, and the run's workers asked for (a Scheduler after its ``start``; None: the run asks)."""

    started: bool
    model: ShippedModel
    workers: Any = None

    def close(self) -> None:
        """End the workers (those the run did not take, or took and ended) and the Ray this started."""
        _end(self.workers, started=self.started)


def _end(workers: Any, *, started: bool) -> None:
    if workers is not None and ray.is_initialized():
        workers.stop()
    disconnect(started)


def scan_beside_ray(checked: CheckedJob, *, alone_s: float = SCAN_ALONE_S,
                    start_workers: Callable[[ShippedModel], Any] | None = None) -> tuple[RunPlan, EarlyRay | None]:
    """``scan_ids(checked)`` on a helper thread; when it is not done within ``alone_s``, this (main) thread starts
    or joins Ray, ships the model and, given ``start_workers`` (the shipped model -> the run's workers, asked for:
    a started Scheduler), asks for the workers meanwhile. None beside the plan: nothing was started (the run does it).

    The scan's error wins over Ray's (the input is the user's to fix, and Ray's start may fail for want of the
    same resources a second run would ask for); either way Ray is shut down first when this call started it.
    A SIGINT or SIGTERM meanwhile is held (``_signals_held``): the scan is stopped and has ended, and Ray is shut
    down, before the signal is raised again for the run's own handler."""
    answer: dict = {}
    stop = threading.Event()  # set on a signal: the scan ends at its next unit

    def scan() -> None:
        try:
            answer["plan"] = scan_ids(checked, stop=stop)
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            answer["error"] = exc

    scanner = threading.Thread(target=scan, name="embedpipe-id-scan", daemon=True)
    started, ray_error, model, workers = False, None, None, None
    with _signals_held() as signals:
        scanner.start()
        _join(scanner, signals, timeout=alone_s)
        if scanner.is_alive() and not signals:  # a long scan: Ray's start and the model's shipping beside it
            try:
                started = connect(checked.job.cluster)  # a signal meanwhile waits for its end (it cannot stop ray.init)
                model = ship_model(checked.model.dir)
                if start_workers is not None and scanner.is_alive() and not signals:
                    workers = start_workers(model)
            except Exception as exc:  # noqa: BLE001 - said after the scan's own error, if it has one
                ray_error = exc
            _join(scanner, signals)
        if signals:
            stop.set()
            _end(workers, started=started)
            scanner.join()  # the scan's next unit ends it
    if signals:
        signal.raise_signal(signals[0])  # the run's handler (run_job: Interrupted) raises it here, nothing importing
    error = answer.get("error") or ray_error
    if error is not None:
        _end(workers, started=started)
        raise error
    return answer["plan"], EarlyRay(started=started, model=model, workers=workers) if model is not None else None


def _join(scanner: threading.Thread, signals: list[int], *, timeout: float | None = None) -> None:
    """Wait for the scan to end, at most ``timeout`` (None: no bound), or until a signal is held."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while scanner.is_alive() and not signals:
        left = JOIN_STEP_S if deadline is None else min(JOIN_STEP_S, deadline - time.monotonic())
        if left <= 0:
            return
        scanner.join(left)


@contextmanager
def _signals_held() -> Iterator[list[int]]:
    """Inside the block, SIGINT and SIGTERM are noted (the list it yields), not acted on; after it, the handlers
    are put back. A signal's handler runs on the main thread wherever that thread is, inside the import machinery
    too (Ray's start imports); raised there (importlib's module-lock callback), the exception is swallowed and
    the interpreter's import lock stays held, so the scan thread's next import waits forever (seen: a SIGINT 2 s
    into a 6·10^6-row run hung it). An ignored signal stays ignored. Outside the main thread (no handlers can be set
    there) nothing changes."""
    held: list[int] = []
    with handled(lambda signum, frame: held.append(signum), ignored_stay=True):
        yield held
