"""How close the CPU encoder is to its GEMM floor: the CPU attention backends on the packer's real batches, the
attention's share of a whole step, and the linears alone for the same tokens.

    .venv/bin/python scripts/bench_attention.py --rows 1000 --threads 2 [--dtype float32]

Prints, interleaved and best of ``--repeats``:
  - each CPU attention backend (kernels/cpu.py) over one layer of every batch, and its max error vs `reference`;
    with ``--bands``, `grouped` at other length bands; with ``--flex``, torch's compiled flex_attention beside them
    (its compile and block-mask times apart);
  - `grouped`'s SDPA calls in that layer pass, by their group's padded length: calls, seconds, GFLOP/s;
  - the whole embed as shipped, and with the attention replaced by a copy of q (the step without attention:
    not a model, a measurement);
  - the model's linears alone on the same batch shapes (the GEMM floor), and the ceiling it sets: the engine
    cannot beat it, whatever is fused or removed around the GEMMs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from bench_sample import add_sample_arguments, cpu_description, load_texts

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
BACKENDS = ("grouped", "matmul", "sdpa")  # the CPU ones; `reference` is the ground truth


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sample_arguments(p, rows=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3, help="timed passes (best kept), interleaved")
    p.add_argument("--iters", type=int, default=10, help="attention-only passes (best kept)")
    p.add_argument("--flex", action="store_true",
                   help="also time torch's flex_attention, compiled (inductor's CPU template), on each batch's "
                        "packed tokens with a document mask: not a backend of the package, a measured alternative")
    p.add_argument("--flex-block", type=int, default=128, help="flex_attention's block size (its default 128)")
    p.add_argument("--bands", default="",
                   help="comma-separated length bands to time `grouped` at besides its own (kernels/cpu.py SDPA_BAND)")
    return p.parse_args()


def best_of(runs: dict, *, repeats: int) -> dict[str, float]:
    """Seconds of each named callable, best of ``repeats``, interleaved."""
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - began)
    return best


def flex_pass(inputs: list, *, block: int):
    """A callable running torch's flex_attention (compiled, dynamic shapes) on every batch's packed [1, H, T, D]
    tokens, a document mask keeping each token within its sequence; returns each batch's [T, H, D]. Its compile and
    its block masks (built once per batch, as a model would per forward) are timed and printed, not in the pass."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from embedpipe.kernels.cpu import segments

    compiled = torch.compile(flex_attention, dynamic=True)
    began = time.perf_counter()
    masks = []
    for q, _, _, cu, _, _ in inputs:
        T = q.shape[0]
        doc, _ = segments(cu.long(), T)  # [T] each token's sequence
        masks.append(create_block_mask(lambda b, h, i, j, doc=doc: doc[i] == doc[j], None, None, T, T, device="cpu",
                                       BLOCK_SIZE=block))
    built = time.perf_counter() - began

    def run() -> list:
        return [compiled(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=m)[0].transpose(0, 1)
                for (q, k, v, *_), m in zip(inputs, masks)]  # [T, H, D] each

    began = time.perf_counter()
    with torch.no_grad():
        run()
    print(f"flex_attention (block {block}): block masks {built:.2f} s for {len(inputs)} batches; first pass, "
          f"compile included, {time.perf_counter() - began:.1f} s")
    return run


