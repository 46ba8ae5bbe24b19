"""First-come first-served units over a pool of worker actors, surviving worker deaths and stalls.

A free worker takes the next unit, so a slow worker never holds the rest back. With ``depth`` 2 (the
embedding workers) each worker also holds the unit after it: the call of its current unit names that one
(``process(unit, ahead=next)``), so the worker reads and tokenizes it while it encodes the first, and the next
call finds it ready (its only wait is the driver's round trip, milliseconds). Once the queue is empty, a worker
with nothing left takes the unit another worker holds behind its current one (none of it began: its read ahead is
dropped), so a slower worker does not keep a unit that a free one can start now. When a worker
dies (killed, out of memory, its node lost) its unit goes back to the queue and a new actor
takes its slot (a unit held behind it had not begun encoding: it goes back to the front of the queue
without losing an attempt); a unit that has killed ``max_attempts`` workers fails the run, or is set aside
when ``on_error`` is ``skip_unit``. Bad input (``InputError``) is never retried: it would fail
the same way again, and neither is a full or read-only disk (every unit would hit it), nor a worker running
other embedpipe code than the driver (``CodeMismatch``: its node's install).

Liveness (``Liveness``): the driver never waits on a worker without a bound.

- A unit past its deadline (``unit_deadline``; its clock starts when its worker is ready and the
  unit before it on that worker is done, so model load and queueing never count) is a stalled worker: it is killed and replaced, the unit requeued
  (an attempt, as a death).
- A worker that fails to start (its ``__init__`` raised: model load, warmup) or whose start takes longer than
  ``startup_timeout_s`` is replaced; its units go back to the front of the queue without losing an attempt (none
  began). A slot whose workers failed to start ``max_attempts`` times in a row is given up with a warning; the run
  fails (``NoWorkerStarted``, with the last start's error) only when no slot is left.
- A new actor Ray cannot place within ``placement_timeout_s`` (no free CPU/GPU) is given up
  with a warning; the run goes on with the workers it has and fails (``NoWorkerPlaced``)
  only when none is left.

Its workers are Ray actors of ``worker_actor(cls)``: ``cls`` has ``process(unit[, ahead])``; the wrapper keeps an
error its ``__init__`` raised and answers ``started()`` with it, as a call's error. The driver then says it in one
line, as it says a unit's. Raised from ``__init__``, Ray would also print the worker's traceback on the driver's
terminal (its "Exception raised in creation task" log, forwarded by ``log_to_driver``). A worker's start is
answered by its ready call: ``started()``, or the call ``run`` is given (``ready``: the embedding workers'
``configure``, with the run's settings). ``start()`` asks for the actors before ``run`` has units (beside the
driver's id scan, cluster/early.py); ``run`` then makes their ready calls. Before ``run``, ``share`` hands pieces of
other work to the workers as they start (the int8/uint8 calibration's sample, which their ``configure`` needs).
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import ray
import ray.exceptions as rex

from embedpipe.cluster.codeid import CodeMismatch
from embedpipe.cluster.nodes import node_label
from embedpipe.config import UNIT_TIMEOUT_FACTOR, UNIT_TIMEOUT_FLOOR_S, ClusterConfig
from embedpipe.errors import RunError, first_line, remote_message
from embedpipe.units import InputError, Unit

log = logging.getLogger(__name__)

# A worker process or its node went away: the unit is fine, the worker is not.
WORKER_DEATH = (rex.RayActorError, rex.WorkerCrashedError, rex.OutOfMemoryError, rex.NodeDiedError,
                rex.ObjectLostError, rex.LocalRayletDiedError)
# errno -> (what is wrong with the disk, the fix): retrying or skipping the unit cannot help
DISK_ERRNOS = {errno.ENOSPC: ("is full", "free space there"), errno.EDQUOT: ("is over its quota", "free space there"),
               errno.EROFS: ("is read-only", "make it writable")}
POLL_S = 1.0  # longest wait between liveness checks (placement is polled at this pace)

Cause = Literal["died", "timeout", "error"]


class UnitFailed(RunError, RuntimeError):
    """A unit failed ``max_attempts`` times with ``on_error: fail``, or a disk error stopped the run."""


class NoWorkerPlaced(RunError, RuntimeError):
    """Every worker slot was given up: Ray could place none of their actors."""


class NoWorkerStarted(RunError, RuntimeError):
    """Every worker slot was given up, the last because its workers kept failing to start."""


@dataclass(frozen=True)
class Liveness:
    """The scheduler's bounds, from ``cluster.*_timeout_s`` (docs/job-reference.md)."""

    unit_timeout_s: float | None  # null: derived by unit_deadline
    startup_timeout_s: float  # a placed worker's start; the first units' bound when derived
    placement_timeout_s: float  # a new actor not placed by then is given up
    floor_s: float = UNIT_TIMEOUT_FLOOR_S
    factor: float = UNIT_TIMEOUT_FACTOR

    @classmethod
    def from_config(cls, cfg: ClusterConfig) -> "Liveness":
        return cls(unit_timeout_s=cfg.unit_timeout_s, startup_timeout_s=cfg.startup_timeout_s,
                   placement_timeout_s=cfg.placement_timeout_s)


