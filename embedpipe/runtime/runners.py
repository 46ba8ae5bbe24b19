"""Runners: how a packed batch reaches the model and its vectors come back. Chosen once per encoder.

    runner.submit(batch) -> LazyResult        vectors [B, D] float32, materialised by .get()

  EagerRunner    CPU: model + head on the batch as it is, synchronous.
  DeviceRunner   GPU: batch -> pinned int32 slot -> one non-blocking copy into a static device
                 buffer -> forward (bucketed shape, replayed CUDA graph) -> non-blocking copy of
                 the real rows into pinned memory -> event. `submit` returns before the GPU has
                 finished; the host is at most `inflight` batches ahead.
                 With graphs off it runs eagerly on the batch's exact shape (no padding).
                 The same class runs on CPU with `EagerGraphs` and host events (tests, smoke runs).
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from embedpipe.config import BatchingConfig, RuntimeConfig
from embedpipe.runtime.buckets import PAD_ID, Bucketer, Shape, exact_shape, fill_inputs
from embedpipe.runtime.graphs import CudaGraphs, GraphCache
from embedpipe.runtime.staging import Event, HostEvent, LazyResult, StagingRing
from embedpipe.text.packer import Batch

log = logging.getLogger(__name__)


class Runner(Protocol):
    name: str

    def submit(self, batch: Batch) -> LazyResult: ...


class EagerRunner:
    """The model as written, one batch at a time; also the fp32 reference of the warmup guard.

    ``rows_for``: the rows the model's linears compute for T tokens (runtime/cpu.py padded_rows, where oneDNN's
    linears pad their inputs to few shapes). The pack then enters the model padded to that many rows once
    (token id PAD_ID at position 0, outside every sequence of cu_seqlens), so no linear copies its input to pad it;
    the attention backend must accept such rows (kernels.attention PADDED_ROWS). None: the pack as it is."""

    name = "eager"

    def __init__(self, model: nn.Module, head: nn.Module, *, device: str | torch.device,
                 rows_for: Callable[[int], int] | None = None):
        self.model, self.head, self.device = model, head, torch.device(device)
        self.rows_for = rows_for

    @torch.inference_mode()
    def forward(self, batch: Batch) -> Tensor:
        """[B, D] float32 on the device."""
        dev = self.device
        cu = batch.cu_seqlens.to(dev, non_blocking=True)
        ids, positions = batch.input_ids, batch.positions  # [T], [T]
        T = ids.numel()
        extra = self.rows_for(T) - T if self.rows_for is not None else 0
        if extra > 0:  # [rows]: the padding rows belong to no sequence; the head never reads them
            ids, positions = F.pad(ids, (0, extra), value=PAD_ID), F.pad(positions, (0, extra))
        hidden = self.model(ids.to(dev, non_blocking=True), positions.to(dev, non_blocking=True),
                            cu, batch.max_seqlen)  # [rows, H]
        return self.head(hidden[:T], cu)  # [B, D]

    def submit(self, batch: Batch) -> LazyResult:
        # a copy outside inference mode: callers may edit the result in place
        value = self.forward(batch).to("cpu", torch.float32, copy=True)  # [B, D]
        return LazyResult.ready(value, computed_tokens=batch.num_tokens)


class DeviceRunner:
    """Static device input buffer + staging ring + optional buckets and graph cache (see module doc)."""

    def __init__(self, model: nn.Module, head: nn.Module, *, device: str | torch.device, bucketer: Bucketer,
                 bucketed: bool, graphs: GraphCache | None, inflight: int = 4, pin: bool | None = None,
                 event_factory: Callable[[], Event] | None = None):
        if graphs is not None and not bucketed:
            raise ValueError("graphs need bucketed shapes: with exact shapes every batch would be a new capture")
        self.model, self.head, self.device = model, head, torch.device(device)
        on_cuda = self.device.type == "cuda"
        self.bucketer, self.bucketed, self.graphs = bucketer, bucketed, graphs
        size = bucketer.largest.flat_size
        self.inputs = torch.zeros(size, dtype=torch.int32, device=self.device)  # static: graphs read views of it
        self.ring = StagingRing(slots=inflight, input_size=size, pin=on_cuda if pin is None else pin,
                                event_factory=event_factory or (torch.cuda.Event if on_cuda else HostEvent))
        self.name = "graphed" if graphs is not None else "bucketed" if bucketed else "staged"

    def shape(self, batch: Batch) -> Shape:
        if self.bucketed:
            return self.bucketer.shape(num_tokens=batch.num_tokens, num_seqs=batch.num_seqs,
                                       max_seqlen=batch.max_seqlen)
        shape = exact_shape(batch)
        if shape.flat_size > self.inputs.numel():
            raise ValueError(f"batch {shape} is larger than the staging buffer ({self.inputs.numel()} int32); "
                             f"the packer's max_tokens must not exceed the largest of batching.buckets")
        return shape

    def forward_fn(self, shape: Shape) -> Callable[[], Tensor]:
        """The whole model on the static input views of `shape`: () -> [seqs, D] float32."""
        T, B, L = shape.tokens, shape.seqs, shape.seqlen
        ids, pos, cu = self.inputs[:T], self.inputs[T:2 * T], self.inputs[2 * T:2 * T + B + 1]  # [T], [T], [B+1]
        model, head, pad_row = self.model, self.head, self.bucketed

        def forward() -> Tensor:
            hidden = model(ids.long(), pos.long(), cu, L)  # [T, H]
            if pad_row:  # empty trailing sequences start at T: give CLS pooling a row to read there
                hidden = F.pad(hidden, (0, 0, 0, 1))  # [T+1, H]
            return head(hidden, cu)  # [B, D] float32

        return forward

    @torch.inference_mode()
    def submit(self, batch: Batch) -> LazyResult:
        shape = self.shape(batch)
        slot = self.ring.next_slot()
        fill_inputs(slot.inputs_np, batch, shape)  # host work, overlapping earlier batches on the device
        n = shape.flat_size
        self.inputs[:n].copy_(slot.inputs[:n], non_blocking=True)
        fn = self.forward_fn(shape)
        out = self.graphs.run(shape, fn) if self.graphs is not None else fn()  # [seqs, D]
        rows = batch.num_seqs  # the dummy and empty sequences' rows are dropped here
        slot.output(rows, out.shape[1]).copy_(out[:rows], non_blocking=True)
        return slot.finish(rows, computed_tokens=shape.tokens)


def build_runner(model: nn.Module, head: nn.Module, *, device: str, max_seq_len: int, batching: BatchingConfig,
                 runtime: RuntimeConfig, rows_for: Callable[[int], int] | None = None) -> EagerRunner | DeviceRunner:
    """CPU: eager (``rows_for``: see EagerRunner). CUDA: staged, and bucketed (`batching.buckets`) + graphed unless
    `runtime.cuda_graphs` is off."""
    if torch.device(device).type != "cuda":
        runner: EagerRunner | DeviceRunner = EagerRunner(model, head, device=device, rows_for=rows_for)
    else:
        bucketer = Bucketer(max_tokens=batching.max_tokens, max_seq_len=max_seq_len, token_buckets=batching.buckets)
        graphs = None
        if runtime.cuda_graphs:
            graphs = GraphCache(CudaGraphs(device), max_graphs=runtime.max_graphs,
                                max_bytes=runtime.graph_memory_mb * 2**20)
        runner = DeviceRunner(model, head, device=device, bucketer=bucketer, bucketed=runtime.cuda_graphs,
                              graphs=graphs)
    log.info("runner: %s on %s", runner.name, device)
    return runner
