"""The job schema: one typed section per component, validated once at load.

A leaf of the package (it imports nothing of embedpipe): the schema and its coercion only.
Checks that span the job and another package (output.dtype against FAISS, the output.index
factory string, model.prompt_name and output.dim against the model) run in
``embedpipe/preflight.py``, with the same field, value and fix.

A job file is YAML with one mapping per section (``input``, ``model``, ``batching``,
``output``, ``cluster``, ``runtime``, ``cost``). Every option and its default lives here, and
``docs/job-reference.md`` is generated from these dataclasses (``python -m embedpipe.config``),
so the docs cannot drift from the code.

Errors name the field, the bad value and the fix:
``job.yaml: model.dtype: 'fp32' is not one of float32, bfloat16, float16, auto (fix: set model.dtype to one of them)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

import yaml

from embedpipe.errors import BadJob

REQUIRED: Any = object()  # sentinel default: the field must be set in the job file


class JobError(BadJob, ValueError):
    """A job file problem: names the field, the bad value and the fix."""

    def __init__(self, field_path: str, problem: str, fix: str, *, source: str = "job"):
        self.field_path, self.problem, self.fix = field_path, problem, fix
        super().__init__(f"{source}: {field_path}: {problem} (fix: {fix})")


def opt(default: Any = REQUIRED, doc: str = "", *, path: bool | Literal["hub", "dataset"] = False) -> Any:
    """A schema field with its documentation.

    ``path=True`` resolves a relative value against the job file's folder; ``path="hub"`` too,
    except that a hub-style name (``name`` or ``org/name``, no glob) that is no local path stays a
    name; ``path="dataset"`` is "hub" when the section's ``format`` is huggingface, else True.
    """
    meta = {"doc": doc, "path": path}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- sections

Dtype = Literal["float32", "bfloat16", "float16", "auto"]


def resolve_dtype(dtype: str, *, device: str) -> str:
    """model.dtype on a device kind ("cpu", "cuda", "cuda:0"): auto is bfloat16 on CUDA, float32 elsewhere."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.split(":")[0] == "cuda" else "float32"


STORAGE_DOC = ("fsspec options for {section}.path's store (`endpoint_url`, `profile`, `anon`, `key`, `secret`, "
               "`client_kwargs`, ...), passed to the driver and every worker on every node; the standard environment "
               "variables (AWS_*, GOOGLE_APPLICATION_CREDENTIALS) apply too. Never written anywhere: job.json, "
               "index.json and the report keep only the names of secret options.")
# storage_options whose values are not secrets: written as given; every other value is written as REDACTED.
PUBLIC_STORAGE_OPTIONS = frozenset({"endpoint_url", "anon", "profile", "region_name", "use_ssl", "requester_pays",
                                    "project", "account_name", "default_block_size", "client_kwargs", "config_kwargs"})
REDACTED = "<redacted>"
Pooling = Literal["auto", "mean", "cls", "last"]
OutputDtype = Literal["float32", "float16", "int8", "uint8", "binary", "ubinary"]


LATE_CHUNK_TOKENS = 512  # input.chunking.max_tokens null in late mode: chunks of this size within the context


@dataclass(frozen=True)
class ChunkingConfig:
    """input.chunking: long documents cut into token spans on the worker (embedpipe/text/chunking.py)."""

    mode: Literal["off", "split", "late"] = opt(
        "off", "off: one vector per row, the text truncated at model.max_seq_len. split: each document cut into chunks "
               "of at most max_tokens tokens, each chunk encoded on its own (one output row per chunk). late: one "
               "forward pass over the whole document (windows of model.max_seq_len with the overlap when longer), "
               "each chunk's vector pooled from its own tokens of that pass.")
    max_tokens: int | None = opt(None, "Tokens per chunk, special tokens and the prompt counted; null: "
                                       "model.max_seq_len (split) or 512 within it (late).")
    overlap: int = opt(0, "Tokens shared by consecutive chunks of a document (exactly this many).")
    boundary_window: int = opt(32, "Tokens before the limit searched for a cut: a sentence end, else a line break, "
                                   "else whitespace (a cut mid-word only when no whitespace is in the window).")

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise JobError("input.chunking.max_tokens", f"{self.max_tokens!r} is not positive",
                           "set input.chunking.max_tokens to a token count such as 256, or null")
        for name in ("overlap", "boundary_window"):
            if getattr(self, name) < 0:
                raise JobError(f"input.chunking.{name}", f"{getattr(self, name)!r} is negative",
                               f"set input.chunking.{name} to 0 or more")
        if self.max_tokens is not None and self.overlap >= self.max_tokens:
            raise JobError("input.chunking.overlap", f"{self.overlap} is not below input.chunking.max_tokens="
                           f"{self.max_tokens}", "lower input.chunking.overlap (e.g. an eighth of max_tokens)")

    def tokens_for(self, *, max_seq_len: int) -> int:
        """max_tokens against a model of ``max_seq_len``: null is max_seq_len (split) or LATE_CHUNK_TOKENS within
        it (late). Above max_seq_len is one line (the driver checks it before any worker starts)."""
        tokens = self.max_tokens or (max_seq_len if self.mode == "split" else min(LATE_CHUNK_TOKENS, max_seq_len))
        if tokens > max_seq_len:
            raise JobError("input.chunking.max_tokens", f"{tokens} exceeds the model's max_seq_len={max_seq_len}",
                           "lower input.chunking.max_tokens, or leave it null")
        return tokens

    def record(self, *, max_seq_len: int) -> dict | None:
        """What embedpipe.json says of a chunked run (max_tokens resolved); None when chunking is off."""
        if self.mode == "off":
            return None
        return {"mode": self.mode, "max_tokens": self.tokens_for(max_seq_len=max_seq_len), "overlap": self.overlap,
                "boundary_window": self.boundary_window}