def unit_deadline(liveness: Liveness, *, rows: int, slowest_s_per_row: float | None) -> float:
    """Seconds a unit of ``rows`` rows may take on a ready worker.

    The override if set; else, with no unit finished yet (no observation), the generous startup
    bound; else ``max(floor, factor x slowest observed seconds per row x rows)``.
    """
    if liveness.unit_timeout_s is not None:
        return liveness.unit_timeout_s
    if slowest_s_per_row is None:
        return liveness.startup_timeout_s
    return max(liveness.floor_s, liveness.factor * slowest_s_per_row * max(rows, 1))


@dataclass
class UnitFailure:
    unit: Unit
    attempts: int
    error: str

    def to_dict(self) -> dict:
        return {"unit": self.unit.id, "file": self.unit.file, "row_groups": list(self.unit.row_groups),
                "attempts": self.attempts, "error": self.error}


@dataclass(frozen=True)
class UnitRetry:
    """One lost attempt of a unit that went back to the queue (or was set aside), for the report."""

    unit: Unit  # or an index shard's Part
    attempt: int
    cause: Cause
    error: str
    worker: int  # the slot whose actor lost it
    node: str  # the Ray node that actor ran on (node_label); "" when Ray no longer knows

    def to_dict(self) -> dict:
        return {"unit": self.unit.id, "file": getattr(self.unit, "file", None), "attempt": self.attempt,
                "cause": self.cause,
                "error": self.error, "worker": self.worker, "node": self.node}


@dataclass(frozen=True)
class StartFailure:
    """One worker that did not start (its ``__init__`` raised, it died starting, or it passed
    ``startup_timeout_s``), for the report."""

    worker: int  # its slot
    node: str  # the Ray node it was placed on (node_label); "" when Ray no longer knows
    error: str

    def to_dict(self) -> dict:
        return {"worker": self.worker, "node": self.node, "error": self.error}


@dataclass
class _Call:
    """One unit handed to a worker: its pending process() call, or (a unit held behind it) none yet."""

    unit: Any
    ref: Any  # None: held for this worker, its call made when the one before it is done
    taken: float  # when the unit's clock started: max(held, worker ready, the call before it done)


@dataclass
class _Slot:
    """One worker slot: its actor, how far its start got, and the units it holds."""

    index: int
    actor: Any  # None once given up
    created: float  # time.monotonic() when the actor was asked for
    ready_ref: Any  # the pending started() call; None once answered
    placed: float | None = None  # when Ray gave it a worker process
    ready: float | None = None  # when its __init__ finished
    failed_starts: int = 0  # this slot's workers that failed to start in a row, before this one
    calls: list[_Call] = field(default_factory=list)  # in order: calls[0] is in flight, the rest are held

    @property
    def unit(self):
        """The unit this worker is encoding (its first call's); None when idle."""
        return self.calls[0].unit if self.calls else None

    @property
    def ref(self):
        """The pending process() call; None when idle."""
        return self.calls[0].ref if self.calls else None


