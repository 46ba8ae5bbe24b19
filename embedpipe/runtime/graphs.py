"""Whole-model graphs per bucket shape: a cache with a count cap and a memory cap, LRU eviction.

    cache.run(shape, fn) -> output [seqs, D]     fn() reads the runner's static input buffer

The first time a shape is seen, the backend runs `fn` eagerly `warmup_runs` times, captures it
and replays it; afterwards every batch of that shape is one replay. The output tensor is
static: the next replay of the same graph overwrites it, so the caller copies it out (on the
same stream) before that. A graph that alone is larger than the memory cap is released and its
shape runs eagerly from then on; otherwise least recently used graphs are released until both
caps hold. All the policy lives in `GraphCache`; backends only capture:

  CudaGraphs       torch.cuda.CUDAGraph, one private memory pool per graph (so releasing a
                   graph frees its memory), memory measured as the growth of reserved memory
                   during capture
  EagerGraphs      CPU stand-in with the same contract: "capture" runs the warmups and keeps
                   `fn`; "replay" recomputes into one static output tensor
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
    def capture(self, fn: Forward, *, warmup_runs: int) -> Graph: ...


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
    def nbytes(self) -> int:
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
        if graph.nbytes > self.max_bytes:
            graph.release()
            self.eager_keys.add(key)
            log.warning("graph for %s holds %.0f MiB, over the cap of %.0f MiB (runtime.graph_memory_mb): "
                        "this shape runs eagerly", key, graph.nbytes / 2**20, self.max_bytes / 2**20)
            self.stats.eager_runs += 1
            return fn()
        while self.graphs and (len(self.graphs) >= self.max_graphs or self.nbytes + graph.nbytes > self.max_bytes):
            self._evict()
        self.graphs[key] = graph
        self.stats.replays += 1
        return graph.replay()

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
        torch.cuda.empty_cache()  # hand the private pool back to the device


class CudaGraphs:
    """Captures on CUDA. Warmups run on one side stream (as torch recommends before capture);
    capture errors only on this thread's unsafe calls, so the prefetch thread may keep working."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(self.device)

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
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = fn()
        return _CudaGraph(graph, output, torch.cuda.memory_reserved(self.device) - before)

    def __repr__(self) -> str:
        return f"CudaGraphs({self.device})"


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
    (default: its output tensor), so tests can exercise the memory cap."""

    def __init__(self, nbytes: Callable[[Tensor], int] | None = None):
        self.size = nbytes or (lambda out: out.numel() * out.element_size())

    def capture(self, fn: Forward, *, warmup_runs: int) -> _EagerGraph:
        for _ in range(warmup_runs):
            fn()
        output = fn().clone()
        return _EagerGraph(fn, output, self.size(output))

    def __repr__(self) -> str:
        return "EagerGraphs()"