@dataclass(frozen=True)
class InputConfig:
    path: str = opt(doc="A file, a directory of files or a glob (`data/*.parquet`), local or a URL (`s3://…`, any "
                        "fsspec protocol); huggingface: a `save_to_disk` folder or a dataset name in the local HF cache.",
                    path="dataset")
    format: Literal["auto", "parquet", "jsonl", "csv", "huggingface"] = opt(
        "auto", "auto: a `save_to_disk` folder is huggingface, files go by extension (.parquet, .jsonl/.ndjson, .csv).")
    split: str | None = opt(None, "huggingface: the split of a DatasetDict or cached dataset; null: the only split.")
    text_column: str = opt("text", "Column holding the text to embed.")
    id_column: str = opt("id", "Column holding each row's id; its type is kept in the output, and must be one type "
                               "across all input files.")
    unit_rows: int = opt(10_000, "Most rows per work unit: consecutive Parquet row groups of one file are grouped up to "
                                 "this many rows and a larger row group is cut into row ranges; other formats cut each "
                                 "file every this many rows. With two or more workers a smaller corpus is cut finer, so "
                                 "that each worker gets about 4 units (never below 256 rows a unit).")
    on_bad_row: Literal["error", "skip", "embed_empty"] = opt(
        "error", "A row whose text is null, empty, not text or not valid UTF-8, or whose id is null: error stops the run "
                 "naming the row; skip writes no vector and lists the id in `<output.path>/skipped.parquet`; "
                 "embed_empty embeds '' (a row with a null id is skipped under both).")
    storage_options: dict[str, Any] = opt({}, STORAGE_DOC.format(section="input"))
    on_duplicate_id: Literal["error", "keep_first"] = opt(
        "error", "An id seen twice in the input: error stops before encoding; keep_first embeds the first "
                 "occurrence (input order) and lists the others in skipped.parquet.")
    chunking: ChunkingConfig = opt(ChunkingConfig(), "Long documents: token-aware chunks with overlap (the "
                                                     "`input.chunking.*` fields below; off by default).")

    def validate(self) -> None:
        _positive(self, "input", "unit_rows")


@dataclass(frozen=True)
class ModelConfig:
    path: str = opt(doc="A local model directory (Hugging Face / sentence-transformers layout), a hub name "
                        "resolved offline from an installed model package or the local HF cache, or the URL of a "
                        "model folder (`s3://bucket/models/all-MiniLM-L6-v2/`, any fsspec protocol): the driver "
                        "downloads the files a worker reads once into the local cache (`downloads/`), and reuses "
                        "that copy while the objects are unchanged.", path="hub")
    storage_options: dict[str, Any] = opt({}, STORAGE_DOC.format(section="model"))
    max_seq_len: int | None = opt(None, "Truncate longer texts to this many tokens (special tokens included); "
                                        "null: the model's sentence-transformers max length, else its position limit.")
    dtype: Dtype = opt("auto", "Compute dtype of the encoder; auto: bfloat16 on a GPU, float32 on CPU (decided on the "
                               "driver for the embedded local Ray or an explicit runtime.device, and fingerprinted as "
                               "decided; on a joined cluster by each worker for its device: pin it when one output is written both ways). Layer norms, softmax and pooling accumulate in float32.")
    pooling: Pooling = opt("auto", "auto: what the model's sentence-transformers config says (mean for encoders without one).")
    normalize: bool | Literal["auto"] = opt("auto", "L2-normalise vectors; auto: what the model's sentence-transformers config says.")
    allow_pickle: bool = opt(False, "Also read pickled weights (`pytorch_model.bin`, with torch.load(weights_only=True)) "
                                    "when the model has no safetensors. Code in a model directory is never run.")
    prompt: str | None = opt(None, "A literal prefix put before every text (counted in max_seq_len, as sentence-transformers does); "
                                   "null: model.prompt_name, else the model's default_prompt_name; \"\": no prompt at all.")
    prompt_name: str | None = opt(None, "One of the model's named prompts (config_sentence_transformers.json `prompts`).")

    def validate(self) -> None:
        if self.max_seq_len is not None:
            _positive(self, "model", "max_seq_len")
        if self.prompt is not None and self.prompt_name is not None:
            raise JobError("model.prompt_name", f"{self.prompt_name!r} is set together with model.prompt",
                           "set only one of model.prompt (a literal prefix) and model.prompt_name")