@dataclass
class Scheduler:
    make_actor: Callable[[int], "ray.actor.ActorHandle"]  # slot -> a new actor of a worker_actor(...) class
    workers: int
    max_attempts: int = 3
    on_error: str = "fail"  # or "skip_unit"
    liveness: Liveness = field(default_factory=lambda: Liveness.from_config(ClusterConfig()))
    resources: dict[str, float] = field(default_factory=dict)  # one worker's {"CPU": n, "GPU": m}, for messages
    retried: int = 0  # unit attempts lost to a worker death, stall or error
    retries: list[UnitRetry] = field(default_factory=list)  # each of them, in the order they were lost
    start_failures: list[StartFailure] = field(default_factory=list)  # workers that did not start, in order
    failed: list[UnitFailure] = field(default_factory=list)
    replaced: int = 0  # actors started to replace dead or stalled ones
    given_up: int = 0  # slots left empty: their actor could not be placed, or their workers kept failing to start
    depth: int = 1  # units a worker holds; above 1 its actor takes process(unit, ahead=the unit held after it)
    _slots: list[_Slot] = field(default_factory=list, init=False, repr=False)
    _ready: Callable[[Any], Any] | None = field(default=None, init=False, repr=False)
    _queue: deque = field(default_factory=deque, init=False, repr=False)  # units not yet handed to a worker
    _gave_up_starting: str | None = field(default=None, init=False, repr=False)  # see run

    def start(self) -> None:
        """Ask Ray for every slot's actor now, before ``run`` has its units: their starts (process, imports, model
        load) go on while the caller plans. ``run`` then makes each one's ready call. ``stop`` ends them if ``run``
        never comes."""
        now, self._slots = time.monotonic(), []
        try:
            for i in range(self.workers):
                self._slots.append(_Slot(index=i, actor=self.make_actor(i), created=now, ready_ref=None))
        except BaseException:  # the actors asked for so far are ended: the caller gets no scheduler to stop
            self.stop()
            raise

    def keep(self, workers: int) -> None:
        """Run ``workers`` workers at most (fewer units than workers); the slots started beyond them are ended."""
        for slot in self._slots[workers:]:
            _kill(slot.actor)
        self._slots, self.workers = self._slots[:workers], min(self.workers, workers)

    def stop(self) -> None:
        """End every actor this scheduler asked for (those ``start`` asked for before a ``run`` that never came)."""
        for slot in self._slots:
            _kill(slot.actor)
            slot.actor = None

    def share(self, pieces: list, call: Callable[[Any, Any], Any]) -> list:
        """Each piece's answer of ``call`` (an actor and a piece -> the reference of one of its calls), in the
        pieces' order, made on this scheduler's workers before ``run``: the int8/uint8 calibration's sample, cut in
        pieces, is embedded by the run's own workers (their own encoder, no second model load). First come first
        served, one piece per worker at a time, each worker as soon as it has started. Starts are bounded, and
        failed ones replaced, as in ``run``; a worker that dies in a call counts as a failed start (no unit began on
        it) and its piece goes to the next worker. The calls' own errors are raised, in the worker's words."""
        if not self._slots:
            self.start()
        for slot in self._slots:
            if slot.actor is not None and slot.ready is None and slot.ready_ref is None:
                slot.ready_ref = self._ready_call(slot.actor)  # before run: started()
        todo, answers, busy = deque(range(len(pieces))), [None] * len(pieces), {}  # busy: ref -> (slot, piece)
        while todo or busy:
            live = self._live()
            taken = {id(slot) for slot, _ in busy.values()}
            for slot in live:  # every started, idle worker takes the next piece
                if todo and slot.ready is not None and id(slot) not in taken:
                    i = todo.popleft()
                    busy[call(slot.actor, pieces[i])] = (slot, i)
            pending = {s.ready_ref: s for s in live if s.ready_ref is not None}
            done, _ = ray.wait([*pending, *busy], num_returns=1, timeout=self._wait_s(live))
            if done and done[0] in busy:
                slot, i = busy.pop(done[0])
                try:
                    answers[i] = ray.get(done[0])
                except Exception as exc:  # noqa: BLE001 - sorted below: never retried, a death, or the call's own
                    final = _never_retried(exc)
                    if final is not None:
                        raise final from None
                    if not isinstance(exc, WORKER_DEATH):
                        raise
                    todo.appendleft(i)
                    self._failed_start(slot, remote_message(exc))
            elif done:
                self._started(pending[done[0]])
            self._check(time.monotonic())
        return answers

    def run(self, units: list, *, ready: Callable[[Any], Any] | None = None) -> Iterator:
        """Yield each unit's result as it finishes (completion order). ``ready``: a new actor -> the reference of
        the call that answers its start (an actor's settings, given before its first unit: the embedding workers'
        ``configure``); None: its ``started()``. Every actor's start is answered before its first unit's result."""
        self._queue, self._attempts = deque(units), {u.id: 0 for u in units}
        self._slowest: float | None = None  # slowest seconds per row of a finished unit
        self._gave_up_starting: str | None = None  # the line of the last slot given up for its failed starts
        self._ready = ready
        if self._slots:  # asked for by start(): their ready calls now
            for slot in self._slots:
                slot.ready_ref = self._ready_call(slot.actor)
        else:
            self._slots = [self._start(i) for i in range(self.workers)]
        try:
            self._fill()
            while self._queue or any(s.calls for s in self._slots):
                result = self._step()
                if result is not None:
                    yield result
        finally:
            for slot in self._slots:
                _kill(slot.actor)

    # ------------------------------------------------------------------ one event

    def _step(self):
        live = self._live()
        pending = {s.ready_ref: s for s in live if s.ready_ref is not None}  # first: a start before its result
        # a worker answers its calls in order (a death fails them all): only the first is waited on
        pending |= {s.calls[0].ref: s for s in live if s.calls}  # _fill made every first unit's call
        done, _ = ray.wait(list(pending), num_returns=1, timeout=self._wait_s(live))
        result = None
        if done:
            slot = pending[done[0]]
            if slot.ready_ref is not None:  # its start, or a call after it: a start is answered first
                self._started(slot)
            else:
                result = self._finished(slot)
        self._check(time.monotonic())
        self._fill()
        return result

    def _started(self, slot: _Slot) -> None:
        ref, slot.ready_ref = slot.ready_ref, None
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - its __init__ failed, or its process died while starting
            self._start_raised(slot, exc)
            return
        now = time.monotonic()
        slot.placed, slot.ready = slot.placed or now, now
        if slot.calls:
            slot.calls[0].taken = max(slot.calls[0].taken, now)

    def _finished(self, slot: _Slot):
        call = slot.calls.pop(0)  # its worker's start was answered first (_step): the unit's clock ran from taken
        unit, started = call.unit, call.taken
        if slot.calls:  # the held unit's turn: its clock starts now (its call is made in _fill)
            slot.calls[0].taken = max(slot.calls[0].taken, time.monotonic())
        try:
            result = ray.get(call.ref)
        except Exception as exc:  # noqa: BLE001 - never retried, a worker death or an unexpected error
            final = _never_retried(exc)
            if final is not None:
                raise final from None
            return self._failed_call(slot, unit, exc)
        rate = (time.monotonic() - started) / max(_rows(unit), 1)
        self._slowest = max(self._slowest or 0.0, rate)
        return result

    def _failed_call(self, slot: _Slot, unit, exc: BaseException) -> None:
        disk = disk_problem(exc)
        if disk is not None:
            raise UnitFailed(f"{unit.label}: {disk}") from None
        died = isinstance(exc, WORKER_DEATH)
        self._lost(slot, unit, cause="died" if died else "error", error=remote_message(exc), replace=died)

    def _start_raised(self, slot: _Slot, exc: BaseException) -> None:
        disk = disk_problem(exc)
        if disk is not None:  # every start would meet it (the model's cache on that disk)
            raise UnitFailed(f"worker {slot.index} could not start: {disk}") from None
        self._failed_start(slot, remote_message(exc))

    def _failed_start(self, slot: _Slot, error: str) -> None:
        """A worker that did not start: a new one takes the slot, or after ``max_attempts`` in a row the slot is
        given up. Its units go back to the front of the queue with no attempt lost: none of them began."""
        failed = slot.failed_starts + 1
        self.start_failures.append(StartFailure(slot.index, _actor_node(slot.actor), error))
        if failed < self.max_attempts:
            log.warning("worker %d failed to start (%d of %d in a row): %s; a new worker takes its slot",
                        slot.index, failed, self.max_attempts, error)
            self._replace(slot)
            self._slots[slot.index].failed_starts = failed
            return
        left = self._vacate(slot)
        self._gave_up_starting = (f"no worker could start: worker {slot.index} failed to start {failed} times in a "
                                  f"row, last: {error}; fix that and rerun the same command to resume: finished units "
                                  f"are kept")
        log.warning("worker %d given up: it failed to start %d times in a row, last: %s; %d worker(s) left",
                    slot.index, failed, error, left)

    # ------------------------------------------------------------------ liveness

    def _check(self, now: float) -> None:
        """Give up, or replace, every worker past one of its bounds."""
        lv = self.liveness
        for slot in self._slots:
            if slot.actor is None:
                continue
            if slot.placed is None and _placed(slot.actor):
                slot.placed = now
            if slot.placed is None and now - slot.created > lv.placement_timeout_s:
                self._give_up(slot)
            elif slot.ready is None and slot.placed is not None and now - slot.placed > lv.startup_timeout_s:
                slot.ready_ref = None  # a start that hung: no attempt lost, its answer no longer waited on
                self._failed_start(slot, f"it did not start within {lv.startup_timeout_s:g} s "
                                         f"(cluster.startup_timeout_s)")
            elif slot.ready is not None and slot.calls and now - slot.calls[0].taken > self._deadline(slot.unit):
                self._stalled(slot, f"its worker did not finish it within {self._deadline(slot.unit):.0f} s")

    def _deadline(self, unit) -> float:
        return unit_deadline(self.liveness, rows=_rows(unit), slowest_s_per_row=self._slowest)

    def _wait_s(self, live: list[_Slot]) -> float:
        """Until the nearest bound, at most POLL_S (placement is polled)."""
        lv, now, bounds = self.liveness, time.monotonic(), [POLL_S]
        for s in live:
            if s.ready is not None and s.calls:
                bounds.append(s.calls[0].taken + self._deadline(s.unit) - now)
            elif s.placed is not None and s.ready is None:
                bounds.append(s.placed + lv.startup_timeout_s - now)
        return max(min(bounds), 0.01)

    def _stalled(self, slot: _Slot, why: str) -> None:
        unit = slot.calls.pop(0).unit
        self._lost(slot, unit, cause="timeout", error=why, replace=True)

    def _give_up(self, slot: _Slot) -> None:
        left = self._vacate(slot)
        log.warning("worker %d given up: Ray could not place it within %g s (%s); %d worker(s) left",
                    slot.index, self.liveness.placement_timeout_s, self._free_text(), left)

    def _vacate(self, slot: _Slot) -> int:
        """Give ``slot`` up: its actor killed, its units back to the front of the queue (none of them began there);
        returns the slots left."""
        _kill(slot.actor)
        slot.actor, slot.ready_ref, self.given_up = None, None, self.given_up + 1
        self._requeue(slot)
        return sum(s.actor is not None for s in self._slots)

    def _live(self) -> list[_Slot]:
        """The slots with an actor; none left fails the run, with the last start's error when the last slot was
        given up for its starts."""
        live = [s for s in self._slots if s.actor is not None]
        if not live:
            if self._gave_up_starting is not None:
                raise NoWorkerStarted(self._gave_up_starting)
            raise NoWorkerPlaced(self._no_worker_message())
        return live

    def _no_worker_message(self) -> str:
        cpus, gpus = self.resources.get("CPU", 0), self.resources.get("GPU", 0)
        needs = (f"{cpus:g} CPU (cluster.cpus_per_worker={cpus:g})" + (f" and {gpus:g} GPU" if gpus else "")
                 if self.resources else "the resources its actor asks for")
        return (f"no worker could be placed for {self.liveness.placement_timeout_s:g} s: {self._free_text()}, each "
                f"worker needs {needs}; add nodes, or lower cluster.workers or cluster.cpus_per_worker")

    @staticmethod
    def _free_text() -> str:
        free = ray.available_resources()
        return f"the cluster has {free.get('CPU', 0):g} CPUs / {free.get('GPU', 0):g} GPUs free"

    # ------------------------------------------------------------------ slots and units

    def _start(self, index: int) -> _Slot:
        actor = self.make_actor(index)
        return _Slot(index=index, actor=actor, created=time.monotonic(), ready_ref=self._ready_call(actor))

    def _ready_call(self, actor) -> Any:
        return actor.started.remote() if self._ready is None else self._ready(actor)

    def _replace(self, slot: _Slot) -> None:
        _kill(slot.actor)
        self._requeue(slot)
        self.replaced += 1
        self._slots[slot.index] = self._start(slot.index)

    def _requeue(self, slot: _Slot) -> None:
        """The units still on ``slot`` go back to the front of the queue, in order, no attempt lost: none of them
        began encoding (the one that had was taken off by the caller, with its attempt)."""
        self._queue.extendleft(reversed([call.unit for call in slot.calls]))
        slot.calls = []

    def _fill(self) -> None:
        """Every live worker takes the next unit (a starting one too: its clock starts when it is ready); idle
        workers first, then each up to ``depth`` units, so few units still spread over every worker. Then each
        worker's first unit without a call gets one, naming the unit held after it."""
        for held in range(self.depth):
            for slot in self._slots:
                if self._queue and slot.actor is not None and len(slot.calls) == held:
                    slot.calls.append(_Call(self._queue.popleft(), None, taken=time.monotonic()))
        if not self._queue:
            self._hand_over_held()
        for slot in self._slots:
            if slot.actor is not None and slot.calls and slot.calls[0].ref is None:
                self._submit(slot)

    def _hand_over_held(self) -> None:
        """The queue is empty: each started worker with no unit takes the last unit held behind another worker's
        current one, from the worker holding the most. A held unit began nowhere (its holder was only reading it
        ahead), so it moves without an attempt; a worker still starting takes none (its start may take longer
        than the unit)."""
        for idle in self._slots:
            if idle.actor is None or idle.calls or idle.ready is None or idle.ready_ref is not None:
                continue
            holders = [s for s in self._slots if s.actor is not None and len(s.calls) > 1]
            if not holders:
                return
            held = max(holders, key=lambda s: len(s.calls)).calls.pop()
            idle.calls.append(_Call(held.unit, None, taken=time.monotonic()))

    def _submit(self, slot: _Slot) -> None:
        call = slot.calls[0]
        ahead = slot.calls[1].unit if len(slot.calls) > 1 else None
        call.ref = (slot.actor.process.remote(call.unit) if self.depth == 1
                    else slot.actor.process.remote(call.unit, ahead=ahead))

    def _lost(self, slot: _Slot, unit, *, cause: Cause, error: str, replace: bool) -> None:
        """A failed attempt: requeue the unit, set it aside, or fail the run."""
        self._attempts[unit.id] += 1
        self.retried += 1
        attempts = self._attempts[unit.id]
        self.retries.append(UnitRetry(unit, attempts, cause, error, worker=slot.index, node=_actor_node(slot.actor)))
        log.warning("%s: attempt %d/%d failed (%s): %s", unit.label, attempts, self.max_attempts,
                    {"died": "worker died", "timeout": "worker stalled", "error": "error"}[cause], error)
        if replace:
            self._replace(slot)
        if attempts < self.max_attempts:
            self._queue.append(unit)
        elif self.on_error == "skip_unit":
            self.failed.append(UnitFailure(unit, attempts, error))
        else:
            raise UnitFailed(failure_message(unit.label, attempts=attempts, cause=cause, error=error))


