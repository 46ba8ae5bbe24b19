"""The driver's progress bar keeps every other line of a run off its own line: the lines Ray forwards from workers
(``log_to_driver``, printed by Ray's thread on the driver's sys.stdout or sys.stderr) and embedpipe's log lines."""

from __future__ import annotations

import io
import logging
import re
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from embedpipe.cluster.progress import LinesAboveTheBar, progress_bar

ANSI = re.compile(r"\x1b\[[0-9;]*m")
BAR = re.compile(r"quickstart: +\d+%")


def _pieces(terminal: io.StringIO) -> list[str]:
    """What a terminal shows, line by line: \\r goes back to the line's start, so each piece is drawn over the last."""
    return [ANSI.sub("", piece) for piece in re.split(r"[\r\n]", terminal.getvalue())]


def _wait_for(terminal: io.StringIO, *texts: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(text in terminal.getvalue() for text in texts):
        assert time.monotonic() < deadline, f"Ray did not forward {texts}: {terminal.getvalue()!r}"
        time.sleep(0.05)


@contextmanager
def _terminal() -> Iterator[io.StringIO]:
    """stdout and stderr on one screen, as in a terminal (set inside the test: pytest sets its own capture streams
    again between a fixture's setup and the test's call)."""
    out, err = sys.stdout, sys.stderr
    screen = io.StringIO()
    sys.stdout = sys.stderr = screen
    try:
        yield screen
    finally:
        sys.stdout, sys.stderr = out, err


def test_lines_ray_forwards_from_a_worker_are_written_above_the_bar(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    def speak() -> None:
        # digit-free texts: Ray's log dedup compares lines with their digits dropped, and would hide a repeat
        print("progress test: a worker's own line on stdout")
        print("progress test: a worker's own line on stderr", file=sys.stderr)

    with _terminal() as terminal:
        with progress_bar(total=3, desc="quickstart", enabled=True) as bar:
            bar.update(1)
            ray.get(speak.remote())
            _wait_for(terminal, "own line on stdout", "own line on stderr")
            bar.update(2)
        assert sys.stdout is terminal and sys.stderr is terminal  # given back
    pieces = _pieces(terminal)
    for stream in ("stdout", "stderr"):
        line = next(p for p in pieces if f"own line on {stream}" in p)
        assert line.startswith("(speak pid="), pieces  # a line of its own, not after the bar's text
    assert any(BAR.match(p) and "3/3" in p for p in pieces), pieces  # the bar is drawn again, and finishes


@contextmanager
def _handler_on(handler: logging.StreamHandler, stream: io.StringIO) -> Iterator[None]:
    """Ray's driver-side log handler writes to the stderr of ``import ray``: in a CLI run, the terminal's."""
    before = handler.setStream(stream)
    try:
        yield
    finally:
        handler.setStream(before)


def test_log_lines_and_partial_writes_keep_off_the_bar(ray_session):
    from embedpipe.cli import _logging

    _logging(verbose=0, quiet=False)
    ray_handler = next(h for h in logging.getLogger("ray").handlers if type(h).__name__ == "PlainRayHandler")
    with _terminal() as terminal, _handler_on(ray_handler, terminal), \
            progress_bar(total=3, desc="quickstart", enabled=True) as bar:
        bar.update(1)
        logging.getLogger("embedpipe.cluster.scheduler").warning("a warning from the scheduler")
        logging.getLogger("ray").error("an error from Ray's own driver-side logger")
        sys.stderr.write("a line written ")  # in two calls, as print writes the text and then its newline
        bar.update(1)
        sys.stderr.write("in two calls\n")
        sys.stderr.write("no newline before the bar closes")
    pieces = _pieces(terminal)
    assert "a warning from the scheduler" in pieces, pieces
    assert any(p.endswith("an error from Ray's own driver-side logger") and not BAR.match(p) for p in pieces), pieces
    assert "a line written in two calls" in pieces, pieces
    assert "no newline before the bar closes" in pieces, pieces


def test_a_hidden_bar_leaves_the_streams_alone():
    with _terminal() as terminal, progress_bar(total=3, desc="quickstart", enabled=False):
        assert sys.stdout is terminal and sys.stderr is terminal
    assert terminal.getvalue() == ""


def test_the_stream_answers_as_its_own_for_what_it_does_not_write():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    from tqdm import tqdm

    with tqdm(total=1, file=io.StringIO()) as bar:
        stream = LinesAboveTheBar(Tty(), bar=bar)
        assert stream.isatty() and stream.encoding is None and stream.write("x") == 1
