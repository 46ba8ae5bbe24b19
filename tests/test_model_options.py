"""Job options against sentence-transformers on the real packaged all-MiniLM-L6-v2:
prompts (literal, named, default, include_prompt=false), lower-casing, Matryoshka output.dim,
and the job errors for each."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from embedpipe.config import JobError, load_job
from embedpipe.models import pool
from embedpipe.preflight import preflight
from embedpipe.runtime import Encoder
from tests.conftest import QUICKSTART, write_job

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "A man is eating a piece of bread.",
    "UPPERCASE TEXT and MixedCase Words",
    "Paris is the capital and most populous city of France.",
    "def f(x):\n    return x ** 2  # squares",
    "Emojis 🚀🔥 and symbols: ∑ ∫ √ ≈ ≠",
    " ".join(f"word{i} and more text number {i}" for i in range(120)),  # > 256 tokens with the prompt: truncated
]
PROMPTS = {"query": "query: ", "passage": "Represent this passage for retrieval: ", "empty": ""}


def cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def variant_dir(src: Path, dst: Path, *, pooling: dict | None = None, st_config: dict | None = None,
                sbert: dict | None = None) -> Path:
    """The MiniLM directory with some sentence-transformers JSON files replaced (weights symlinked)."""
    dst.mkdir()
    for item in src.iterdir():
        if item.name != "1_Pooling":
            (dst / item.name).symlink_to(item)
    (dst / "1_Pooling").mkdir()
    base = json.loads((src / "1_Pooling" / "config.json").read_text())
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({**base, **(pooling or {})}))
    for name, content in (("config_sentence_transformers.json", st_config), ("sentence_bert_config.json", sbert)):
        if content is not None:
            (dst / name).unlink()
            (dst / name).write_text(json.dumps(content))
    return dst


@pytest.fixture(scope="module")
def st_model():
    def load(path):
        from sentence_transformers import SentenceTransformer

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return SentenceTransformer(str(path), device="cpu")

    return load


@pytest.fixture(scope="module")
def prompted_dir(minilm_dir, tmp_path_factory):
    """MiniLM with named prompts and a default prompt; prompt tokens left out of the mean."""
    return variant_dir(minilm_dir, tmp_path_factory.mktemp("v") / "prompted", pooling={"include_prompt": False},
                       st_config={"prompts": PROMPTS, "default_prompt_name": "query"})


def test_literal_prompt_matches_sentence_transformers(minilm_dir, st_model):
    enc = Encoder.from_options(str(minilm_dir), prompt="query: ")
    assert enc.tokenizer.prompt_length == 3  # [CLS] query : ([SEP] is not counted)
    tok = enc.tokenizer(TEXTS)
    assert tok.truncated[-1] and tok.lengths[-1] == 256  # the prompt counts towards max_seq_len
    ref = st_model(minilm_dir).encode(TEXTS, prompt="query: ")
    ours = enc.embed(TEXTS)
    assert cos_rows(ours, ref).min() >= 0.99999
    plain = Encoder.from_options(str(minilm_dir)).embed(TEXTS)
    assert cos_rows(ours, plain).max() < 0.9999  # the prompt did change the vectors


def test_named_default_and_excluded_prompt_match_sentence_transformers(prompted_dir, st_model):
    st = st_model(prompted_dir)
    assert st.default_prompt_name == "query" and not st[1].include_prompt
    for settings, st_kwargs in [
        ({}, {}),  # the model's default_prompt_name ("query") applies
        ({"prompt_name": "passage"}, {"prompt_name": "passage"}),
        ({"prompt": "custom prefix: "}, {"prompt": "custom prefix: "}),
        ({"prompt": ""}, {"prompt": ""}),  # an explicit empty prompt switches the default off
    ]:
        enc = Encoder.from_options(str(prompted_dir), **settings)
        ours, ref = enc.embed(TEXTS), st.encode(TEXTS, **st_kwargs)
        assert cos_rows(ours, ref).min() >= 0.99999, settings
    enc = Encoder.from_options(str(prompted_dir), prompt_name="passage")
    assert enc.prompt == PROMPTS["passage"] and enc.tokenizer.prompt_length > 5


def test_excluded_prompt_is_what_pooling_skips(prompted_dir):
    """include_prompt=false: the mean over the text tokens only, the prompt still attended to."""
    enc = Encoder.from_options(str(prompted_dir), prompt_name="passage", normalize=False)
    tok = enc.tokenizer(TEXTS[:3])
    batch = enc.packer(tok)[0]
    with torch.inference_mode():
        hidden = enc.loaded.model(batch.input_ids, batch.positions, batch.cu_seqlens, batch.max_seqlen)
        got = enc.head(hidden, batch.cu_seqlens)
    cu, p = batch.cu_seqlens.tolist(), enc.tokenizer.prompt_length
    assert enc.head.skip_tokens == p > 5
    want = torch.stack([hidden[s + p:e].mean(0) for s, e in zip(cu[:-1], cu[1:])])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_pool_skip_edge_cases():
    hidden = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 2)  # token i has value i
    cu = torch.tensor([0, 4, 6, 10], dtype=torch.int32)
    skip = 2  # the prompt's tokens; sequence 1 is all prompt
    mean = pool(hidden, cu, mode="mean", skip=skip)[:, 0].tolist()
    assert mean == [2.5, 0.0, 8.5]  # sentence-transformers: sum 0 / clamp(0, 1e-9) = 0
    assert pool(hidden, cu, mode="cls", skip=skip)[:, 0].tolist() == [2.0, 4.0, 8.0]
    assert pool(hidden, cu, mode="last", skip=skip)[:, 0].tolist() == [3.0, 5.0, 9.0]
    assert pool(hidden, cu, mode="mean", skip=0)[:, 0].tolist() == [1.5, 4.5, 7.5]


def test_lower_case_config_matches_sentence_transformers(minilm_dir, tmp_path, st_model):
    path = variant_dir(minilm_dir, tmp_path / "lower", sbert={"max_seq_length": 128, "do_lower_case": True})
    texts = ["İstanbul and ÀÉÎ", "QUERY: WHAT IS THIS?", TEXTS[-1]]
    enc = Encoder.from_options(str(path), prompt="Query: ")
    assert enc.max_seq_len == 128 and enc.tokenizer.lower_case
    ours, ref = enc.embed(texts), st_model(path).encode(texts, prompt="Query: ")
    assert cos_rows(ours, ref).min() >= 0.99999


@pytest.mark.parametrize("dim", [64, 256, 384])
def test_output_dim_matches_sentence_transformers_truncate_dim(minilm_dir, st_model, dim):
    ours = Encoder.from_options(str(minilm_dir), dim=dim).embed(TEXTS)
    ref = st_model(minilm_dir).encode(TEXTS, truncate_dim=dim, normalize_embeddings=True)
    assert ours.shape == ref.shape == (len(TEXTS), dim)
    assert cos_rows(ours, ref).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # renormalised after truncation


def test_output_dim_without_normalize_is_a_plain_truncation(minilm_dir):
    full = Encoder.from_options(str(minilm_dir), normalize=False).embed(TEXTS)
    cut = Encoder.from_options(str(minilm_dir), normalize=False, dim=32).embed(TEXTS)
    np.testing.assert_array_equal(cut, full[:, :32])


def test_batch_invariance_with_prompt_excluded(prompted_dir):
    enc = Encoder.from_options(str(prompted_dir), prompt_name="passage", dim=128)
    others = [f"Filler sentence {i} " + "with more words " * (i % 7) for i in range(40)]
    alone = enc.embed([TEXTS[4]])[0]
    packed = enc.embed(others[:20] + [TEXTS[4]] + others[20:])[20]
    assert np.abs(alone - packed).max() <= 1e-6


# ---- dtypes: layer norms, softmax and pooling accumulate in fp32 ----


@pytest.mark.parametrize("dtype, norm_input", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_low_precision_accumulates_in_fp32(minilm_dir, dtype, norm_input):
    """bf16's norms take the input as it is (torch's kernel keeps fp32 statistics: tests/test_layers.py), fp16's
    are upcast first on CPU; the head pools in fp32 and the vectors stay within the bar of the fp32 model's."""
    seen: dict[str, torch.dtype] = {}
    orig_ln = torch.nn.functional.layer_norm

    def layer_norm(x, *args, **kwargs):
        seen["layer_norm"] = x.dtype
        return orig_ln(x, *args, **kwargs)

    enc = Encoder.from_options(str(minilm_dir), dtype=str(dtype).removeprefix("torch."))
    tok = enc.tokenizer(TEXTS)
    batch = enc.packer(tok)[0]
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "layer_norm", layer_norm)
        hidden = enc.loaded.model(batch.input_ids, batch.positions, batch.cu_seqlens, batch.max_seqlen)
    assert hidden.dtype == dtype and seen["layer_norm"] == norm_input
    assert enc.head(hidden, batch.cu_seqlens).dtype == torch.float32
    fp32 = Encoder.from_options(str(minilm_dir)).embed(TEXTS)
    assert cos_rows(enc.embed(TEXTS), fp32).min() >= 0.999


