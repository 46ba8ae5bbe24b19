"""Whole-model graphs per bucket shape: a cache with a count cap and a memory cap, LRU eviction.

    cache.run(shape, fn) -> output [seqs, D]     fn() reads the runner's static input buffer

The first time a shape is seen, the backend runs `fn` eagerly `warmup_runs` times, captures it
and replays it; afterwards every batch of that shape is one replay. The output tensor is
static: the next replay of the same graph overwrites it, so the caller copies it out (on the
same stream) before that. All the policy lives in `GraphCache`; backends only capture.

Memory. On CUDA every graph is captured into ONE memory pool (`torch.cuda.graph_pool_handle()`,
as vLLM captures its batch sizes): a graph's intermediates are freed at the end of its capture, so
the next capture reuses those blocks and the pool grows to about the largest graph, not the sum.
That is safe because replays are serialized on one stream and each replay's output is copied out
(enqueued right behind it, on the same stream) before any other graph replays; outputs stay alive
while their graph is cached, so no capture reuses them. The cache then counts the pool:
`nbytes` is the pool's size (the growth of reserved memory over all captures since it was made),
the memory cap applies to it, and releasing one graph frees no memory (its blocks stay in the
pool for the others). A capture that leaves the pool above the memory cap marks its shape eager
for good and releases every graph so the pool itself goes back to the device (the other shapes
are captured again into a fresh pool on their next use). The count cap releases the least
recently used graph. Backends whose graphs each own their memory (`pool_bytes` None) are counted
by the sum of their graphs, as before: a graph alone larger than the cap runs eagerly, otherwise
least recently used graphs are released until both caps hold.

  CudaGraphs       torch.cuda.CUDAGraph; one shared pool (default) or a private pool per graph
                   (`shared_pool=False`); memory measured as the growth of reserved memory during capture
  EagerGraphs      CPU stand-in with the same contract: "capture" runs the warmups and keeps `fn`;
                   "replay" recomputes into one static output tensor; `shared_pool=True` models the
                   shared pool (it grows to the largest graph) with an injectable pool handle
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

import torch
from torch import Tensor

log = logging.getLogger(__name__)

Forward = Callable[[], Tensor]


class Graph(Protocol):
    nbytes: int  # device memory the graph holds (its pool and static output)

    def replay(self) -> Tensor:
        """Run the captured work; returns the static output (overwritten by the next replay)."""

    def release(self) -> None:
        """Free the graph and its memory."""


class GraphBackend(Protocol):
    # bytes of the one pool every graph is captured into; None: each graph owns its memory (its nbytes)
    pool_bytes: int | None

    def capture(self, fn: Forward, *, warmup_runs: int) -> Graph: ...

    def reset_pool(self) -> None:
        """Once no graph is left: drop the shared pool (its memory goes back) and start a fresh one."""


class SharedPool:
    """The one graph memory pool of a backend: its handle (from `new_handle`, e.g.
    torch.cuda.graph_pool_handle) and its size, the sum of what captures into it added."""

    def __init__(self, new_handle: Callable[[], object]):
        self.new_handle = new_handle
        self.handle, self.nbytes = new_handle(), 0

    def grew(self, nbytes: int) -> None:
        self.nbytes += max(0, nbytes)

    def reset(self) -> None:
        self.handle, self.nbytes = self.new_handle(), 0


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    eager_runs: int = 0  # shapes whose graph would not fit the memory cap


class GraphCache:
    """Built once per runner; `run(key, fn)` replays the key's graph, capturing it on first use."""

    def __init__(self, backend: GraphBackend, *, max_graphs: int, max_bytes: int, warmup_runs: int = 2):
        if max_graphs < 0 or max_bytes < 0 or warmup_runs < 1:
            raise ValueError(f"max_graphs={max_graphs} and max_bytes={max_bytes} must be >= 0, "
                             f"warmup_runs={warmup_runs} >= 1")
        self.backend, self.max_graphs, self.max_bytes, self.warmup_runs = backend, max_graphs, max_bytes, warmup_runs
        self.graphs: OrderedDict[Hashable, Graph] = OrderedDict()  # least recently used first
        self.eager_keys: set[Hashable] = set()
        self.stats = GraphStats()

    @property
    def shared(self) -> bool:
        return getattr(self.backend, "pool_bytes", None) is not None

    @property
    def nbytes(self) -> int:
        """Device memory the cached graphs hold: the shared pool's size, else the sum of the graphs'."""
        if self.shared:
            return self.backend.pool_bytes
        return sum(g.nbytes for g in self.graphs.values())

    def run(self, key: Hashable, fn: Forward) -> Tensor:
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            self.stats.replays += 1
            return graph.replay()
        if key in self.eager_keys or self.max_graphs == 0:
            self.stats.eager_runs += 1
            return fn()
        graph = self.backend.capture(fn, warmup_runs=self.warmup_runs)
        self.stats.captures += 1
        if (self.nbytes if self.shared else graph.nbytes) > self.max_bytes:
            return self._too_large(key, graph, fn)
        while self.graphs and (len(self.graphs) >= self.max_graphs
                               or (not self.shared and self.nbytes + graph.nbytes > self.max_bytes)):
            self._evict()
        self.graphs[key] = graph
        self.stats.replays += 1
        return graph.replay()

    def _too_large(self, key: Hashable, graph: Graph, fn: Forward) -> Tensor:
        """The new graph does not fit the memory cap: its shape runs eagerly from now on."""
        held = self.nbytes
        graph.release()
        self.eager_keys.add(key)
        if self.shared:  # the pool grew past the cap: hand all of it back, the others recapture on next use
            for old in self.graphs.values():
                old.release()
            self.graphs.clear()
            self.backend.reset_pool()
        log.warning("graph for %s: %s %.0f MiB, over the cap of %.0f MiB (runtime.graph_memory_mb): this shape "
                    "runs eagerly", key, "the shared pool would hold" if self.shared else "it holds",
                    held / 2**20, self.max_bytes / 2**20)
        self.stats.eager_runs += 1
        return fn()

    def _evict(self) -> None:
        key, old = self.graphs.popitem(last=False)
        old.release()
        self.stats.evictions += 1
        if self.stats.evictions in (1, 4 * max(1, self.max_graphs)):
            log.warning("released the graph for %s (cache full: %d graphs, %.0f MiB); if this repeats, raise "
                        "runtime.max_graphs / runtime.graph_memory_mb or use fewer batching.buckets",
                        key, self.max_graphs, self.max_bytes / 2**20)


