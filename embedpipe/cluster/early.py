"""Ray's start and the model's shipping beside preflight's duplicate-id scan.

The scan reads every unit's ids (about 1 µs per id: a second per 10^6 rows, minutes at 10^8), and the run then waits
for Ray to start (an embedded Ray: 1.5-2.5 s on two cores) and for the model's files to go into the object store
(a second or more per GB). Neither needs the scan's answer, only the checks before it (output, input, model:
``preflight.check_job``), so the driver does them on its main thread while the scan runs on a helper thread:

    check_job (main thread) ─► scan_ids ───────────────────────────────► RunPlan
                             └► (after SCAN_ALONE_S) connect ─► ship_model ─► EarlyRay (handed to the run)

A scan done within ``SCAN_ALONE_S`` (a small input's) starts nothing beside it: the run goes on as without this
module, and a bad input's error comes as fast. Ray starts on the main thread: an embedded Ray's processes die
with the thread that started them, and its signal handlers can only be set there. A scan that fails once Ray was
started shuts that Ray down before its error is raised: a large input with duplicate ids still fails with its own
one line, Ray's start and stop later.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from embedpipe.cluster.connect import connect, disconnect
from embedpipe.cluster.modelship import ShippedModel, ship_model
from embedpipe.preflight import CheckedJob, RunPlan, scan_ids

SCAN_ALONE_S = 0.5  # a scan done within this starts no Ray beside it (the quickstart's, 3,000 rows: 0.25 s)


@dataclass(frozen=True)
class EarlyRay:
    """What the driver set up beside the scan: whether it started Ray (then the run shuts it down), and the model
    in the object store."""

    started: bool
    model: ShippedModel


def scan_beside_ray(checked: CheckedJob, *, alone_s: float = SCAN_ALONE_S) -> tuple[RunPlan, EarlyRay | None]:
    """``scan_ids(checked)`` on a helper thread; when it is not done within ``alone_s``, this (main) thread starts
    or joins Ray and ships the model meanwhile. None beside the plan: nothing was started (the run does it).

    The scan's error wins over Ray's (the input is the user's to fix, and Ray's start may fail for want of the
    same resources a second run would ask for); either way Ray is shut down first when this call started it.
    A Ctrl-C or SIGTERM (KeyboardInterrupt here) shuts it down too; the scan, a reader only, ends with the
    process."""
    answer: dict = {}

    def scan() -> None:
        try:
            answer["plan"] = scan_ids(checked)
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            answer["error"] = exc

    scanner = threading.Thread(target=scan, name="embedpipe-id-scan", daemon=True)
    scanner.start()
    scanner.join(alone_s)
    if not scanner.is_alive():  # a short scan: nothing started beside it
        if "error" in answer:
            raise answer["error"]
        return answer["plan"], None
    started, ray_error, model = False, None, None
    try:
        try:
            started = connect(checked.job.cluster)
            model = ship_model(checked.model.dir)
        except Exception as exc:  # noqa: BLE001 - said after the scan's own error, if it has one
            ray_error = exc
        scanner.join()
    except BaseException:
        disconnect(started)
        raise
    error = answer.get("error") or ray_error
    if error is not None:
        disconnect(started)
        raise error
    return answer["plan"], EarlyRay(started=started, model=model)
