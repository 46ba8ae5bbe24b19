"""Graph cache policy (through a fake backend and the CPU stand-in); the CUDA backend when there is one."""

from __future__ import annotations

import pytest
import torch

from embedpipe.runtime.graphs import EagerGraphs, GraphCache

MiB = 2**20


class FakeGraph:
    def __init__(self, backend, key, fn, nbytes):
        self.backend, self.key, self.fn, self.nbytes = backend, key, fn, nbytes

    def replay(self):
        self.backend.log.append(("replay", self.key))
        return self.fn()

    def release(self):
        self.backend.log.append(("release", self.key))


class FakeBackend:
    """Records what the cache asks for; graph sizes come from `sizes` (default 1 MiB)."""

    def __init__(self, sizes=None):
        self.sizes, self.log = sizes or {}, []

    def capture(self, fn, *, warmup_runs):
        key = fn.key
        for _ in range(warmup_runs):
            fn()
        self.log.append(("capture", key))
        return FakeGraph(self, key, fn, self.sizes.get(key, MiB))


def forward(key):
    def fn():
        fn.calls += 1
        return torch.tensor([float(key)])

    fn.key, fn.calls = key, 0
    return fn


def test_first_use_warms_up_then_captures_then_replays():
    backend = FakeBackend()
    cache = GraphCache(backend, max_graphs=4, max_bytes=64 * MiB, warmup_runs=2)
    fn = forward(1)
    assert cache.run(1, fn).item() == 1.0
    assert fn.calls == 3  # two eager warmups + the first replay
    assert backend.log == [("capture", 1), ("replay", 1)]
    cache.run(1, forward(1))
    assert backend.log[-1] == ("replay", 1) and cache.stats.captures == 1 and cache.stats.replays == 2


def test_count_cap_releases_the_least_recently_used():
    backend = FakeBackend()
    cache = GraphCache(backend, max_graphs=2, max_bytes=64 * MiB)
    for key in (1, 2, 1, 3):  # 1 was used after 2: 2 is the one to go
        cache.run(key, forward(key))
    assert list(cache.graphs) == [1, 3]
    assert ("release", 2) in backend.log and cache.stats.evictions == 1


def test_memory_cap_releases_until_the_new_graph_fits():
    backend = FakeBackend(sizes={1: 3 * MiB, 2: 3 * MiB, 3: 5 * MiB})
    cache = GraphCache(backend, max_graphs=10, max_bytes=8 * MiB)
    cache.run(1, forward(1))
    cache.run(2, forward(2))
    cache.run(3, forward(3))  # 6 + 5 > 8: release 1 -> 3 + 5 fits
    assert list(cache.graphs) == [2, 3] and cache.nbytes == 8 * MiB


def test_a_graph_larger_than_the_cap_runs_eagerly_for_good():
    backend = FakeBackend(sizes={9: 100 * MiB})
    cache = GraphCache(backend, max_graphs=10, max_bytes=8 * MiB)
    cache.run(1, forward(1))
    fn = forward(9)
    assert cache.run(9, fn).item() == 9.0
    assert ("release", 9) in backend.log and 9 not in cache.graphs and list(cache.graphs) == [1]
    fn2 = forward(9)
    cache.run(9, fn2)
    assert fn2.calls == 1 and backend.log.count(("capture", 9)) == 1  # never captured again
    assert cache.stats.eager_runs == 2


def test_zero_graphs_means_eager():
    backend = FakeBackend()
    cache = GraphCache(backend, max_graphs=0, max_bytes=8 * MiB)
    assert cache.run(1, forward(1)).item() == 1.0 and backend.log == [] and cache.stats.eager_runs == 1


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="warmup_runs"):
        GraphCache(FakeBackend(), max_graphs=1, max_bytes=1, warmup_runs=0)


def test_stand_in_output_is_static_like_a_cuda_graph():
    """Each replay overwrites the same output tensor: callers must copy before the next replay."""
    x = torch.zeros(3)
    cache = GraphCache(EagerGraphs(), max_graphs=2, max_bytes=MiB)
    fn = lambda: x * 2  # noqa: E731  reads the "static input" x
    x.fill_(1.0)
    first = cache.run("k", fn)
    kept = first.clone()
    x.fill_(5.0)
    second = cache.run("k", fn)
    assert second.data_ptr() == first.data_ptr()  # same buffer
    assert first.tolist() == [10.0] * 3 and kept.tolist() == [2.0] * 3
    assert cache.nbytes == 3 * 4


def sized(mib):
    """A forward whose output stands for a graph of `mib` MiB (EagerGraphs sizes a graph by its output)."""
    return lambda: torch.zeros(mib)