def failure_message(label: str, *, attempts: int, cause: Cause, error: str) -> str:
    """Why a unit failed the run and what to do, by its last failure's cause."""
    skip = "or set cluster.on_error: skip_unit to finish without it"
    if cause == "timeout":
        return (f"{label} stalled {attempts} times, last: {error} (its worker was killed each time); if units "
                f"are this slow, raise cluster.unit_timeout_s, {skip}")
    if cause == "died":
        return (f"{label} killed {attempts} workers, last: {error}; if they ran out of memory, lower "
                f"batching.max_tokens or input.unit_rows, {skip}")
    return f"{label} failed {attempts} times, last: {error}; fix or remove that file, {skip}"


def _never_retried(exc: BaseException) -> Exception | None:
    """The error to stop on, in the worker's own words, when ``exc`` would fail every attempt the same way: bad input
    (``InputError``), or a worker running other embedpipe code than the driver (``CodeMismatch``, its node's install).
    None for any other error. (A RayTaskError subclasses the worker's exception type.)"""
    for kind in (InputError, CodeMismatch):
        if isinstance(exc, kind):
            return kind(remote_message(exc))
    return None


def disk_problem(exc: BaseException) -> str | None:
    """A full, over-quota or read-only disk behind ``exc`` (as raised, or wrapped in RayTaskError), said
    with its fix; None for any other error."""
    cause = getattr(exc, "cause", None) or exc
    code = cause.errno if isinstance(cause, OSError) else None
    if code not in DISK_ERRNOS:  # the cause may not have crossed intact: read the message
        line = first_line(exc)
        code = next((c for c in DISK_ERRNOS if f"[Errno {c}]" in line or os.strerror(c) in line), None)
    if code is None:
        return None
    where = getattr(cause, "filename", None)
    disk = f"the disk holding {where}" if where else "the output disk"
    what, fix = DISK_ERRNOS[code]
    return (f"writing failed: {disk} {what} ({os.strerror(code)}); {fix} and rerun the same command to resume: "
            f"finished units are kept")


