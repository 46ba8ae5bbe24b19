"""Reading sentence-transformers directories, and our head against sentence-transformers."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from embedpipe.models import load_model, read_st_spec
from tests.model_helpers import cosine, pack, random_sequences, save_tiny_bert


def st_modules():
    try:
        from sentence_transformers.sentence_transformer import modules  # sentence-transformers >= 6
    except ImportError:
        from sentence_transformers import models as modules
    return modules


def test_minilm_spec(minilm_dir):
    spec = read_st_spec(minilm_dir)  # modules.json lists 2_Normalize, whose folder does not exist
    assert spec.pooling == "mean" and spec.normalize and spec.max_seq_len == 256
    assert spec.prompts == {} and spec.default_prompt_name is None and spec.dense == []
    assert not spec.do_lower_case and spec.transformer_dir == ""


def test_plain_hf_dir_spec(tmp_path):
    save_tiny_bert(tmp_path)
    spec = read_st_spec(tmp_path)
    assert spec.pooling is None and not spec.normalize and spec.max_seq_len is None and spec.dense == []


@pytest.fixture(scope="module")
def st_dense_dir(tmp_path_factory):
    """A tiny BERT wrapped as Transformer -> Pooling(cls) -> Dense(32->16, tanh) -> Normalize, with prompts."""
    from sentence_transformers import SentenceTransformer

    m = st_modules()
    root = tmp_path_factory.mktemp("st")
    save_tiny_bert(root / "hf")
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st = SentenceTransformer(
            modules=[m.Transformer(str(root / "hf")), m.Pooling(32, pooling_mode="cls"),
                     m.Dense(32, 16, activation_function=torch.nn.Tanh()), m.Normalize()],
            prompts={"query": "query: ", "passage": "passage: "}, default_prompt_name="query", device="cpu",
        )
        st.save(str(root / "st"))
    return root / "st", st.eval()


def test_synthetic_st_spec(st_dense_dir):
    spec = read_st_spec(st_dense_dir[0])
    assert spec.pooling == "cls" and spec.normalize
    assert spec.prompts["query"] == "query: " and spec.default_prompt_name == "query"
    (dense,) = spec.dense
    assert (dense.in_features, dense.out_features, dense.bias, dense.activation) == (32, 16, True, "tanh")
    folder = next(p for p in st_dense_dir[0].iterdir() if p.name.endswith("_Dense"))
    torch.testing.assert_close(dense.weight, load_file(folder / "model.safetensors")["linear.weight"])


def test_head_with_dense_matches_sentence_transformers(st_dense_dir):
    path, st = st_dense_dir
    lm = load_model(path, attention_backend="sdpa")
    head = lm.build_head()
    assert lm.dim == 16 and head.pooling == "cls" and head.normalize
    seqs = random_sequences((1, 3, 17, 40, 64))
    ids, pos, cu, max_len = pack(seqs)
    with torch.no_grad():
        ours = head(lm.model(ids, pos, cu, max_len), cu)  # [5, 16]
        padded = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)  # [5, 64]
        mask = (torch.arange(max_len)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]).long()
        ref = st({"input_ids": padded, "attention_mask": mask, "token_type_ids": torch.zeros_like(padded)})
    ref = ref["sentence_embedding"]
    assert ours.shape == ref.shape == (5, 16)
    assert cosine(ours, ref).min() >= 1 - 1e-5
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def _st_dir(tmp_path, pooling_cfg: dict, extra_modules=()) -> None:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_cfg))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               *extra_modules]
    (tmp_path / "modules.json").write_text(json.dumps(modules))


def test_old_style_pooling_flags(tmp_path):
    _st_dir(tmp_path, {"word_embedding_dimension": 32, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False})
    assert read_st_spec(tmp_path).pooling == "last"


def test_unsupported_pooling_is_refused(tmp_path):
    _st_dir(tmp_path, {"word_embedding_dimension": 32, "pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match=r"pooling \['max'\] is not supported"):
        read_st_spec(tmp_path)


def test_pickled_dense_is_refused(tmp_path):
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    _st_dir(tmp_path, {"pooling_mode": "mean"}, [dense])
    (tmp_path / "2_Dense").mkdir()
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 32, "out_features": 8, "bias": False}))
    torch.save({"linear.weight": torch.zeros(8, 32)}, tmp_path / "2_Dense" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"model\.allow_pickle"):
        read_st_spec(tmp_path)
    spec = read_st_spec(tmp_path, allow_pickle=True)
    assert spec.dense[0].activation == "identity" and spec.dense[0].bias_value is None