@dataclass(frozen=True)
class BatchingConfig:
    max_tokens: int = opt(8192, "Token budget of one encoder step (real tokens, no padding).")
    sort_window: int = opt(4096, "Sequences sorted by length together before cutting batches; larger packs tighter.")
    buckets: list[int] | None = opt(None, "GPU with CUDA graphs: token counts a batch is padded up to (one graph per "
                                          "bucket); null: powers of two from 64 up to max_tokens, and max_tokens.")

    def validate(self) -> None:
        _positive(self, "batching", "max_tokens")
        _positive(self, "batching", "sort_window")
        if self.buckets is not None:
            if not self.buckets or min(self.buckets) <= 0:
                raise JobError("batching.buckets", f"{self.buckets!r} must be positive token counts",
                               "list token counts like [512, 2048, 8192], or null for powers of two")
            if max(self.buckets) < self.max_tokens:
                raise JobError("batching.buckets", f"the largest bucket {max(self.buckets)} is below "
                               f"batching.max_tokens={self.max_tokens}",
                               f"add a bucket of at least {self.max_tokens} tokens, or lower batching.max_tokens")


@dataclass(frozen=True)
class OutputConfig:
    path: str = opt(doc="Output directory: a local or mounted path, or an fsspec URL (`s3://bucket/out`, `gs://`, "
                        "`az://`) with the same layout and guarantees: vectors land in `<path>/vectors/`, the report "
                        "in `<path>/report.json`.", path=True)
    storage_options: dict[str, Any] = opt({}, STORAGE_DOC.format(section="output"))
    lock: Literal["auto", "none"] = opt(
        "auto", "auto: one live run per output path, kept by a lock with a heartbeat (a lock file; on s3:// a lock "
                "object created and refreshed by conditional writes); a lock left by a dead run is taken over. "
                "none: no lock, for a store without conditional writes (memory://, ...): make sure only one run "
                "writes to the output at a time.")
    format: Literal["parquet", "faiss", "both"] = opt(
        "parquet", "What to write: parquet (one part file per work unit), faiss (also a FAISS index in "
                   "`<path>/index/`, built from the parts, which stay: resume and versions rest on them) or both.")
    index: str = opt("auto", "FAISS index_factory string (`Flat`, `HNSW32`, `IVF4096,PQ32`, `OPQ16_64,IVF65536,PQ16`, "
                             "`IVF4096,PQ32,RFlat`, ...) or auto: chosen by corpus size, dimension and "
                             "output.index_memory_gb (rules in docs/index.md).")
    index_memory_gb: float = opt(8.0, "Memory the built index may take (GB): auto picks the best index that fits; "
                                      "an IVF index larger than this keeps its inverted lists on disk.")
    target_recall: float = opt(0.95, "10-recall@10 the index must reach on ~1,000 hold-out queries; nprobe / "
                                     "efSearch are tuned to the smallest value reaching it.")
    versioned: bool = opt(False, "Write each run to `<path>/versions/<run id>/` and, once it finished and validated, "
                                 "point `<path>/CURRENT` at it (an atomic rename); a failed run never moves CURRENT.")
    keep_versions: int | None = opt(None, "Versioned outputs: keep this many newest finished versions (never "
                                          "the current one); null keeps all.")
    incremental: bool = opt(False, "Versioned outputs: reuse the current version's vectors for rows whose id, "
                                   "text and vector settings are unchanged; encode only new and changed rows.")
    dim: int | None = opt(None, "Keep the first `dim` dimensions (Matryoshka), renormalised when vectors are normalised; "
                                "null: the model's dimension.")
    dtype: OutputDtype = opt("float32", "Stored vector type, as sentence-transformers' quantize_embeddings defines it: "
                                        "int8/uint8 bucket each dimension by min/max ranges calibrated on a sample of the run; "
                                        "binary/ubinary pack the bits `x > 0` (dim/8 bytes; binary subtracts 128).")
    calibration_rows: int = opt(10_000, "int8/uint8: rows sampled uniformly (seeded) over the whole input to calibrate "
                                        "the ranges. When the sample holds a large share of the input (all of an input no "
                                        "larger than this), its rows are not embedded again: the units take its vectors (with "
                                        "input.chunking, the chunk vectors of the sampled documents it embedded).")
    calibration_seed: int = opt(0, "Seed of the calibration sample.")
    document_vectors: Literal["none", "mean"] = opt(
        "none", "input.chunking on: mean also writes one vector per document, the normalised mean of its chunks' "
                "vectors, to `<path>/document_vectors/` (float32 or float16 outputs).")

    def validate(self) -> None:
        _positive(self, "output", "index_memory_gb")
        if self.dim is not None:
            _positive(self, "output", "dim")
        _positive(self, "output", "calibration_rows")
        if not 0 < self.target_recall <= 1:
            raise JobError("output.target_recall", f"{self.target_recall!r} is not in (0, 1]",
                           "set output.target_recall to a fraction such as 0.95")
        if self.keep_versions is not None:
            _positive(self, "output", "keep_versions")
        if (self.incremental or self.keep_versions is not None) and not self.versioned:
            field = "incremental" if self.incremental else "keep_versions"
            raise JobError(f"output.{field}", "needs versioned outputs", "set output.versioned: true")