# ---- job errors ----


def _job(tmp_path, **model_and_output):
    model = {"path": "sentence-transformers/all-MiniLM-L6-v2", **model_and_output.get("model", {})}
    output = {"path": str(tmp_path / "out"), **model_and_output.get("output", {})}
    return write_job(tmp_path / "job.yaml", input={"path": str(QUICKSTART)}, model=model, output=output)


def test_prompt_and_prompt_name_together_is_a_job_error(tmp_path, minilm_dir):
    with pytest.raises(JobError) as err:
        load_job(_job(tmp_path, model={"prompt": "q: ", "prompt_name": "query"}))
    assert err.value.field_path == "model.prompt_name" and "only one" in str(err.value)


def test_unknown_prompt_name_lists_the_available_ones(tmp_path, prompted_dir):
    with pytest.raises(JobError) as err:  # checked against the model in preflight (config.py is the schema alone)
        preflight(load_job(_job(tmp_path, model={"path": str(prompted_dir), "prompt_name": "qeury"})))
    assert err.value.field_path == "model.prompt_name"
    assert "'query', 'passage', 'empty'" in str(err.value)
    with pytest.raises(JobError, match="the model defines no prompts"):
        preflight(load_job(_job(tmp_path, model={"prompt_name": "query"})))
    plan = preflight(load_job(_job(tmp_path, model={"path": str(prompted_dir), "prompt_name": "passage"})))
    assert plan.model.prompts["passage"] == PROMPTS["passage"]


def test_output_dim_above_the_model_dim_is_a_job_error(tmp_path, minilm_dir):
    with pytest.raises(JobError) as err:
        preflight(load_job(_job(tmp_path, output={"dim": 512})))
    assert err.value.field_path == "output.dim" and "384" in str(err.value) and "fix:" in str(err.value)
    plan = preflight(load_job(_job(tmp_path, output={"dim": 384, "dtype": "binary"})))
    assert plan.model.dim == plan.model.vector_dim == 384
    with pytest.raises(ValueError, match="exceeds the model's dimension 384"):
        Encoder.from_options(str(minilm_dir), dim=385)
