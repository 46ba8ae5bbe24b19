#!/usr/bin/env python
"""GPU check: one short run (< 5 minutes on an H100/H200) that measures what the GPU runtime promises.

    python scripts/gpu_check.py                # CUDA: MiniLM-L6, BERT-base, Qwen3-0.6B configurations
    python scripts/gpu_check.py --cpu-smoke    # tiny configurations on CPU in seconds (the test suite runs this)

Writes `$OUT/gpu_check.json` when OUT is set, else `./gpu_check.json` (or --out), after EVERY row, so a
CUDA error in one model keeps the rows before it; prints one table; exits 1 when any row or step failed.
`--fail NAME` makes the row NAME fail on purpose, `--crash NAME` kills the process in it, as a fatal CUDA
error would (tests of that contract).

Everything is built in place, nothing is downloaded and no tokenizer travels: each model is a
random-weight `transformers` model of the real configuration, and embedpipe's packed model gets
the same weights through its own loader (mapping tables). Inputs are random token ids with a
realistic length mix (lognormal, median 33, mean ~42, clipped to [4, 512]); every engine gets
the same sequences, already tokenized. Per model:

  parity     embedpipe bf16 graphed vs embedpipe fp32 eager (SDPA): min cosine over sequences;
             also embedpipe fp32 vs transformers fp32, to show the weights were carried over
  replay     graph replay vs eager on the same padded inputs: bit for bit, and max |diff|
  tokens/s   real tokens per second, host-to-device and device-to-host copies included,
             tokenization and batch building excluded, for
               sentence-transformers  bf16, its modules' forward (Transformer -> Pooling ->
                                      Normalize) on pre-tokenized, padded batches sorted by length
                                      as `encode` sorts them: `encode` minus tokenization
                                      (sentence-transformers needs a tokenizer on disk for that; the
                                      script writes a word-level one over the vocabulary, only so
                                      that the module loads). Best of a batch-size sweep.
               transformers           bf16, AutoModel on length-sorted padded batches, pooling and
                                      normalisation in torch. Best of the same sweep.
               embedpipe eager        bf16, packed batches (max_tokens), exact shapes, no graphs
               embedpipe graphed      bf16, bucketed shapes, one CUDA graph per bucket (captured
                                      in an untimed first pass)
  MFU        model FLOPs of the real tokens (the family's rule, embedpipe/report/flops.py) per second, over the
             measured bf16 matmul rate of this GPU (report/device.py's probe, 4096^3 and 8192^3, not the datasheet)

Real text (the row "minilm-l6 real text"): what a user sees. The quickstart corpus
(examples/data/quickstart.parquet, repeated to `rows` texts) through all-MiniLM-L6-v2's real tokenizer
(scripts/gpu_assets/minilm: its config and tokenizer files, no weights; random weights of the real
configuration are built in place), texts in and vectors out, each timed the same way (device synced):
  sentence-transformers  SentenceTransformer(folder).to(bfloat16).encode(texts, batch_size=...), best of a sweep
  embedpipe              Encoder(...).embed(texts): the production path (model.dtype auto = bfloat16 on CUDA,
                         the prefetch thread, lazily captured graphs, the warmup guard at construction); the
                         first call (captures) is reported apart from the timed second call

Targets (H100/H200 class): embedpipe graphed >= 3x sentence-transformers on MiniLM at the mixed
lengths; >= 50 % MFU on Qwen3-0.6B at 512-token inputs. A failure is recorded in its row and
the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, no install needed

from embedpipe.config import BatchingConfig, ModelConfig, RuntimeConfig  # noqa: E402
from embedpipe.kernels import select_backend  # noqa: E402
from embedpipe.report.bench import bench_runner, matmul_peak, model_flops, packed_model  # noqa: E402
from embedpipe.report.counters import Counters  # noqa: E402
from embedpipe.runtime.encoder import Encoder  # noqa: E402
from embedpipe.runtime.runners import DeviceRunner, EagerRunner  # noqa: E402
from embedpipe.runtime.warmup import compare, run_batches  # noqa: E402
from embedpipe.text.packer import TokenPacker  # noqa: E402
from embedpipe.text.tokenizer import Tokenized  # noqa: E402

TARGET_ST_SPEEDUP = 3.0  # embedpipe graphed / sentence-transformers, MiniLM, mixed lengths
TARGET_MFU_512 = 0.5  # Qwen3-0.6B, 512-token inputs
ASSETS = ROOT / "scripts" / "gpu_assets" / "minilm"  # all-MiniLM-L6-v2's config and tokenizer, no weights
QUICKSTART = ROOT / "examples" / "data" / "quickstart.parquet"


@dataclass(frozen=True)
class Spec:
    name: str
    model_type: str
    config: dict  # transformers config fields
    pooling: str  # mean | last
    st_pooling: str  # sentence-transformers pooling mode
    mixed: int  # sequences in the mixed-length set
    parity: int  # sequences checked for parity
    long: int = 0  # sequences of max_len tokens for the MFU row (0: no such row)
    batch_sizes: tuple[int, ...] = (64, 128, 256, 512)


@dataclass(frozen=True)
class TextSpec:
    """A real-text row: the quickstart corpus through the real MiniLM tokenizer, random weights of its config."""
    name: str
    rows: int  # texts (the corpus repeated as needed)
    batch_sizes: tuple[int, ...]  # sentence-transformers' sweep
    config: dict = field(default_factory=dict)  # overrides of the real config.json (smoke: tiny sizes)


@dataclass(frozen=True)
class Plan:
    device: str
    specs: list  # Spec | TextSpec, in the order they run
    max_len: int  # longest sequence; also the engine's max_seq_len
    max_tokens: int  # engine token budget per batch
    matmul_sizes: tuple[int, ...]  # square bf16 matmuls of the peak probe (report/device.py's)
    budget_s: float  # stop starting new measurements past this
    sentence_transformers: bool = True
    notes: list[str] = field(default_factory=list)


GPU_SPECS = [
    Spec("minilm-l6", "bert", dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                   intermediate_size=1536, max_position_embeddings=512),
         pooling="mean", st_pooling="mean", mixed=30000, parity=2000),
    TextSpec("minilm-l6 real text", rows=30000, batch_sizes=(64, 128, 256, 512)),
    Spec("bert-base", "bert", dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                   intermediate_size=3072, max_position_embeddings=512),
         pooling="mean", st_pooling="mean", mixed=12000, parity=1000),
    Spec("qwen3-0.6b", "qwen3", dict(vocab_size=151669, hidden_size=1024, num_hidden_layers=28,
                                     num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                     intermediate_size=3072, max_position_embeddings=32768, rms_norm_eps=1e-6,
                                     rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu"),
         pooling="last", st_pooling="lasttoken", mixed=4000, parity=500, long=512, batch_sizes=(16, 32, 64, 128)),
]
SMOKE_SPECS = [
    Spec("minilm-l6 (tiny)", "bert", dict(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=128),
         pooling="mean", st_pooling="mean", mixed=96, parity=48, batch_sizes=(16, 32)),
    TextSpec("minilm-l6 real text (tiny)", rows=200, batch_sizes=(32, 64),
             config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)),
    Spec("qwen3 (tiny)", "qwen3", dict(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                       max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True),
         pooling="last", st_pooling="lasttoken", mixed=64, parity=32, long=32, batch_sizes=(16, 32)),
]


# --------------------------------------------------------------------------- inputs


def mixed_lengths(n: int, *, max_len: int, rng: np.random.Generator) -> np.ndarray:
    """Lognormal(3.5, 0.7) token counts clipped to [4, max_len]: median ~33, mean ~42, a tail to max_len."""
    return np.clip(np.round(rng.lognormal(3.5, 0.7, n)), 4, max_len).astype(np.int64)


def random_tokens(lengths: np.ndarray, *, vocab: int, rng: np.random.Generator) -> Tokenized:
    ids = rng.integers(1, vocab, int(lengths.sum()), dtype=np.int64)
    return Tokenized(ids=ids, lengths=lengths, truncated=np.zeros(lengths.size, dtype=bool))


def padded_batches(tok: Tokenized, batch_size: int) -> list[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
    """Longest first (as sentence-transformers' encode sorts), right-padded: (rows, ids [b, L], mask [b, L])."""
    order = np.argsort(-tok.lengths, kind="stable")
    starts = tok.starts
    out = []
    for i in range(0, order.size, batch_size):
        rows = order[i:i + batch_size]
        L = int(tok.lengths[rows].max())
        ids = torch.zeros(rows.size, L, dtype=torch.long)
        mask = torch.zeros(rows.size, L, dtype=torch.long)
        for j, r in enumerate(rows.tolist()):  # batch building is outside every timed region
            n = int(tok.lengths[r])
            ids[j, :n] = torch.from_numpy(tok.ids[starts[r]:starts[r] + n])
            mask[j, :n] = 1
        out.append((rows, ids, mask))
    return out


# --------------------------------------------------------------------------- models


def hf_model(spec: Spec, *, device: str):
    import transformers

    config = transformers.AutoConfig.for_model(spec.model_type, **spec.config)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModel.from_config(config)
    return model.float().eval().requires_grad_(False)


def embedpipe_model(hf, spec: Spec, *, dtype: torch.dtype, device: str, backend: str):
    return packed_model(hf.config.to_dict(), hf.state_dict(), pooling=spec.pooling, dtype=dtype, device=device,
                        backend=backend)


def sentence_transformer(hf_bf16, spec: Spec, *, device: str, folder: Path):
    """sentence-transformers around the same weights: its Transformer module loads from a folder, so
    the bf16 model is saved there with a word-level tokenizer over the vocabulary (never used)."""
    import transformers
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(hf_bf16.config.vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0").save_pretrained(folder)
    hf_bf16.save_pretrained(folder)
    modules = [models.Transformer(str(folder)), models.Pooling(hf_bf16.config.hidden_size, spec.st_pooling),
               models.Normalize()]
    return SentenceTransformer(modules=modules, device=device).to(torch.bfloat16).eval()


# --------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def engine(model, head, *, plan: Plan, graphed: bool, bucketed: bool | None = None) -> DeviceRunner:
    return bench_runner(model, head, device=plan.device, max_tokens=plan.max_tokens, max_seq_len=plan.max_len,
                        graphed=graphed, bucketed=bucketed)


def run_engine(runner, batches) -> None:
    results = [runner.submit(b) for b in batches]  # the ring bounds what is in flight
    for r in results:
        r.get()


@torch.inference_mode()
def run_padded(forward, batches, device: str) -> None:
    for _, ids, mask in batches:
        forward(ids.to(device), mask.to(device)).float().cpu()


def hf_forward(hf, pooling: str):
    def forward(ids, mask):
        h = hf(input_ids=ids, attention_mask=mask).last_hidden_state  # [b, L, H]
        if pooling == "mean":
            m = mask[..., None].to(h.dtype)
            x = (h * m).sum(1).float() / m.sum(1).float()
        else:
            x = h[torch.arange(h.shape[0], device=h.device), mask.sum(1) - 1].float()
        return F.normalize(x, dim=-1)

    return forward


def st_forward(st):
    def forward(ids, mask):
        return st({"input_ids": ids, "attention_mask": mask})["sentence_embedding"]

    return forward


def sweep(forward, padded: dict, tokens: int, device: str) -> dict:
    """tokens/s per batch size (after one warmup batch each); the best one."""
    per = {}
    for bs, batches in padded.items():
        run_padded(forward, batches[:1], device)  # warm: kernels, allocator
        per[bs] = tokens / timed(lambda: run_padded(forward, batches, device), device)
    best = max(per, key=per.get)
    return {"tokens_per_s": per[best], "batch_size": best, "sweep": {str(k): round(v) for k, v in per.items()}}


# --------------------------------------------------------------------------- one model


class Steps:
    """`with steps("name"):` runs one measurement; a failure is recorded in row["errors"] and the run goes on."""

    def __init__(self, row: dict):
        self.row = row

    @contextlib.contextmanager
    def __call__(self, name: str):
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a failed measurement is a result, not the end
            self.row.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"
            print(f"  {self.row['model']}: {name} failed: {type(e).__name__}: {e}", file=sys.stderr)

    def failed(self, name: str) -> bool:
        return name in self.row.get("errors", {})


def check_model(spec: Spec, plan: Plan, peak: float, started: float, workdir: Path) -> dict:
    row: dict = {"model": spec.name, "model_type": spec.model_type}
    dev, rng, steps = plan.device, np.random.default_rng(0), Steps(row)
    vocab = spec.config["vocab_size"]
    mixed = random_tokens(mixed_lengths(spec.mixed, max_len=plan.max_len, rng=rng), vocab=vocab, rng=rng)
    row["mixed"] = {"sequences": spec.mixed, "tokens": int(mixed.lengths.sum()),
                    "mean_len": round(float(mixed.lengths.mean()), 1), "max_len": int(mixed.lengths.max())}
    packer = TokenPacker(max_tokens=plan.max_tokens, sort_window=BatchingConfig().sort_window)  # the job default
    sub = random_tokens(mixed.lengths[:spec.parity], vocab=vocab, rng=rng)
    sub_batches = packer(sub)

    hf = hf_model(spec, device=dev)
    config_json = hf.config.to_dict()
    flops = model_flops(config_json, mixed.lengths)  # one count for every engine: the family's rule
    ref_model, ref_head = embedpipe_model(hf, spec, dtype=torch.float32, device=dev, backend="sdpa")
    ref = run_batches(EagerRunner(ref_model, ref_head, device=dev), sub_batches, spec.parity)

    with steps("fp32 vs transformers"):
        few = random_tokens(mixed.lengths[:32], vocab=vocab, rng=rng)
        with torch.inference_mode():
            padded = padded_batches(few, 32)
            hf_ref = torch.cat([hf_forward(hf, spec.pooling)(ids.to(dev), mask.to(dev)).cpu() for _, ids, mask in padded])
        order = torch.as_tensor(np.concatenate([rows for rows, _, _ in padded]))
        ours = run_batches(EagerRunner(ref_model, ref_head, device=dev), packer(few), 32)[order]
        row["fp32_vs_transformers_min_cosine"] = compare(ours, hf_ref).min_cosine
    del ref_model, ref_head

    # the fast path: the auto attention backend, else SDPA if that one fails here
    graphed = None
    for backend in dict.fromkeys([select_backend(device=dev, requested="auto", dtype=torch.bfloat16), "sdpa"]):
        with steps(f"parity ({backend})"):
            fast_model, fast_head = embedpipe_model(hf, spec, dtype=torch.bfloat16, device=dev, backend=backend)
            runner = engine(fast_model, fast_head, plan=plan, graphed=True)
            row["parity_min_cosine"] = compare(run_batches(runner, sub_batches, spec.parity), ref).min_cosine
            row["attention_backend"], graphed = backend, runner
        if graphed is not None:
            break
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    del hf, ref
    speeds: dict = {}
    row["speed"] = speeds
    tokens = int(mixed.lengths.sum())
    batches = packer(mixed)

    if graphed is not None:
        with steps("replay vs eager"):
            eager_padded = run_batches(engine(fast_model, fast_head, plan=plan, graphed=False, bucketed=True),
                                       sub_batches, spec.parity)
            replayed = run_batches(graphed, sub_batches, spec.parity)
            row["replay_bitwise_equal"] = bool(torch.equal(replayed, eager_padded))
            row["replay_max_abs_diff"] = float((replayed - eager_padded).abs().max())
        with steps("embedpipe eager"):
            staged = engine(fast_model, fast_head, plan=plan, graphed=False)
            run_engine(staged, batches[:2])
            speeds["embedpipe_eager"] = {"tokens_per_s": tokens / timed(lambda: run_engine(staged, batches), dev)}
        with steps("embedpipe graphed"):
            capture_s = timed(lambda: run_engine(graphed, batches), dev)  # first pass captures the graphs
            speeds["embedpipe_graphed"] = {
                "tokens_per_s": tokens / timed(lambda: run_engine(graphed, batches), dev),
                "graphs": len(graphed.graphs.graphs), "graph_mib": round(graphed.graphs.nbytes / 2**20, 1),
                "first_pass_s": round(capture_s, 3), "padded_tokens": sum(graphed.shape(b).tokens for b in batches)}
        if spec.long:
            with steps("long inputs"):
                lengths = np.full(spec.long, plan.max_len, dtype=np.int64)
                long_batches = packer(random_tokens(lengths, vocab=vocab, rng=rng))
                run_engine(graphed, long_batches)  # capture
                seconds = timed(lambda: run_engine(graphed, long_batches), dev)
                row["long"] = {"seq_len": plan.max_len, "sequences": spec.long,
                               "tokens_per_s": int(lengths.sum()) / seconds,
                               "mfu": model_flops(config_json, lengths) / seconds / peak}
        del fast_model, fast_head, graphed

    padded = {bs: padded_batches(mixed, bs) for bs in spec.batch_sizes}
    if time.perf_counter() - started > plan.budget_s:
        speeds["transformers"] = {"skipped": "time budget"}
    else:
        with steps("transformers"):
            speeds["transformers"] = sweep(hf_forward(hf_bf16, spec.pooling), padded, tokens, dev)
    if not plan.sentence_transformers:
        speeds["sentence_transformers"] = {"skipped": "sentence-transformers is not installed"}
    elif time.perf_counter() - started > plan.budget_s:
        speeds["sentence_transformers"] = {"skipped": "time budget"}
    else:
        with steps("sentence-transformers"):
            st = sentence_transformer(hf_bf16, spec, device=dev, folder=workdir / spec.name.split()[0])
            speeds["sentence_transformers"] = sweep(st_forward(st), padded, tokens, dev)
            del st
    del hf_bf16
    for s in speeds.values():
        if "tokens_per_s" in s:
            s["mfu"] = flops / tokens * s["tokens_per_s"] / peak
    st_speed = speeds.get("sentence_transformers", {}).get("tokens_per_s")
    ours = speeds.get("embedpipe_graphed", {}).get("tokens_per_s")
    if st_speed and ours:
        row["graphed_vs_sentence_transformers"] = ours / st_speed
    return row


# --------------------------------------------------------------------------- real text


def corpus_texts(rows: int) -> list[str]:
    import pyarrow.parquet as pq

    texts = pq.read_table(QUICKSTART, columns=["text"]).column("text").to_pylist()
    return [texts[i % len(texts)] for i in range(rows)]


def real_text_model(spec: TextSpec, folder: Path) -> Path:
    """MiniLM's files (config, tokenizer, sentence-transformers modules) with random weights of that config
    (seeded), as a model directory both engines load."""
    import transformers

    shutil.copytree(ASSETS, folder, dirs_exist_ok=True)
    config = {**json.loads((folder / "config.json").read_text()), **spec.config}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "word_embedding_dimension": config["hidden_size"]}))
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(folder))
    model.save_pretrained(folder, safe_serialization=True)  # model.safetensors (and config.json again)
    return folder


