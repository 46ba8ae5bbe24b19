"""The driver's progress bar, with every other line of the run above it.

Ray prints its workers' forwarded lines (``(EmbedWorker pid=N) …``, ``log_to_driver``) on the driver's
``sys.stdout`` and ``sys.stderr`` from a thread of its own, looking the stream up for each batch; its driver-side
logger writes to the stderr its handler was made with, at ``import ray``. A plain write lands on the bar's line, after
its text. While the bar is shown, both names, and every log handler that writes to either stream, hold a stream that
writes whole lines above the bar: it clears the bar, writes, and draws it again. embedpipe's own log lines (cli.py's
handler writes to sys.stderr as it is at each line) take the same way.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Iterator, TextIO

from tqdm.auto import tqdm


class LinesAboveTheBar:
    """A text stream that writes whole lines to ``stream`` above ``bar`` (and any bar drawn on the same stream).

    A line is written once its newline arrives (``print`` writes the text and the newline in two calls; the bar drawn
    between them would end up inside the line); what is left without one is written by ``close_line``.
    """

    def __init__(self, stream: TextIO, *, bar: tqdm) -> None:
        self._stream, self._bar, self._pending = stream, bar, ""

    def write(self, text: str) -> int:
        with type(self._bar).get_lock():  # reentrant: tqdm.write to this stream comes through here holding it
            head, newline, self._pending = (self._pending + text).rpartition("\n")
            if newline:
                self._above(head + newline)
        return len(text)

    def close_line(self) -> None:
        with type(self._bar).get_lock():
            pending, self._pending = self._pending, ""
            if pending:
                self._above(pending + "\n")

    def flush(self) -> None:
        self._stream.flush()  # a line still without its newline stays pending: it would land on the bar

    def _above(self, lines: str) -> None:
        # the bar's class: tqdm keeps its instances and lock on the first class that made one
        with type(self._bar).external_write_mode(file=self._bar.fp, nolock=True):  # clears the bars, redraws after
            self._stream.write(lines)
            self._stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding, …: the stream's own
        return getattr(self._stream, name)


def _stream_handlers() -> list[logging.StreamHandler]:
    """Every StreamHandler of every logger made so far, the root's included."""
    loggers = [logging.getLogger(), *(logger for logger in list(logging.Logger.manager.loggerDict.values())
                                      if isinstance(logger, logging.Logger))]
    return [handler for logger in loggers for handler in logger.handlers if isinstance(handler, logging.StreamHandler)]


@contextmanager
def _lines_above(bar: tqdm) -> Iterator[None]:
    """sys.stdout, sys.stderr, and the log handlers that write to either, write their lines above ``bar``."""
    out, err = sys.stdout, sys.stderr
    above = {id(out): LinesAboveTheBar(out, bar=bar), id(err): LinesAboveTheBar(err, bar=bar)}
    handlers = [(h, h.stream) for h in _stream_handlers() if id(h.stream) in above]
    sys.stdout, sys.stderr = above[id(out)], above[id(err)]
    for handler, stream in handlers:
        handler.setStream(above[id(stream)])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
        for handler, stream in handlers:
            handler.setStream(stream)
        for stream in above.values():
            stream.close_line()


@contextmanager
def progress_bar(*, total: int, desc: str, enabled: bool) -> Iterator[tqdm]:
    """A rows bar on stderr; while it is shown, every other line on stdout or stderr is written above it."""
    with tqdm(total=total, unit="rows", disable=not enabled, desc=desc, dynamic_ncols=True, file=sys.stderr) as bar:
        if not enabled:
            yield bar
            return
        with _lines_above(bar):
            yield bar
