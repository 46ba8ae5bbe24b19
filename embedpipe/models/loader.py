"""Load a model directory: config.json -> registry class -> safetensors through its mapping table.

Nothing from the model directory is executed; pickles are refused unless the job allows them.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from embedpipe.kernels import select_backend
from embedpipe.models.checkpoint import map_names, weight_files
from embedpipe.models.head import EmbeddingHead, build_head
from embedpipe.models.registry import model_class
from embedpipe.models.st import STSpec, dense_dim, read_st_spec

@dataclass
class LoadedModel:
    model: nn.Module  # forward(input_ids [T], positions [T], cu_seqlens [B+1], max_seqlen) -> [T, hidden]
    spec: STSpec  # what the sentence-transformers modules ask for (pooling, Dense, normalize, prompts)
    config: Any  # the family's config dataclass, e.g. BertConfig
    path: Path
    hidden_size: int
    dim: int  # output dimension after the Dense layers
    max_positions: int  # longest sequence the model's positions cover (model.max_seq_len), tokens
    device: str
    dtype: torch.dtype

    def flops_per_token(self, seq_len: float) -> float:
        """Encoder forward FLOPs per token at this sequence length: the family's rule on its config
        (e.g. BertConfig.flops_per_token). The head (pool, Dense, normalize) runs once per sequence
        and is not counted."""
        return self.config.flops_per_token(seq_len)

    def build_head(self, *, pooling: str = "auto", normalize: bool | str = "auto", dim: int | None = None,
                   skip_tokens: int = 0) -> EmbeddingHead:
        if dim is not None and dim > self.dim:
            raise ValueError(f"output.dim {dim} exceeds the model's dimension {self.dim}: set it to at most {self.dim}")
        head = build_head(
            self.spec, pooling=pooling, normalize=normalize, default_pooling=self.config.default_pooling, dim=dim,
            skip_tokens=skip_tokens,
        )
        return head.to(self.device)


def load_state_dict_into(
    model: nn.Module, state: Mapping[str, Tensor], *, dtype: torch.dtype | None = None, device: str | None = None
) -> None:
    """Map checkpoint names through type(model).WEIGHT_MAP, fuse stacked shards, load with
    assign=True (works on a meta-device model), and check that every checkpoint key was used
    or dropped and every parameter and buffer was filled."""
    cls = type(model)
    ours, unknown = map_names(state, weight_map=cls.WEIGHT_MAP, strip_prefixes=cls.STRIP_PREFIXES, fuse=torch.cat)
    if unknown:
        raise ValueError(
            f"{cls.__name__}: checkpoint keys not in its WEIGHT_MAP (neither mapped nor dropped): {sorted(unknown)}. "
            "Is this the right model_type for the checkpoint? If they are harmless extras, add them "
            f"to {cls.__name__}.WEIGHT_MAP with None."
        )
    expected = dict(model.state_dict(keep_vars=True))
    wrong = {n: (tuple(t.shape), tuple(expected[n].shape)) for n, t in ours.items() if n in expected and t.shape != expected[n].shape}
    if wrong:
        raise ValueError(f"{cls.__name__}: checkpoint shapes differ from config.json (got, expected): {wrong}")
    for name, t in ours.items():
        ours[name] = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
    missing, unexpected = model.load_state_dict(ours, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"{cls.__name__}.WEIGHT_MAP produced names the model does not have: {sorted(unexpected)}")
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing or empty:
        raise ValueError(f"{cls.__name__}: checkpoint does not provide {sorted(set(missing) | set(empty))}")
    model.eval().requires_grad_(False)


def read_weights(model_dir: Path, *, allow_pickle: bool = False) -> dict[str, Tensor]:
    """All tensors of a checkpoint directory (single file, or shards listed in the index)."""
    files = weight_files(model_dir)
    if files:
        return {k: v for f in files for k, v in load_file(f).items()}
    pickles = sorted(model_dir.glob("pytorch_model*.bin"))
    if pickles and allow_pickle:
        return {k: v for f in pickles for k, v in torch.load(f, map_location="cpu", weights_only=True, mmap=True).items()}
    if pickles:
        raise ValueError(
            f"{model_dir} has only {[p.name for p in pickles]} (pickle), no *.safetensors. embedpipe reads "
            "safetensors only by default: convert the checkpoint, or set `model.allow_pickle: true` in the "
            "job to read it with torch.load(weights_only=True)."
        )
    raise ValueError(f"{model_dir} has no weights (*.safetensors); is this a model directory?")


INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "xavier_uniform_",
                  "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


@contextmanager
def _no_init():
    """torch.nn.init's fills as no-ops while a model is built on the meta device: its weights come from the
    checkpoint, and a meta tensor's ``normal_`` goes through torch's reference ops, whose first use imports
    torch._dynamo (~2 s: what a one-query ``embedpipe search`` would spend on it)."""
    saved = {name: getattr(nn.init, name) for name in INIT_FUNCTIONS if hasattr(nn.init, name)}
    try:
        for name in saved:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attention_backend: str = "auto",
    allow_pickle: bool = False,
) -> LoadedModel:
    """Build the registered class for config.json's model_type and fill it from the directory."""
    root = Path(path)
    spec = read_st_spec(root, allow_pickle=allow_pickle)
    model_dir = root / spec.transformer_dir
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} has no config.json; point model.path at a Hugging Face / sentence-transformers directory")
    hf = json.loads((model_dir / "config.json").read_text())
    cls = model_class(hf.get("model_type", "<missing>"))
    config = cls.config_class.from_hf_config(hf)
    backend = select_backend(device=device, requested=attention_backend, dtype=dtype)
    with torch.device("meta"), _no_init():
        model = cls(config, attention_backend=backend)
    load_state_dict_into(model, read_weights(model_dir, allow_pickle=allow_pickle), dtype=dtype, device=device)
    width = model.hidden_size
    for i, d in enumerate(spec.dense):
        if d.in_features != width:
            raise ValueError(f"{root}: Dense layer {i} expects {d.in_features} inputs but receives {width}")
        width = d.out_features
    return LoadedModel(
        model=model, spec=spec, config=config, path=root, hidden_size=model.hidden_size,
        dim=dense_dim(spec, model.hidden_size), max_positions=model.max_seq_len, device=device, dtype=dtype,
    )