def check_text(spec: TextSpec, plan: Plan, started: float, workdir: Path) -> dict:
    row: dict = {"model": spec.name, "kind": "real text"}
    dev, steps, speeds = plan.device, Steps(row), {}
    row["speed"] = speeds
    folder = real_text_model(spec, workdir / "minilm-real")
    texts = corpus_texts(spec.rows)
    row["texts"] = {"rows": len(texts), "corpus": str(QUICKSTART.relative_to(ROOT)), "tokenizer": "all-MiniLM-L6-v2"}
    ours = None
    with steps("embedpipe Encoder.embed"):
        encoder = Encoder(model=ModelConfig(path=str(folder)), batching=BatchingConfig(max_tokens=plan.max_tokens),
                          runtime=RuntimeConfig(device=plan.device))  # auto dtype; the warmup guard runs here
        row["encoder"] = {"device": encoder.device, "dtype": encoder.dtype, "runner": encoder.runner.name,
                          "attention_backend": encoder.loaded.model.attention_backend,
                          "warmup_min_cosine": None if encoder.warmup is None else encoder.warmup.min_cosine}
        first = Counters()
        first_s = timed(lambda: encoder.embed(texts, first), dev)  # lazy capture of this corpus's buckets
        counters, box = Counters(), {}
        seconds = timed(lambda: box.setdefault("v", encoder.embed(texts, counters)), dev)
        ours = box["v"]
        speeds["embedpipe"] = {"rows_per_s": len(texts) / seconds, "tokens_per_s": counters.tokens / seconds,
                               "seconds": round(seconds, 3), "first_call_s": round(first_s, 3),
                               "padded_tokens": counters.padded_tokens}
        graphs = getattr(encoder.runner, "graphs", None)
        if graphs is not None:
            speeds["embedpipe"].update(graphs=len(graphs.graphs), graph_mib=round(graphs.nbytes / 2**20, 1),
                                       captures=graphs.stats.captures, eager_runs=graphs.stats.eager_runs)
        row["tokens"] = counters.tokens
        del encoder
    if not plan.sentence_transformers:
        speeds["sentence_transformers"] = {"skipped": "sentence-transformers is not installed"}
    elif time.perf_counter() - started > plan.budget_s:
        speeds["sentence_transformers"] = {"skipped": "time budget"}
    else:
        with steps("sentence-transformers encode"):
            from sentence_transformers import SentenceTransformer

            st = SentenceTransformer(str(folder), device=dev).to(torch.bfloat16).eval()
            per, best_vectors = {}, None
            for bs in spec.batch_sizes:
                st.encode(texts[:2 * bs], batch_size=bs)  # warm: kernels, allocator
                box = {}
                seconds = timed(lambda: box.setdefault("v", st.encode(texts, batch_size=bs, convert_to_numpy=True)), dev)
                per[bs] = len(texts) / seconds
                if per[bs] == max(per.values()):
                    best_vectors = box["v"]
            best = max(per, key=per.get)
            speeds["sentence_transformers"] = {"rows_per_s": per[best], "batch_size": best,
                                               "sweep_rows_per_s": {str(k): round(v) for k, v in per.items()}}
            if row.get("tokens"):
                speeds["sentence_transformers"]["tokens_per_s"] = row["tokens"] * per[best] / len(texts)
            if ours is not None:
                row["embedpipe_vs_sentence_transformers_min_cosine"] = compare(ours, best_vectors).min_cosine
            del st
    st_rows = speeds.get("sentence_transformers", {}).get("rows_per_s")
    our_rows = speeds.get("embedpipe", {}).get("rows_per_s")
    ratio = our_rows / st_rows if st_rows and our_rows else None
    row["embedpipe_vs_sentence_transformers"] = ratio
    row["target"] = {"what": "Encoder.embed / SentenceTransformer.encode, texts in, vectors out",
                     "target": TARGET_ST_SPEEDUP, "value": ratio, "met": None if ratio is None else ratio >= TARGET_ST_SPEEDUP}
    return row