def main() -> int:
    args = parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from torch import nn

    from embedpipe.runtime import Encoder
    from embedpipe.runtime.cpu import OneDNNLinear

    attention = importlib.import_module("embedpipe.kernels.attention")
    torch.set_num_threads(args.threads)
    texts = load_texts(args)
    encoder = Encoder.from_options(MODEL, dtype=args.dtype, threads=args.threads)
    model, dtype = encoder.loaded.model, getattr(torch, args.dtype)
    shipped = model.attention_backend
    batches = [b for _, _, packed in encoder.prepare(texts) for b in packed]
    tokens = sum(b.num_tokens for b in batches)
    cfg = model.config
    H, D = cfg.num_heads, cfg.head_dim
    print(f"{cpu_description()}; torch {torch.__version__}, {args.threads} threads, {args.dtype}, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{len(texts):,} rows of {args.corpus.name}: {tokens:,} tokens in {len(batches)} batches; shipped "
          f"attention backend: {shipped}")

    # 1. attention alone: one layer's call on every batch, random q/k/v as views of one fused projection
    g = torch.Generator().manual_seed(args.seed)
    inputs, bands = [], [int(b) for b in args.bands.split(",") if b]
    for b in batches:
        qkv = torch.randn(b.num_tokens, 3 * H * D, generator=g).to(dtype)  # [T, 3 H D]
        q, k, v = qkv.view(b.num_tokens, 3, H, D).unbind(1)  # 3 x [T, H, D]
        plans = {name: attention.plan_attention(b.cu_seqlens, backend=name) for name in BACKENDS}  # once per batch
        plans |= {f"band {band}": attention.plan_groups(b.cu_seqlens, band=band) for band in bands}  # --bands
        inputs.append((q, k, v, b.cu_seqlens, b.max_seqlen, plans))

    def layer_pass(name: str, plan: str | None = None) -> list:  # backend `name` on its own plan or on `plan`'s
        fn = attention.BACKENDS[name]
        return [fn(q, k, v, cu_seqlens=cu, max_seqlen=m, causal=False, window=None, scale=None,
                   plan=plans.get(plan or name)) for q, k, v, cu, m, plans in inputs]

    with torch.no_grad():
        ref = layer_pass("reference")
        runs = {name: (lambda name=name: layer_pass(name)) for name in BACKENDS}
        for band in bands:
            runs[f"grouped, band {band}"] = lambda band=band: layer_pass("grouped", f"band {band}")
        if args.flex:
            runs["flex (compiled)"] = flex_pass(inputs, block=args.flex_block)
        errors = {name: max((o.float() - r.float()).abs().max().item() for o, r in zip(run(), ref))
                  for name, run in runs.items()}
        alone = best_of(runs, repeats=args.iters)
    print("\n| attention backend | one layer, every batch | per token per layer | max error vs reference |")
    print("| --- | ---: | ---: | ---: |")
    for name in runs:
        print(f"| {name}{' (shipped)' if name == shipped else ''} | {alone[name] * 1e3:.1f} ms | "
              f"{alone[name] * 1e6 / tokens:.2f} us | {errors[name]:.1e} |")

    # 1b. grouped's SDPA calls in one layer pass, by padded length (torch's CPU flash kernel, timed per call)
    bands = {"L <= 48": 48, "L 64-128": 128, "L 144+": None}  # label -> longest padded length it holds
    calls = {label: [0, 0.0, 0.0] for label in bands}  # label -> calls, seconds, FLOPs
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def timed_sdpa(q4, k4, v4, **kwargs):  # [n, H, L, D]
        began = time.perf_counter()
        out = sdpa(q4, k4, v4, **kwargs)
        n, h, L, d = q4.shape
        label = next(b for b, top in bands.items() if top is None or L <= top)
        calls[label][0] += 1
        calls[label][1] += time.perf_counter() - began
        calls[label][2] += 4 * n * h * L * L * d  # QK^T and PV
        return out

    torch.nn.functional.scaled_dot_product_attention = timed_sdpa
    try:
        with torch.no_grad():
            began = time.perf_counter()
            layer_pass("grouped")
            grouped_s = time.perf_counter() - began
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    in_sdpa = sum(c[1] for c in calls.values())
    print(f"\n`grouped`, one layer pass: {grouped_s * 1e3:.1f} ms, {in_sdpa / grouped_s:.0%} of it in SDPA calls")
    print("| groups | SDPA calls | seconds | share of the SDPA time | GFLOP | GFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, (n, seconds, flops) in calls.items():
        print(f"| {label} | {n} | {seconds:.3f} | {seconds / max(in_sdpa, 1e-9):.0%} | {flops / 1e9:.2f} | "
              f"{flops / max(seconds, 1e-9) / 1e9:.0f} |")

    # 2. the whole embed, and the same step with the attention replaced by a copy of q
    def no_attention(q, k, v, **_):
        return q.clone()  # [T, H, D]: what the layers after it read, without the work

    def embed_with(fn):
        def run():
            attention.BACKENDS[shipped] = fn
            try:
                encoder.embed(texts)
            finally:
                attention.BACKENDS[shipped] = real
        return run

    real = attention.BACKENDS[shipped]
    encoder.embed(texts[:64])

    # 3. the GEMM floor: the model's own linear modules (oneDNN's where the runtime put them), on each batch's
    # token count
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, OneDNNLinear))]
    kind = type(linears[0]).__name__
    xs = {b.num_tokens: {m.weight.shape[1]: torch.randn(b.num_tokens, m.weight.shape[1], generator=g).to(dtype)
                         for m in linears} for b in batches}

    def gemms() -> None:
        for b in batches:
            for m in linears:
                m(xs[b.num_tokens][m.weight.shape[1]])

    with torch.no_grad():
        whole = best_of({"shipped": embed_with(real), "no attention": embed_with(no_attention), "linears": gemms},
                        repeats=args.repeats)
    flops = sum(2 * m.weight.numel() for m in linears) * tokens
    print("\n| step | seconds | tokens/s | share of the shipped step |")
    print("| --- | ---: | ---: | ---: |")
    for name, label in (("shipped", "whole embed as shipped (tokenize, pack, encode, pool)"),
                        ("no attention", "the same, attention replaced by a copy of q"),
                        ("linears", f"the linears alone ({kind}, {flops / whole['linears'] / 1e9:.0f} GFLOP/s)")):
        print(f"| {label} | {whole[name]:.2f} | {tokens / whole[name]:,.0f} | {whole[name] / whole['shipped']:.0%} |")
    print(f"\nThe GEMM floor: at most {whole['shipped'] / whole['linears']:.2f}x the shipped engine's tokens/s "
          f"on this machine, if everything besides the linears cost nothing.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