# --------------------------------------------------------------------------- CUDA


class _CudaGraph:
    def __init__(self, graph, output: Tensor, nbytes: int):
        self.graph, self.output, self.nbytes = graph, output, nbytes

    def replay(self) -> Tensor:
        self.graph.replay()
        return self.output

    def release(self) -> None:
        self.graph.reset()
        self.graph = self.output = None
        torch.cuda.empty_cache()  # a private pool goes back to the device; a shared one keeps its blocks


class CudaGraphs:
    """Captures on CUDA. Warmups run on one side stream (as torch recommends before capture);
    capture errors only on this thread's unsafe calls, so the prefetch thread may keep working.
    ``shared_pool`` (default): every graph in one pool (see the module doc); ``new_pool``: where pool
    handles come from (torch.cuda.graph_pool_handle)."""

    def __init__(self, device: torch.device | str, *, shared_pool: bool = True,
                 new_pool: Callable[[], object] | None = None):
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(self.device)
        self.pool = SharedPool(new_pool or torch.cuda.graph_pool_handle) if shared_pool else None

    @property
    def pool_bytes(self) -> int | None:
        return None if self.pool is None else self.pool.nbytes

    def capture(self, fn: Forward, *, warmup_runs: int) -> _CudaGraph:
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            for _ in range(warmup_runs):
                fn()
        main.wait_stream(self.side)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # as torch.cuda.graph does on entry, but before measuring
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        pool = None if self.pool is None else self.pool.handle
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            output = fn()
        grown = torch.cuda.memory_reserved(self.device) - before
        if self.pool is not None:
            self.pool.grew(grown)
        return _CudaGraph(graph, output, grown)

    def reset_pool(self) -> None:
        if self.pool is not None:
            self.pool.reset()
            torch.cuda.empty_cache()  # the old pool's blocks, now unreferenced

    def __repr__(self) -> str:
        return f"CudaGraphs({self.device}, shared_pool={self.pool is not None})"


# --------------------------------------------------------------------------- CPU stand-in


class _EagerGraph:
    def __init__(self, fn: Forward, output: Tensor, nbytes: int):
        self.fn, self.output, self.nbytes = fn, output, nbytes

    def replay(self) -> Tensor:
        return self.output.copy_(self.fn())  # static output, overwritten by the next replay, as on CUDA

    def release(self) -> None:
        self.fn = self.output = None


class EagerGraphs:
    """CPU stand-in for CudaGraphs: same contract, no capture. `nbytes(output)` sizes a graph
    (default: its output tensor), so tests can exercise the memory cap. ``shared_pool``: model the
    shared pool: a capture grows it only by what the graph needs beyond the pool's size (the caching
    allocator reuses the blocks earlier captures freed), so it holds about the largest graph;
    ``new_pool`` makes its handles (default: a fresh object)."""

    def __init__(self, nbytes: Callable[[Tensor], int] | None = None, *, shared_pool: bool = False,
                 new_pool: Callable[[], object] | None = None):
        self.size = nbytes or (lambda out: out.numel() * out.element_size())
        self.pool = SharedPool(new_pool or object) if shared_pool else None
        self.pools: list[object] = []  # the pool handle of each capture, in order (for tests)

    @property
    def pool_bytes(self) -> int | None:
        return None if self.pool is None else self.pool.nbytes

    def capture(self, fn: Forward, *, warmup_runs: int) -> _EagerGraph:
        for _ in range(warmup_runs):
            fn()
        output = fn().clone()
        need = self.size(output)
        if self.pool is None:
            return _EagerGraph(fn, output, need)
        grown = max(0, need - self.pool.nbytes)
        self.pool.grew(grown)
        self.pools.append(self.pool.handle)
        return _EagerGraph(fn, output, grown)

    def reset_pool(self) -> None:
        if self.pool is not None:
            self.pool.reset()

    def __repr__(self) -> str:
        return f"EagerGraphs(shared_pool={self.pool is not None})"