# --------------------------------------------------------------------------- report


def _fmt(x, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ("model", "parity", "replay==eager", "ST tok/s", "HF tok/s", "eager tok/s", "graphed tok/s",
            "graphed/ST", "MFU graphed", "MFU long", "errors")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if "speed" not in r:
            lines.append(f"{r['model']} | error: {r.get('error')}")
            continue
        s = r["speed"]
        if r.get("kind") == "real text":
            ratio = r.get("embedpipe_vs_sentence_transformers")
            st = s.get("sentence_transformers", {})
            lines.append(" | ".join([
                r["model"], _fmt(r.get("embedpipe_vs_sentence_transformers_min_cosine"), ".6f"), "-",
                _fmt(st.get("tokens_per_s")) + (f" (bs {st['batch_size']})" if "batch_size" in st else ""), "-",
                "-", _fmt(s.get("embedpipe", {}).get("tokens_per_s")) + " (Encoder.embed, texts in)",
                "-" if ratio is None else f"{ratio:.2f}x", "-", "-", ", ".join(r.get("errors", {})) or "-"]))
            continue

        def speed(name: str) -> str:
            got = s.get(name, {})
            text = _fmt(got.get("tokens_per_s"))
            return text + (f" (bs {got['batch_size']})" if "batch_size" in got else "")

        ratio = r.get("graphed_vs_sentence_transformers")
        lines.append(" | ".join([
            r["model"], _fmt(r.get("parity_min_cosine"), ".6f"), str(r.get("replay_bitwise_equal", "-")),
            speed("sentence_transformers"), speed("transformers"), speed("embedpipe_eager"),
            speed("embedpipe_graphed"), "-" if ratio is None else f"{ratio:.2f}x",
            _fmt(s.get("embedpipe_graphed", {}).get("mfu"), ".1%"), _fmt(r.get("long", {}).get("mfu"), ".1%"),
            ", ".join(r.get("errors", {})) or "-",
        ]))
    return "\n".join(lines)


def targets(rows: list[dict]) -> dict:
    by = {r["model"]: r for r in rows}
    minilm, qwen = by.get("minilm-l6", {}), by.get("qwen3-0.6b", {})
    speedup = minilm.get("graphed_vs_sentence_transformers")
    mfu = qwen.get("long", {}).get("mfu")
    return {
        "minilm_graphed_vs_sentence_transformers": {"target": TARGET_ST_SPEEDUP, "value": speedup,
                                                    "met": None if speedup is None else speedup >= TARGET_ST_SPEEDUP},
        "qwen3_0.6b_mfu_at_512": {"target": TARGET_MFU_512, "value": mfu,
                                  "met": None if mfu is None else mfu >= TARGET_MFU_512},
    }


def environment(plan: Plan) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": plan.device,
           "cuda": torch.version.cuda}
    if plan.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    for name in ("transformers", "sentence_transformers", "flash_attn"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent or broken: say so
            env[name] = None
    return env


def failed_rows(rows: list[dict]) -> list[str]:
    """Rows that failed whole ("error") or in one of their steps ("errors")."""
    return [r["model"] for r in rows if "error" in r or r.get("errors")]


def write_report(out: Path, report: dict) -> None:
    """Atomically (temp name, then rename): a reader never sees half a file, a crash keeps the last rows."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, out)


def cleanup(device: str) -> None:
    """After every row, whatever happened in it; a sticky CUDA error raises again here: recorded, not fatal."""
    gc.collect()
    if device.startswith("cuda"):
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            print(f"  cleanup after the row failed: {type(e).__name__}: {e}", file=sys.stderr)


def run_row(spec, plan: Plan, peak: float, started: float, workdir: Path, *, fail: str | None,
            crash: str | None) -> dict:
    t0 = time.perf_counter()
    if crash is not None and crash == spec.name:
        print(f"--crash {spec.name!r}: the process dies in this row", file=sys.stderr, flush=True)
        os._exit(70)
    try:
        if fail is not None and fail == spec.name:
            raise RuntimeError(f"--fail {spec.name!r}: this row fails on purpose")
        if isinstance(spec, TextSpec):
            row = check_text(spec, plan, started, workdir)
        else:
            row = check_model(spec, plan, peak, started, workdir)
    except Exception as e:  # noqa: BLE001 - one model's failure is a result, not the end
        row = {"model": spec.name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    finally:
        cleanup(plan.device)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny configurations on CPU, seconds")
    parser.add_argument("--out", help="JSON path (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    parser.add_argument("--budget", type=float, default=None, help="seconds after which no new sweep starts")
    parser.add_argument("--only", action="append", default=None, help="run only this row (repeatable)")
    parser.add_argument("--fail", default=None, help="make the row of this name fail on purpose (tests)")
    parser.add_argument("--crash", default=None, help="kill the process in the row of this name (tests)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        plan = Plan(device="cpu", specs=SMOKE_SPECS, max_len=128, max_tokens=512, matmul_sizes=(256,),
                    budget_s=args.budget or 600, notes=["cpu smoke: tiny sizes, graphs are the CPU stand-in"])
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-smoke for the CPU smoke test", file=sys.stderr)
            return 2
        plan = Plan(device="cuda", specs=GPU_SPECS, max_len=512, max_tokens=8192, matmul_sizes=(4096, 8192),
                    budget_s=args.budget or 210)
    if args.only:
        unknown = set(args.only) - {s.name for s in plan.specs}
        if unknown:
            print(f"--only {sorted(unknown)}: no such row; rows: {[s.name for s in plan.specs]}", file=sys.stderr)
            return 2
        plan = dataclasses.replace(plan, specs=[s for s in plan.specs if s.name in args.only])
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        plan = dataclasses.replace(plan, sentence_transformers=False)
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or ".") / "gpu_check.json"
    started = time.perf_counter()
    torch.manual_seed(0)
    report: dict = {"environment": environment(plan), "notes": plan.notes + [__doc__], "rows": []}
    try:
        peak = matmul_peak(plan.device, "bfloat16", sizes=plan.matmul_sizes)
    except Exception as e:  # noqa: BLE001 - MFU is then unknown; every other figure still counts
        peak, report["matmul_error"] = float("nan"), f"{type(e).__name__}: {e}"
    report["matmul_bf16_flops"] = peak
    rows = report["rows"]
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for spec in plan.specs:
            print(f"row {spec.name} ...", flush=True)
            rows.append(run_row(spec, plan, peak, started, Path(tmp), fail=args.fail, crash=args.crash))
            report.update(targets=targets(rows), seconds=round(time.perf_counter() - started, 1),
                          failed=failed_rows(rows), complete=False)
            write_report(out, report)  # after every row: an error later keeps this one
    report["complete"] = True
    write_report(out, report)
    print(f"bf16 matmul: {peak / 1e12:.1f} TFLOP/s measured on {report['environment'].get('gpu', plan.device)}")
    print(table(rows))
    print(json.dumps(report["targets"]))
    print(f"wrote {out} in {report['seconds']} s")
    if report["failed"]:
        print(f"FAILED rows: {report['failed']} (details under rows[].error / rows[].errors in {out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