# cluster.unit_timeout_s: null derives a unit's deadline as max(floor, factor x slowest seconds per row x rows)
UNIT_TIMEOUT_FLOOR_S, UNIT_TIMEOUT_FACTOR = 120.0, 4.0


@dataclass(frozen=True)
class ClusterConfig:
    address: str = opt("", "Empty: start an embedded local Ray (in a `ray job submit` entrypoint: join the cluster it was "
                           "submitted to). `auto` or `ray://host:port` or `host:port`: join a cluster.")
    workers: int | None = opt(None, "Worker actors; null: one per GPU, else one.")
    cpus_per_worker: int | None = opt(None, "CPUs (and torch threads) per worker; null: the node's CPUs split over the workers (GPU workers: 2).")
    max_attempts: int = opt(3, "A unit whose worker dies (killed, out of memory) goes back to the queue; after this many "
                               "deaths it fails the run (or is skipped, see on_error). A worker slot whose workers "
                               "fail to start this many times in a row is given up.")
    on_error: Literal["fail", "skip_unit"] = opt(
        "fail", "A unit that failed max_attempts times: fail stops the run naming the unit and its file; "
                "skip_unit leaves it out and lists it under `units.failed_units` in the report.")
    unit_timeout_s: float | None = opt(
        None, "A unit not finished this many seconds after its worker took it (the worker's start not counted) is "
              "given up: the worker is killed, a new one takes its slot and the unit goes back to the queue (an "
              f"attempt, as a death). null: derived from the units finished so far, max({UNIT_TIMEOUT_FLOOR_S:g} s, "
              f"{UNIT_TIMEOUT_FACTOR:g} x the slowest finished unit's seconds per row x the unit's rows); before any "
              "unit has finished, cluster.startup_timeout_s.")
    startup_timeout_s: float = opt(
        1800.0, "Seconds a placed worker's start (model load, warmup check) may take, and, with unit_timeout_s null, "
                "a unit taken before any unit has finished; past it the worker is replaced, as one that failed to "
                "start (its units lose no attempt: none had begun).")
    placement_timeout_s: float = opt(
        60.0, "A new worker that Ray cannot place on a node within this many seconds (no free CPU/GPU, e.g. after "
              "a node was lost) is given up with a warning: its unit goes to a live worker and the run goes on "
              "with the workers it has; with none left the run fails (exit 4) naming the free and needed resources.")

    def validate(self) -> None:
        _positive(self, "cluster", "max_attempts")
        for name in ("startup_timeout_s", "placement_timeout_s"):
            _positive(self, "cluster", name)
        if self.unit_timeout_s is not None:
            _positive(self, "cluster", "unit_timeout_s")
        if self.workers is not None:
            _positive(self, "cluster", "workers")
        if self.cpus_per_worker is not None:
            _positive(self, "cluster", "cpus_per_worker")


@dataclass(frozen=True)
class RuntimeConfig:
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto: cuda when the worker has a GPU, else cpu.")
    attention: Literal["auto", "sdpa", "grouped", "matmul", "reference", "varlen", "flash"] = opt(
        "auto", "Attention backend; auto: flash-attn or torch varlen on GPU in float16/bfloat16, else SDPA; "
                "on CPU grouped (SDPA per length group; matmul: the same groups, float32 scores by matmul).")
    cpu_keep_memory: bool = opt(True, "CPU: keep freed activation memory in the worker's heap instead of returning it "
                                      "to the OS: no page faults on every step (MiniLM: ~25% faster), but a worker "
                                      "then holds its peak memory until it exits.")
    cpu_linears: Literal["onednn", "torch", "auto"] = opt(
        "auto", "CPU: the GEMM library of the model's linear layers. auto: the faster one here, measured at a "
                "machine's first start-up by timing the model's own forward on both (oneDNN unless torch's is 10% "
                "faster; cached per machine, model and dtype, so every worker of a machine agrees); onednn: oneDNN "
                "wherever it runs correctly (else torch's); torch: torch's own (MKL or its BLAS). The two differ in "
                "their last bits (float32 rounding): machines that measure differently (a close call on a busy "
                "machine) write vectors that differ there; pin onednn or torch where every node must agree bit "
                "for bit.")
    cuda_graphs: bool = opt(True, "GPU: pad batches to batching.buckets and replay one CUDA graph per bucket "
                                  "(captured on first use); false: run eagerly on exact shapes.")
    max_graphs: int = opt(32, "GPU: graphs kept at once; beyond it the least recently used is released.")
    graph_memory_mb: int = opt(4096, "GPU: memory the graphs may hold together (MiB); the least recently used are "
                                     "released beyond it, and a bucket whose graph alone exceeds it runs eagerly.")
    tf32: bool = opt(False, "GPU, model.dtype float32: let float32 matmuls use TF32 tensor cores "
                            "(torch.set_float32_matmul_precision('high'), for the worker process); false leaves "
                            "torch's setting as it is (full float32 by default).")
    warmup_check: bool = opt(True, "Before real work, run sample texts through the fast path and an eager float32 "
                                   "copy; fail the worker if any cosine differs by more than 0.1%. The copy's "
                                   "vectors are kept in the embedpipe cache (warmup/), so later starts on the "
                                   "machine run only the fast path.")

    def validate(self) -> None:
        if self.max_graphs < 0:
            raise JobError("runtime.max_graphs", f"{self.max_graphs!r} must be 0 or more",
                           "set runtime.max_graphs to 0 (no graphs kept) or more")
        _positive(self, "runtime", "graph_memory_mb")