def mib_of_output(out):
    return out.numel() * MiB


class Handles:
    """An injected pool-handle factory: counts the pools made."""

    def __init__(self):
        self.made = []

    def __call__(self):
        self.made.append(f"pool-{len(self.made)}")
        return self.made[-1]


def test_graphs_share_one_pool_that_holds_about_the_largest_graph():
    """Private pools: 3 + 5 + 2 MiB > 8 MiB evicts; one shared pool holds max(3, 5, 2) = 5 MiB for all three."""
    private = GraphCache(EagerGraphs(mib_of_output), max_graphs=10, max_bytes=8 * MiB)
    for mib in (3, 5, 2):
        private.run(mib, sized(mib))
    assert list(private.graphs) == [5, 2] and private.nbytes == 7 * MiB and private.stats.evictions == 1

    handles = Handles()
    backend = EagerGraphs(mib_of_output, shared_pool=True, new_pool=handles)
    shared = GraphCache(backend, max_graphs=10, max_bytes=8 * MiB)
    for mib in (3, 5, 2):
        assert shared.run(mib, sized(mib)).numel() == mib
    assert list(shared.graphs) == [3, 5, 2] and shared.stats.evictions == 0
    assert shared.nbytes == backend.pool_bytes == 5 * MiB  # the pool, not the sum (10 MiB)
    assert handles.made == ["pool-0"] and backend.pools == ["pool-0"] * 3  # every capture into the one pool


def test_shared_pool_count_cap_evicts_but_the_pool_keeps_its_size():
    backend = EagerGraphs(mib_of_output, shared_pool=True, new_pool=Handles())
    cache = GraphCache(backend, max_graphs=2, max_bytes=8 * MiB)
    for mib in (4, 2, 3):
        cache.run(mib, sized(mib))
    assert list(cache.graphs) == [2, 3] and cache.stats.evictions == 1
    assert cache.nbytes == 4 * MiB  # released blocks stay in the pool for the others


def test_a_capture_that_grows_the_shared_pool_past_the_cap_gives_the_pool_back():
    handles = Handles()
    backend = EagerGraphs(mib_of_output, shared_pool=True, new_pool=handles)
    cache = GraphCache(backend, max_graphs=10, max_bytes=8 * MiB)
    cache.run(3, sized(3))
    cache.run(5, sized(5))
    assert cache.run(12, sized(12)).numel() == 12  # the pool would hold 12 MiB > 8: eager, and every graph goes
    assert list(cache.graphs) == [] and cache.nbytes == 0 and handles.made == ["pool-0", "pool-1"]
    assert 12 in cache.eager_keys and cache.stats.eager_runs == 1
    cache.run(12, sized(12))
    assert cache.stats.captures == 3 and cache.stats.eager_runs == 2  # never captured again
    cache.run(5, sized(5))  # recaptured into the fresh pool on its next use
    assert list(cache.graphs) == [5] and cache.nbytes == 5 * MiB and backend.pools[-1] == "pool-1"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_capture_replay_and_release():
    from embedpipe.runtime.graphs import CudaGraphs

    x = torch.zeros(1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    cache = GraphCache(CudaGraphs("cuda"), max_graphs=1, max_bytes=1 << 30)
    fn = lambda: (x @ w).relu()  # noqa: E731
    x.normal_()
    out = cache.run("a", fn)
    torch.testing.assert_close(out, fn(), rtol=0, atol=0)  # replay == eager, same inputs, bit for bit
    x.normal_()
    torch.testing.assert_close(cache.run("a", fn), fn(), rtol=0, atol=0)
    assert cache.graphs["a"].nbytes > 0
    cache.run("b", lambda: x * 2)  # count cap 1: "a" is released
    assert list(cache.graphs) == ["b"] and cache.stats.evictions == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_share_one_pool():
    from embedpipe.runtime.graphs import CudaGraphs

    x = torch.zeros(4096, device="cuda")
    w = torch.randn(4096, 4096, device="cuda")
    backend = CudaGraphs("cuda")
    cache = GraphCache(backend, max_graphs=8, max_bytes=1 << 30)
    outs = [cache.run(i, lambda i=i: ((x @ w).relu() * (i + 1)).sum(0, keepdim=True)) for i in range(4)]
    assert cache.nbytes == backend.pool_bytes > 0
    assert cache.nbytes < 4 * max(g.nbytes for g in cache.graphs.values())  # not one pool per graph
    x.normal_()
    for i in range(4):  # each output copied out before the next replay, as the runner does
        got = cache.run(i, lambda: None).clone()
        torch.testing.assert_close(got, ((x @ w).relu() * (i + 1)).sum(0, keepdim=True))
    assert len(outs) == 4