def worker_actor(cls: type) -> Any:
    """``ray.remote`` of ``cls`` for the Scheduler: an error its ``__init__`` raises is kept and raised by
    ``started()``, and a ``process`` call queued behind that start returns None without running (the scheduler
    replaces the worker and requeues the unit). Where ``cls`` has ``configure`` (the second half of its start, made
    as ``Scheduler.run``'s ready call), that call raises the kept error, or its own, which is kept the same way.
    Any other public method of ``cls`` (``EmbedWorker.embed_sample``) raises the kept error first too. Ray knows it
    by ``cls``'s name (``EmbedWorker``)."""

    def __init__(self, *args, **kwargs) -> None:
        self._start_error = None
        try:
            cls.__init__(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - answered by started(), in the worker's own words
            self._start_error = exc

    def started(self) -> None:
        if self._start_error is not None:
            raise self._start_error

    def process(self, *args, **kwargs):
        return None if self._start_error is not None else cls.process(self, *args, **kwargs)

    methods = {"__init__": __init__, "started": started, "process": process}
    if hasattr(cls, "configure"):
        def configure(self, *args, **kwargs):  # a ready call (Scheduler.run's ready): the start's error first
            started(self)
            try:
                return cls.configure(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a failed start: the calls queued behind it do not run
                self._start_error = exc
                raise

        methods["configure"] = configure
    def after_start(method: Callable) -> Callable:
        def call(self, *args, **kwargs):
            started(self)
            return method(self, *args, **kwargs)

        call.__name__ = method.__name__
        return call

    for name, method in vars(cls).items():  # its other calls (embed_sample): the start's error first
        if inspect.isfunction(method) and not name.startswith("_") and name not in methods:
            methods[name] = after_start(method)
    kept = type(cls.__name__, (cls,), {**methods,
                                       "__doc__": cls.__doc__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})  # Ray's class_name; pickled by value
    # (cloudpickle pickles a class by reference only when its module's attribute of that name is the class itself)
    return ray.remote(kept)


def _placed(actor) -> bool:
    """Has Ray given ``actor`` a worker process (resources found)? False when unknown: the placement
    bound then lasts until the actor is ready."""
    try:
        from ray._private import state  # no public call tells placement apart from __init__ running

        info = state.actors(actor._actor_id.hex())
        return bool(info.get("Pid")) or info.get("State") == "ALIVE"
    except Exception:  # noqa: BLE001 - a Ray without this table: fall back to readiness
        return False


def _actor_node(actor) -> str:
    """The node ``actor`` ran on, from Ray's actor table; "" when unknown."""
    try:
        from ray._private import state

        address = state.actors(actor._actor_id.hex()).get("Address") or {}
        return node_label(address["IPAddress"], address["NodeID"]) if address.get("NodeID") else ""
    except Exception:  # noqa: BLE001 - a Ray without this table, or the actor forgotten
        return ""


def _kill(actor) -> None:
    if actor is None:
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _rows(unit) -> int:
    """Rows of a work item: a Unit's ``num_rows``, an index Part's ``rows``."""
    return getattr(unit, "num_rows", None) or getattr(unit, "rows", 1)