GpuPreset = Literal["auto", "H100", "H200", "B200", "A100", "L4", "cpu"]


@dataclass(frozen=True)
class CostConfig:
    """What a device-hour costs; the report turns it into total cost and cost per million tokens and rows.

    Price per device-hour, first match wins: gpu_hour_usd; instance_hour_usd / gpus_per_instance;
    the preset's list price (embedpipe/report/cost.py). CPU workers cost cpu_hour_usd x their threads.
    """

    preset: GpuPreset = opt("auto", "Price table row: auto picks it from the detected device (a GPU not in the table "
                                    "and without gpu_hour_usd is reported with cost unknown, never guessed).")
    gpu_hour_usd: float | None = opt(None, "USD per GPU-hour; overrides the preset's on-demand list price.")
    instance_hour_usd: float | None = opt(None, "USD per instance-hour; with gpus_per_instance gives the GPU-hour price.")
    gpus_per_instance: int | None = opt(None, "GPUs in one instance priced by instance_hour_usd.")
    cpu_hour_usd: float | None = opt(None, "USD per vCPU-hour for CPU workers (a worker costs this x its threads); "
                                           "null: the cpu preset's default.")
    spot: bool = opt(False, "Spot / preemptible capacity: multiply the price by (1 - spot_discount).")
    spot_discount: float = opt(0.6, "Fraction taken off the on-demand price when spot is true.")

    def validate(self) -> None:
        for name in ("gpu_hour_usd", "instance_hour_usd", "cpu_hour_usd"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise JobError(f"cost.{name}", f"{value!r} is negative", f"set cost.{name} to a price >= 0 or null")
        if (self.instance_hour_usd is None) != (self.gpus_per_instance is None):
            missing = "gpus_per_instance" if self.gpus_per_instance is None else "instance_hour_usd"
            raise JobError(f"cost.{missing}", "is needed with the other instance field",
                           "set both cost.instance_hour_usd and cost.gpus_per_instance, or neither")
        if self.gpus_per_instance is not None:
            _positive(self, "cost", "gpus_per_instance")
        if self.gpu_hour_usd is not None and self.instance_hour_usd is not None:
            raise JobError("cost.instance_hour_usd", "is set together with cost.gpu_hour_usd",
                           "price by GPU-hour or by instance-hour, not both")
        if not 0.0 <= self.spot_discount < 1.0:
            raise JobError("cost.spot_discount", f"{self.spot_discount!r} is not in [0, 1)",
                           "set cost.spot_discount to the fraction taken off, e.g. 0.6")


SECTIONS: dict[str, type] = {
    "input": InputConfig,
    "model": ModelConfig,
    "batching": BatchingConfig,
    "output": OutputConfig,
    "cluster": ClusterConfig,
    "runtime": RuntimeConfig,
    "cost": CostConfig,
}


@dataclass(frozen=True)
class JobSpec:
    """A validated job: one frozen dataclass per section."""

    input: InputConfig
    model: ModelConfig
    output: OutputConfig
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    name: str = "job"

    def to_dict(self) -> dict[str, Any]:
        return {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}

    def record(self) -> dict[str, Any]:
        """``to_dict`` as embedpipe writes it down (job.json, index.json): storage_options' secrets redacted."""
        raw = self.to_dict()
        for section in ("input", "model", "output"):
            raw[section]["storage_options"] = redact_storage_options(raw[section]["storage_options"])
        return raw

    def replace(self, **sections: Any) -> "JobSpec":
        """A copy with some fields changed: ``job.replace(output={"path": "/tmp/x"})``."""
        raw = self.to_dict()
        for section, values in sections.items():
            raw.setdefault(section, {}).update(values)
        return parse_job(raw, name=self.name)


def redact_storage_options(options: dict[str, Any]) -> dict[str, Any]:
    """fsspec options with every value that may be a secret (key, secret, token, password, ...) replaced."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in PUBLIC_STORAGE_OPTIONS:
            out[name] = redact_storage_options(value) if isinstance(value, dict) else _without_userinfo(value)
        else:
            out[name] = REDACTED
    return out


def _without_userinfo(value: Any) -> Any:
    """``http://user:pass@host:9000`` -> ``http://<redacted>@host:9000``: an endpoint URL may carry a password."""
    if isinstance(value, str):
        return re.sub(r"^([a-z][a-z0-9+.-]*://)[^/@]+@", rf"\1{REDACTED}@", value, flags=re.IGNORECASE)
    return value


# --------------------------------------------------------------------------- loading

def load_job(path: str | os.PathLike, *, overrides: list[str] | None = None) -> JobSpec:
    """Read, override (``key.path=value``) and validate a job file."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise JobError("job", f"file {source!r} does not exist", "pass the path of a job YAML file", source=source)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise JobError("job", f"is not valid YAML ({exc})", "fix the YAML syntax", source=source) from exc
    if not isinstance(raw, dict):
        raise JobError("job", "must be a mapping of sections", "write `input:`, `model:`, `output:` sections", source=source)
    raw = _resolve_paths(raw, base=path.parent)
    for item in overrides or []:
        apply_override(raw, item, source=source)
    return parse_job(raw, name=path.stem, source=source)


def apply_override(raw: dict, item: str, *, source: str = "--set") -> None:
    """Apply one ``section.field=value`` override in place; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if len(parts) == 3 and all(parts) and sep and _nested(parts[0], parts[1]) is not None:
        _apply_nested_override(raw, parts, _override_value(key, text, source=source), source=source)
        return
    if not sep and len(parts) == 2 and all(parts):
        raise JobError("--set", f"{item!r} has no value", f"write --set {key}=VALUE", source=source)
    if not sep or len(parts) != 2 or not all(parts):
        fix = "write e.g. --set output.path=/tmp/out"
        if parts[0] in SECTIONS and len(parts) == 1:  # `--set model=3`: a whole section
            fix = f"set one field at a time, e.g. --set {key}.{dataclasses.fields(SECTIONS[key])[0].name}=..."
        raise JobError("--set", f"{item!r} is not of the form section.field=value", fix, source=source)
    section, name = parts
    if section not in SECTIONS:
        raise JobError(key, f"unknown section {section!r}", f"use one of {', '.join(SECTIONS)}", source=source)
    value = _override_value(key, text, source=source)
    f = _field(SECTIONS[section], name)
    if f is not None:  # an unknown field is named by parse_job, with the closest match
        _check_override(key, text, value, typing.get_type_hints(SECTIONS[section])[name], source=source)
    if f is not None and f.metadata["path"] and isinstance(value, str) and value:
        value = _resolve(value, Path.cwd(), hub_name=_keeps_names(f, raw.get(section)))
    raw.setdefault(section, {})
    if not isinstance(raw[section], dict):
        raise JobError(section, "must be a mapping", f"write `{section}:` followed by indented fields", source=source)
    raw[section][name] = value


def _nested(section: str, name: str) -> type | None:
    """The dataclass of a nested section (input.chunking), else None."""
    cls = SECTIONS.get(section)
    if cls is None or _field(cls, name) is None:
        return None
    tp = typing.get_type_hints(cls)[name]
    return tp if dataclasses.is_dataclass(tp) else None


def _apply_nested_override(raw: dict, parts: list[str], value: Any, *, source: str) -> None:
    """``--set input.chunking.max_tokens=256``: one field of a nested section."""
    section, name, leaf = parts
    key = ".".join(parts)
    cls = _nested(section, name)
    if _field(cls, leaf) is not None:
        _check_override(key, str(value), value, typing.get_type_hints(cls)[leaf], source=source)
    sub = raw.setdefault(section, {})
    if not isinstance(sub, dict):
        raise JobError(section, "must be a mapping", f"write `{section}:` followed by indented fields", source=source)
    nested = sub.setdefault(name, {})
    if not isinstance(nested, dict):
        raise JobError(f"{section}.{name}", "must be a mapping", f"write `{name}:` followed by indented fields",
                       source=source)
    nested[leaf] = value


_QUOTE_HINT = "a --set value is read as YAML: quote a string that YAML would read otherwise"


def _override_value(key: str, text: str, *, source: str) -> Any:
    if not text.strip():
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise JobError(key, f"{text!r} is not a YAML value ({problem})",
                       f"{_QUOTE_HINT}, e.g. --set '{key}=\"{text}\"'", source=source) from None


def _check_override(key: str, text: str, value: Any, tp: Any, *, source: str) -> None:
    """Type-check a --set value here, so that the fix can say how to write it on a command line."""
    try:
        _coerce(value, tp, key, source)
    except JobError as exc:
        fix = exc.fix
        if isinstance(value, (dict, list, bool)) and _accepts_str(tp):  # `model.prompt=query: ` read as a mapping
            fix = f"{exc.fix}; {_QUOTE_HINT}, e.g. --set '{key}=\"{text}\"'"
        raise JobError(key, exc.problem, fix, source=source) from None


def _accepts_str(tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_str(a) for a in args)
    return tp is str


def parse_job(raw: dict[str, Any], *, name: str = "job", source: str = "job") -> JobSpec:
    """Validate a raw mapping (already path-resolved) into a JobSpec."""
    for section in raw:
        if section not in SECTIONS and section != "name":
            raise JobError(str(section), "unknown section", f"use one of {', '.join(SECTIONS)}", source=source)
    sections = {s: _parse_section(s, cls, raw.get(s), source) for s, cls in SECTIONS.items()}
    job = JobSpec(name=str(raw.get("name", name)), **sections)
    _check_document_vectors(job, source)
    _check_files(job, source)
    return job


def _check_document_vectors(job: JobSpec, source: str) -> None:
    """output.document_vectors needs chunks to average, and float stored vectors to average them from."""
    if job.output.document_vectors == "none":
        return
    if job.input.chunking.mode == "off":
        raise JobError("output.document_vectors", "needs chunked documents",
                       "set input.chunking.mode to split or late, or output.document_vectors: none", source=source)
    if job.output.dtype not in ("float32", "float16"):
        raise JobError("output.document_vectors", f"needs float vectors, not output.dtype {job.output.dtype!r}",
                       "set output.dtype to float32 or float16, or output.document_vectors: none", source=source)


def job_from_dict(raw: dict[str, Any], *, base: str | os.PathLike = ".", name: str = "job",
                  source: str = "job") -> JobSpec:
    """Validate a job given as a mapping (built in code); relative paths resolve against ``base``."""
    return parse_job(_resolve_paths(raw, base=Path(base)), name=str(raw.get("name", name)), source=source)


def parse_section(section: str, raw: dict[str, Any] | None, *, source: str = "job") -> Any:
    """Validate one section on its own (``embedpipe.embed`` checks its keyword options this way)."""
    return _parse_section(section, SECTIONS[section], raw, source)


def _parse_section(section: str, cls: type, raw: Any, source: str) -> Any:
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise JobError(section, f"must be a mapping, got {type(raw).__name__}",
                       f"write `{section}:` followed by indented fields", source=source)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            close = _closest(str(key), fields)
            hint = f"did you mean {section}.{close}?" if close else f"known fields: {', '.join(fields)}"
            raise JobError(f"{section}.{key}", "unknown field", hint, source=source)
    values = {}
    for name, f in fields.items():
        where = f"{section}.{name}"
        if name in raw:
            values[name] = _coerce(raw[name], hints[name], where, source)
            if f.metadata["path"] and values[name] == "":
                raise JobError(where, "is empty", f"set {where} to a path", source=source)
        elif f.default is REQUIRED:
            raise JobError(where, "is required", f"set {where} in the job file or with --set {where}=...", source=source)
    obj = cls(**values)
    try:
        obj.validate() if hasattr(obj, "validate") else None
    except JobError as exc:
        raise JobError(exc.field_path, exc.problem, exc.fix, source=source) from None
    return obj


def _coerce(value: Any, tp: Any, where: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in args:
            try:
                return _coerce(value, arm, where, source)
            except JobError as exc:
                errors.append(exc.problem)
        raise JobError(where, f"{value!r} is not {_describe(tp)}", f"set {where} to {_describe(tp)}", source=source)
    if origin is Literal:
        if value in args and type(value) is type(args[args.index(value)]):
            return value
        choices = ", ".join(str(a) for a in args)
        raise JobError(where, f"{value!r} is not one of {choices}", f"set {where} to one of them", source=source)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):  # a nested section (input.chunking)
        if isinstance(tp, type) and isinstance(value, tp):
            return value
        return _parse_section(where, tp, value, source)
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        value = _number(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # `1e6`
            return int(value)
    elif tp is float:
        value = _number(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, list):
            return [_coerce(v, args[0], f"{where}[{i}]", source) for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            return {str(k): _coerce(v, args[1], f"{where}.{k}", source) for k, v in value.items()}
    else:  # pragma: no cover - a schema annotation this function does not know
        raise TypeError(f"unsupported schema type {tp!r} at {where}")
    raise JobError(where, f"{value!r} is not {_describe(tp)}", f"set {where} to {_describe(tp)}", source=source)


_EXPONENT = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")


def _number(value: Any) -> Any:
    """`1e6` as a number: YAML 1.1 (PyYAML) reads an exponent without a dot as a string."""
    if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        number = float(value)
        return number if math.isfinite(number) else value
    return value


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return "a mapping of names to values" if args[1] is Any else f"a mapping of {_describe(args[1])}"
    return {type(None): "null", bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _check_files(job: JobSpec, source: str) -> None:
    from glob import has_magic

    p = job.input.path
    if "://" in p or has_magic(p) or Path(p).exists():
        return  # URLs and globs are checked when the units are planned
    if job.input.format == "huggingface" and not os.path.isabs(p):
        return  # a dataset name in the local HF cache: looked up when the units are planned
    raise JobError("input.path", f"{p!r} does not exist",
                   "point input.path at a file, a directory of them or a glob (for a dataset in the local "
                   "Hugging Face cache by name, set input.format: huggingface)", source=source)


def _positive(obj: Any, section: str, name: str) -> None:
    value = getattr(obj, name)
    if value <= 0:
        raise JobError(f"{section}.{name}", f"{value!r} must be positive", f"set {section}.{name} to a number above 0")


def _field(cls: type, name: str) -> dataclasses.Field | None:
    return next((f for f in dataclasses.fields(cls) if f.name == name), None)


def _closest(key: str, names: typing.Iterable[str]) -> str | None:
    import difflib

    match = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    return match[0] if match else None


def _resolve(value: str, base: Path, *, hub_name: bool = False) -> str:
    """Resolve a relative local path against ``base``; URLs and absolute paths stay."""
    from glob import has_magic

    if "://" in value or os.path.isabs(value):
        return value
    candidate = base / value
    if hub_name and value.count("/") <= 1 and not candidate.exists() and not value.startswith(".") \
            and not has_magic(value):
        return value  # `org/name`: resolved offline later by embedpipe.models.resolve
    return os.path.normpath(str(base.resolve() / value))


def _keeps_names(f: dataclasses.Field, values: Any) -> bool:
    kind = f.metadata["path"]
    return kind == "hub" or (kind == "dataset" and isinstance(values, dict) and values.get("format") == "huggingface")


def _resolve_paths(raw: dict, *, base: Path) -> dict:
    out = dict(raw)
    for section, cls in SECTIONS.items():
        values = out.get(section)
        if not isinstance(values, dict):
            continue
        values = dict(values)
        for f in dataclasses.fields(cls):
            if f.metadata["path"] and isinstance(values.get(f.name), str) and values[f.name]:
                values[f.name] = _resolve(values[f.name], base, hub_name=_keeps_names(f, values))
        out[section] = values
    return out


# --------------------------------------------------------------------------- reference docs

def render_reference() -> str:
    """The job reference in Markdown, generated from the schema (docs/job-reference.md)."""
    lines = [
        "# Job file reference",
        "",
        "Generated from `embedpipe/config.py` by `python -m embedpipe.config > docs/job-reference.md`;",
        "a test fails when this file and the schema disagree.",
        "",
        "Relative paths in a job file are resolved against the job file's folder; paths given with",
        "`--set section.field=value` against the current directory. Any field can be overridden with `--set`.",
        "",
    ]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        lines += [f"## `{section}`", "", "| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        lines += _reference_rows(section, cls)
        lines.append("")
    return "\n".join(lines)


def _reference_rows(prefix: str, cls: type) -> list[str]:
    """One table row per field; a nested section (input.chunking) as a row, then rows of its own fields."""
    rows, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows.append(f"| `{prefix}.{f.name}` | a mapping | | {f.metadata.get('doc', '')} |")
            rows += _reference_rows(f"{prefix}.{f.name}", hints[f.name])
            continue
        default = "**required**" if f.default is REQUIRED else f"`{_yaml_scalar(f)}`"
        rows.append(f"| `{prefix}.{f.name}` | {_describe(hints[f.name])} | {default} | {f.metadata.get('doc', '')} |")
    return rows


def _yaml_scalar(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


if __name__ == "__main__":
    print(render_reference(), end="")


# --------------------------------------------------------------------------- keyword options
# embed() and Encoder.from_options take job fields as keyword options. section -> the fields that are
# options (None: all of them but `path`), in naming priority order: a name two sections share keeps its
# plain form for the first section and takes `<section>_` for the next (`dtype` is model.dtype,
# `output_dtype` is output.dtype).
OPTION_SECTIONS: dict[str, tuple[str, ...] | None] = {
    "model": None,
    "output": ("dim", "dtype", "calibration_rows", "calibration_seed", "document_vectors"),
    "input": ("on_bad_row", "chunking"),
    "batching": None,
    "runtime": None,
}
IN_PROCESS = "<in process>"  # input.path and output.path of an options job: never read or written


def option_names() -> dict[str, tuple[str, str]]:
    """Keyword option -> (section, field), for the fields the schema has today."""
    names: dict[str, tuple[str, str]] = {}
    for section, allowed in OPTION_SECTIONS.items():
        for f in dataclasses.fields(SECTIONS[section]):
            if f.name == "path" or (allowed is not None and f.name not in allowed):
                continue
            names[f.name if f.name not in names else f"{section}_{f.name}"] = (section, f.name)
    return names


def job_from_options(model: str, options: dict[str, Any], *, source: str) -> JobSpec:
    """A JobSpec of ``model.path=model`` and keyword options, each checked by the schema (errors name the option)."""
    names = option_names()
    raw: dict[str, dict[str, Any]] = {section: {} for section in OPTION_SECTIONS}
    raw["model"]["path"] = model
    raw["output"]["path"] = raw["input"]["path"] = IN_PROCESS
    for key, value in options.items():
        if key not in names:
            import difflib

            close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}=?" if close else f"known options: {', '.join(sorted(names))}"
            raise JobError(key, "unknown option", hint, source=source)
        section, field_name = names[key]
        raw[section][field_name] = value
    with option_errors(source=source):
        job = JobSpec(**{section: parse_section(section, values, source=source) for section, values in raw.items()})
    _check_document_vectors(job, source)
    return job


@contextlib.contextmanager
def option_errors(*, source: str) -> Iterator[None]:
    """A JobError names the keyword option, not the job-file field."""
    where = {f"{section}.{field_name}": key for key, (section, field_name) in option_names().items()}
    try:
        yield
    except JobError as exc:
        option = where.get(exc.field_path, exc.field_path)
        raise JobError(option, exc.problem, exc.fix.replace(exc.field_path, option), source=source) from None
