"""SIGINT and SIGTERM, the signals that stop a run: a block's own handler for them, and the handlers put back after.

Python sets handlers only on the main thread; elsewhere (a run started from a notebook's worker thread, a test's
thread) every helper here changes nothing.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

Handler = Callable[[int, object], None]


@contextmanager
def handled(handler: Handler, *, ignored_stay: bool = False) -> Iterator[None]:
    """Inside the block, SIGINT and SIGTERM call ``handler(signum, frame)``; after it, their handlers from before
    the block. ``ignored_stay``: a signal ignored when the block begins (SIG_IGN: ``nohup``, a shell's background
    job) stays ignored."""
    if not on_main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS
                if not (ignored_stay and signal.getsignal(signum) is signal.SIG_IGN)}
    try:
        yield
    finally:
        put_back(previous)


@contextmanager
def python_handlers_kept() -> Iterator[None]:
    """Around a call that sets handlers of its own (``ray.init``: SIGTERM to a C++ stack dump and exit): the
    handlers set from Python before it (a run's ``handled``) are put back after it. Handlers nobody set (the
    defaults, Python's own SIGINT handler) are left as the call set them."""
    ours = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield
    if on_main_thread():
        put_back({signum: handler for signum, handler in ours.items()
                  if callable(handler) and handler is not signal.default_int_handler})


def put_back(handlers: dict) -> None:
    """Set each signal's handler again (None, a handler not set from Python: the default)."""
    for signum, handler in handlers.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
