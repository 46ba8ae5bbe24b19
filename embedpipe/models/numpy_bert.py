"""The BERT family's forward (BERT, MiniLM, BGE, E5, XLM-RoBERTa) in numpy, for a few short texts without torch.

    ids [T] (sequences back to back), lengths [B] -> hidden [T, hidden] float32

What a cold ``embedpipe search`` runs for its query: ``import torch`` alone costs about 2 s of CPU, while a
query is ten-odd tokens through a handful of layers (MiniLM: ~1 ms of matmuls). The same blocks as
embedpipe/models/bert.py, read from the same facts (BertConfig, the family's weight names:
embedpipe/models/bert_config.py; the weight files: embedpipe/models/checkpoint.py): post-LN,
x = LN(x + Attn(x)); x = LN(x + MLP(x)), everything in float32, attention one sequence at a time.
tests/test_numpy_query.py holds it to the torch encoder (cosine >= 0.99999).

``load_numpy_bert`` returns None for what it does not run (another family, an activation it lacks, bf16 or
pickled weights): the caller uses the torch encoder then.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from embedpipe.models.bert_config import BERT_FAMILY, BertConfig
from embedpipe.models.checkpoint import map_names, weight_files

# erf, Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): numpy has none, and scipy's import costs ~0.6 s
_ERF_P, _ERF_A = 0.3275911, (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(x: np.ndarray) -> np.ndarray:
    a = np.abs(x)
    t = 1.0 / (1.0 + _ERF_P * a)
    poly = t * (_ERF_A[0] + t * (_ERF_A[1] + t * (_ERF_A[2] + t * (_ERF_A[3] + t * _ERF_A[4]))))
    return np.sign(x) * (1.0 - poly * np.exp(-a * a))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x * np.float32(1 / np.sqrt(2.0))))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2 / np.pi)) * (x + np.float32(0.044715) * x ** 3)))


# config.json `hidden_act` -> function: the names of embedpipe.models.layers.ACTIVATIONS (a test pins the match)
NUMPY_ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "gelu": _gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": lambda x: np.maximum(x, 0),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "swish": lambda x: x / (1 + np.exp(-x)),
}


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)  # [T, 1]
    var = ((x - mean) ** 2).mean(-1, keepdims=True)  # [T, 1]
    return (x - mean) / np.sqrt(var + np.float32(eps)) * weight + bias  # [T, hidden]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@dataclass
class NumpyBert:
    """A BERT-family encoder's weights as float32 arrays under our names (embed.*, layers.{i}.*)."""

    config: BertConfig
    weights: dict[str, np.ndarray]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def __call__(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """ids [T] int64 back to back, lengths [B] -> hidden [T, hidden] float32."""
        cfg, w = self.config, self.weights
        positions = np.concatenate([np.arange(n) for n in lengths]) + cfg.position_offset  # [T]
        x = w["embed.tok.weight"][ids] + w["embed.pos.weight"][positions] + w["embed.token_type.weight"][0]
        x = _layer_norm(x, w["embed.norm.weight"], w["embed.norm.bias"], cfg.layer_norm_eps)  # [T, hidden]
        starts = np.concatenate([[0], np.cumsum(lengths)])  # [B+1]
        act = NUMPY_ACTIVATIONS[cfg.hidden_act]
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            attn = self._attention(x, starts, prefix=p)  # [T, hidden]
            x = _layer_norm(x + attn, w[p + "attn_norm.weight"], w[p + "attn_norm.bias"], cfg.layer_norm_eps)
            h = act(x @ w[p + "mlp.up.weight"].T + w[p + "mlp.up.bias"])  # [T, intermediate]
            h = h @ w[p + "mlp.down.weight"].T + w[p + "mlp.down.bias"]  # [T, hidden]
            x = _layer_norm(x + h, w[p + "mlp_norm.weight"], w[p + "mlp_norm.bias"], cfg.layer_norm_eps)
        return x.astype(np.float32, copy=False)

    def _attention(self, x: np.ndarray, starts: np.ndarray, *, prefix: str) -> np.ndarray:
        cfg, w = self.config, self.weights
        T, H, D = x.shape[0], cfg.num_heads, cfg.head_dim
        qkv = (x @ w[prefix + "attn.qkv.weight"].T + w[prefix + "attn.qkv.bias"]).reshape(T, 3, H, D)  # rows q, k, v
        out = np.empty((T, H, D), dtype=np.float32)
        scale = np.float32(1 / np.sqrt(D))
        for a, b in zip(starts[:-1], starts[1:]):  # one sequence at a time: bidirectional within it
            q, k, v = (qkv[a:b, j].transpose(1, 0, 2) for j in range(3))  # 3 x [H, L, D]
            probs = _softmax((q @ k.transpose(0, 2, 1)) * scale)  # [H, L, L]
            out[a:b] = (probs @ v).transpose(1, 0, 2)  # [L, H, D]
        return out.reshape(T, H * D) @ w[prefix + "attn.out.weight"].T + w[prefix + "attn.out.bias"]  # [T, hidden]


def load_numpy_bert(model_dir: Path) -> NumpyBert | None:
    """The directory's BERT-family encoder in numpy, or None when this forward does not run it (the torch one does)."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return None
    hf = json.loads(config_path.read_text())
    family = BERT_FAMILY.get(hf.get("model_type"))
    if family is None or hf.get("hidden_act", "gelu") not in NUMPY_ACTIVATIONS:
        return None
    config_class, strip_prefixes, weight_map = family
    try:
        config = config_class.from_hf_config(hf)
    except (KeyError, ValueError):  # the torch loader says what is wrong with it
        return None
    files = weight_files(model_dir)
    if not files:
        return None
    from safetensors.numpy import load_file

    state: dict[str, np.ndarray] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except (TypeError, ValueError):  # a dtype numpy has no type for (bfloat16)
            return None
    weights, unknown = map_names(state, weight_map=weight_map, strip_prefixes=strip_prefixes, fuse=np.concatenate)
    if unknown:
        return None  # the torch loader names the unknown keys
    weights = {k: v.astype(np.float32, copy=False) for k, v in weights.items()}
    if not _complete(weights, config):
        return None
    return NumpyBert(config=config, weights=weights)


def _complete(weights: dict[str, np.ndarray], config: BertConfig) -> bool:
    """Every tensor the forward reads is there, with the shape config.json gives."""
    h, i = config.hidden_size, config.intermediate_size
    shapes = {"embed.tok.weight": (config.vocab_size, h), "embed.pos.weight": (config.max_positions, h),
              "embed.token_type.weight": (config.type_vocab_size, h), "embed.norm.weight": (h,), "embed.norm.bias": (h,)}
    for n in range(config.num_layers):
        p = f"layers.{n}."
        shapes.update({p + "attn.qkv.weight": (3 * h, h), p + "attn.qkv.bias": (3 * h,), p + "attn.out.weight": (h, h),
                       p + "attn.out.bias": (h,), p + "attn_norm.weight": (h,), p + "attn_norm.bias": (h,),
                       p + "mlp.up.weight": (i, h), p + "mlp.up.bias": (i,), p + "mlp.down.weight": (h, i),
                       p + "mlp.down.bias": (h,), p + "mlp_norm.weight": (h,), p + "mlp_norm.bias": (h,)})
    return all(name in weights and weights[name].shape == shape for name, shape in shapes.items())
