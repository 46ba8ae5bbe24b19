"""SIGINT and SIGTERM handlers swapped for a block and put back (embedpipe/cluster/signals.py), in this process's
main thread (pytest's, or an xdist worker's)."""

import signal
import threading

import pytest

from embedpipe.cluster.signals import STOP_SIGNALS, handled, python_handlers_kept


@pytest.fixture
def restored():
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_a_blocks_handler_gets_the_signal_and_the_one_before_is_back_after_it(restored):
    seen, theirs = [], lambda signum, frame: None
    signal.signal(signal.SIGTERM, theirs)
    with handled(lambda signum, frame: seen.append(signum)):
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
    assert seen == [signal.SIGTERM, signal.SIGINT]
    assert signal.getsignal(signal.SIGTERM) is theirs


def test_an_ignored_signal_stays_ignored_where_asked(restored):
    seen = []
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with handled(lambda signum, frame: seen.append(signum), ignored_stay=True):
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.raise_signal(signal.SIGINT)  # ignored
        signal.raise_signal(signal.SIGTERM)
    assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    with handled(lambda signum, frame: seen.append(signum)):  # a run's own: it takes an ignored one too
        signal.raise_signal(signal.SIGINT)
    assert seen == [signal.SIGTERM, signal.SIGINT] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_handlers_set_from_python_outlive_a_call_that_replaces_them_and_defaults_do_not(restored):
    ours = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGTERM, ours)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with python_handlers_kept():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as ray.init does
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    assert signal.getsignal(signal.SIGTERM) is ours
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # Python's default was not the run's: left as set


def test_off_the_main_thread_nothing_changes(restored):
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    done = []

    def other() -> None:
        with handled(lambda signum, frame: None):
            done.append({signum: signal.getsignal(signum) for signum in STOP_SIGNALS} == before)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert done == [True]
