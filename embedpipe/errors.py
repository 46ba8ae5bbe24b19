"""The error contract: every failure embedpipe reports is one of these kinds, with its exit code.

The bottom layer: imports nothing from embedpipe. Each module's own exception subclasses one kind
(keeping its builtin base too, e.g. ``class InputError(BadInput, ValueError)``), and the CLI maps a
failure to its exit code by type, in one place, printing the message as one line. The codes are a
contract for schedulers (docs/operations.md).
"""

from __future__ import annotations

import re
import signal


class EmbedpipeError(Exception):
    """A failure with a one-line message that names the field or file, the problem and the fix."""

    exit_code = 1

    def line(self) -> str:
        """The message on one line (newlines and runs of spaces folded)."""
        return " ".join(str(self).split())


class BadJob(EmbedpipeError):
    """A job-file field, the model, or an output holding another job's output: fix the job."""

    exit_code = 2


class BadInput(EmbedpipeError):
    """Input that cannot be read or refuses the job's columns and policies: fix the data or the policy."""

    exit_code = 3


class RunError(EmbedpipeError):
    """The run could not finish (units kept killing workers, validation failed): rerun to resume."""

    exit_code = 4


class OutputRefused(EmbedpipeError):
    """The output path is held by a live run, or is not embedpipe's: nothing there was touched."""

    exit_code = 5


class InputError(BadInput, ValueError):
    """The input cannot be read as the job asks: names the file and the fix (also importable from units)."""


class StorageError(InputError):
    """An input URL the remote store (or its fsspec package) cannot serve: names the URL and the fix."""


class Interrupted(KeyboardInterrupt):
    """The run was stopped by SIGINT (Ctrl-C) or SIGTERM; finished units are kept for the rerun.

    A KeyboardInterrupt, not an Exception, so no ``except Exception`` on the way up swallows it; the
    exit code is the shell's convention for the signal: 130 for SIGINT, 143 for SIGTERM.
    """

    def __init__(self, *, signum: int = signal.SIGINT, done: int | None = None, total: int | None = None):
        self.signum, self.done, self.total = int(signum), done, total
        super().__init__(self.line())

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        if self.done is None or self.total is None:
            return "rerun the same command to resume"
        return f"rerun the same command to resume ({self.done} of {self.total} units done)"


# "embedpipe.models.cache.ModelCacheError: " at the head of Ray's text for an error raised in a worker
EMBEDPIPE_TYPE = re.compile(r"^embedpipe(?:\.\w+)+: ")
# What Ray's text for a dead worker says after what happened: a paragraph of advice for any Ray cluster ("Some common
# causes include: (1) the process was killed by the OOM killer …, (2) ray stop --force was called, … consider
# enabling resource isolation via --enable-resource-isolation …", Ray 2.60). The driver's line keeps what happened
# (the exit type and detail) and gives its own advice (cluster/scheduler.py: failure_message).
RAY_DEATH_ADVICE = re.compile(r"\s*Some common causes include:.*", re.S)


def first_line(exc: BaseException) -> str:
    """The line an error's text ends with: the message, after any traceback Ray puts before it."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def remote_message(exc: BaseException) -> str:
    """An error a Ray worker raised, as the driver says it. An embedpipe error in its own words: not Ray's
    traceback, nor the dotted type name Ray's last line starts with (RayTaskError keeps the worker's exception as
    ``cause``; an error without one, such as Ray's ActorDiedError for an actor whose ``__init__`` raised outside
    the scheduler's ``worker_actor``, has its text only). Other errors keep their type's name; a dead worker's, what
    happened without Ray's general advice (``RAY_DEATH_ADVICE``)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, EmbedpipeError):
        return str(cause)
    return RAY_DEATH_ADVICE.sub("", EMBEDPIPE_TYPE.sub("", first_line(exc)))
