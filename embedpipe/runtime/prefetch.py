"""Host pipeline: run CPU work (tokenize, pack) on a background thread, a bounded number of items ahead.

    with Prefetcher(chunks, prepare, depth=2) as ready:
        for item in ready:          # prepare(chunk) results, in input order
            launch(item)            # the thread is already preparing the next ones

Results come back in input order. At most `depth` results wait in the queue, so a slow
consumer holds the producer back (and bounds host memory). An exception in `prepare` is raised
in the consumer at the item where it happened; leaving the `with` block early stops the thread.
The thread does no CUDA work, so it never disturbs a graph capture on the consumer's thread.
Tokenizers (Rust) and numpy release the GIL, so the overlap is real.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, Iterable, Iterator, TypeVar

A = TypeVar("A")
R = TypeVar("R")

_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[A, R]):
    def __init__(self, items: Iterable[A], prepare: Callable[[A], R], *, depth: int = 2,
                 name: str = "embedpipe-prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(iter(items), prepare), name=name, daemon=True)
        self._thread.start()

    def _produce(self, items: Iterator[A], prepare: Callable[[A], R]) -> None:
        try:
            for item in items:
                if self._stop.is_set():
                    return
                if not self._put(prepare(item)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failed(e))
            return
        self._put(_END)

    def _put(self, value) -> bool:
        """Blocking put that gives up when the consumer has stopped."""
        while not self._stop.is_set():
            try:
                self._queue.put(value, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[R]:
        while True:
            value = self._queue.get()
            if value is _END:
                return
            if isinstance(value, _Failed):
                raise value.error
            yield value

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "Prefetcher[A, R]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
