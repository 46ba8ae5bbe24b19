"""Read a sentence-transformers directory (modules.json and its module folders) into an STSpec.

Only configuration and safetensors weights are read; no code from the directory is imported. torch is imported
only to read a Dense module's weights (``dense_weights="check"`` or ``"skip"``: a torch-free caller).
A plain Hugging Face directory (no modules.json) gives the default STSpec (no pooling chosen,
no normalization, no Dense layers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torch import Tensor

DenseWeights = Literal["read", "check", "skip"]  # what read_st_spec does with a Dense module's weights

# sentence-transformers Pooling mode -> ours. Old configs use boolean flags, new ones a name.
POOLING_FLAGS: dict[str, str] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
POOLING_NAMES: dict[str, str] = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
SUPPORTED_POOLING = ("mean", "cls", "last")

# Dense activation_function as saved (a dotted class path) -> our short name (see head.py)
DENSE_ACTIVATIONS: dict[str, str] = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.SiLU": "silu",
}


# modules.json "type" -> the module we implement: exactly the names sentence-transformers writes
# (v2-v5: the re-exported `sentence_transformers.models.X`; v5.4+ / v6: the defining module + class)
# and imports back; a look-alike such as `evil.Pooling` names code of someone else's.
MODULE_TYPES: dict[str, str] = {
    "sentence_transformers.models.Transformer": "Transformer",
    "sentence_transformers.models.Pooling": "Pooling",
    "sentence_transformers.models.Dense": "Dense",
    "sentence_transformers.models.Normalize": "Normalize",
    "sentence_transformers.base.modules.transformer.Transformer": "Transformer",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling": "Pooling",
    "sentence_transformers.base.modules.dense.Dense": "Dense",
    "sentence_transformers.base.modules.normalize.Normalize": "Normalize",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize": "Normalize",  # v5.4-v5.x
}


@dataclass(frozen=True)
class DenseSpec:
    in_features: int
    out_features: int
    bias: bool
    activation: str  # value of DENSE_ACTIVATIONS
    weight: Tensor | None = field(repr=False)  # [out, in] float32; None unless read with dense_weights="read"
    bias_value: Tensor | None = field(default=None, repr=False)  # [out] float32


@dataclass(frozen=True)
class STSpec:
    pooling: str | None = None  # "mean" | "cls" | "last"; None: no Pooling module (model default)
    normalize: bool = False  # a Normalize module follows pooling
    max_seq_len: int | None = None  # sentence_bert_config.json max_seq_length
    do_lower_case: bool = False  # sentence_bert_config.json: lowercase text before tokenizing
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text prepended to inputs
    default_prompt_name: str | None = None
    dense: list[DenseSpec] = field(default_factory=list)  # applied after pooling, in order
    include_prompt: bool = True  # Pooling config: False means prompt tokens are left out of the pool
    transformer_dir: str = ""  # sub-folder holding config.json + weights ("" = the directory itself)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _kind(module: dict[str, Any], root: Path) -> str:
    """The module's kind from its exact type name; any other name is refused, however it ends."""
    type_name = module.get("type")
    if type_name not in MODULE_TYPES:
        raise ValueError(
            f"{root}/modules.json: module {module.get('name', module.get('idx'))!r} of type {type_name!r} is not "
            f"supported: embedpipe runs only sentence-transformers' own Transformer, Pooling, Dense and Normalize "
            f"modules, named exactly as sentence-transformers writes them (e.g. 'sentence_transformers.models.Pooling'; "
            f"all names: embedpipe.models.st.MODULE_TYPES); use a model whose modules.json lists only these, or "
            f"remove the module if the model works without it")
    return MODULE_TYPES[type_name]


def _pooling(cfg: dict[str, Any], where: Path) -> str:
    if "pooling_mode" in cfg:  # sentence-transformers >= 5: a name or a list of names
        names = cfg["pooling_mode"] if isinstance(cfg["pooling_mode"], list) else [cfg["pooling_mode"]]
        modes = [POOLING_NAMES.get(n, n) for n in names]
    else:
        modes = [mode for flag, mode in POOLING_FLAGS.items() if cfg.get(flag)]
    if len(modes) != 1 or modes[0] not in SUPPORTED_POOLING:
        raise ValueError(
            f"{where}: pooling {modes} is not supported; embedpipe pools with exactly one of "
            f"{SUPPORTED_POOLING}. Override it with the job's model pooling option if that is intended."
        )
    return modes[0]


def _dense(folder: Path, *, allow_pickle: bool, weights: DenseWeights = "read") -> DenseSpec:
    cfg = _json(folder / "config.json")
    if weights == "skip" or weights == "check" and (
            (folder / "model.safetensors").is_file() or allow_pickle and (folder / "pytorch_model.bin").is_file()):
        state = None  # not read here: the worker that builds the head reads them
    elif (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(folder / "model.safetensors")
    elif allow_pickle and (folder / "pytorch_model.bin").is_file():
        import torch

        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "missing folder"
        raise ValueError(
            f"{folder}: Dense module has no model.safetensors (found {found}); embedpipe reads "
            "safetensors only. Convert the weights, or set `model.allow_pickle: true` in the job "
            "to read pytorch_model.bin with torch.load(weights_only=True)."
        )
    act_path = cfg.get("activation_function", "torch.nn.modules.linear.Identity")
    if act_path not in DENSE_ACTIVATIONS:
        raise ValueError(f"{folder}: Dense activation {act_path!r} is not supported; known: {sorted(DENSE_ACTIVATIONS)}")
    if cfg.get("use_residual"):
        raise ValueError(f"{folder}: Dense with use_residual=true is not supported")
    bias = cfg.get("bias", True)
    spec = DenseSpec(
        in_features=cfg["in_features"],
        out_features=cfg["out_features"],
        bias=bias,
        activation=DENSE_ACTIVATIONS[act_path],
        weight=state["linear.weight"].float() if state is not None else None,
        bias_value=state["linear.bias"].float() if bias and state is not None else None,
    )
    if spec.weight is not None and tuple(spec.weight.shape) != (spec.out_features, spec.in_features):
        raise ValueError(f"{folder}: linear.weight is {tuple(spec.weight.shape)}, config says {(spec.out_features, spec.in_features)}")
    return spec


def read_st_spec(path: str | Path, *, allow_pickle: bool = False, dense_weights: DenseWeights = "read") -> STSpec:
    """Read modules.json and its Pooling / Dense / Normalize modules. Missing Normalize folders are normal.
    ``dense_weights``: "read" the Dense modules' weights (imports torch); "check" that their files are there, or
    "skip" them (their configs only, ``weight`` None; torch is not imported)."""
    root = Path(path)
    modules = json.loads((root / "modules.json").read_text()) if (root / "modules.json").is_file() else []
    pooling, normalize, dense, include_prompt, transformer_dir = None, False, [], True, ""
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind, folder = _kind(module, root), root / module.get("path", "")
        if kind == "Transformer":
            transformer_dir = module.get("path", "")
        elif kind == "Pooling":
            cfg = _json(folder / "config.json")
            pooling, include_prompt = _pooling(cfg, folder), cfg.get("include_prompt", True)
        elif kind == "Dense":
            dense.append(_dense(folder, allow_pickle=allow_pickle, weights=dense_weights))
        else:  # Normalize
            normalize = True
    sbert = _json(root / transformer_dir / "sentence_bert_config.json")
    st_cfg = _json(root / "config_sentence_transformers.json")
    return STSpec(
        pooling=pooling,
        normalize=normalize,
        max_seq_len=sbert.get("max_seq_length"),
        do_lower_case=bool(sbert.get("do_lower_case", False)),
        prompts=dict(st_cfg.get("prompts") or {}),
        default_prompt_name=st_cfg.get("default_prompt_name"),
        dense=dense,
        include_prompt=include_prompt,
        transformer_dir=transformer_dir,
    )


def dense_dim(spec: STSpec, hidden_size: int) -> int:
    """Output dimension after the Dense stack (hidden_size when there is none)."""
    return spec.dense[-1].out_features if spec.dense else hidden_size


def model_dim(root: str | Path, spec: STSpec) -> int:
    """The directory's vector dimension, from config.json and the Dense configs (no weights loaded)."""
    config = _json(Path(root) / spec.transformer_dir / "config.json")
    hidden = config.get("hidden_size") or config.get("d_model")
    if not hidden:
        raise ValueError(f"{Path(root) / spec.transformer_dir}/config.json has no hidden_size (or d_model)")
    return dense_dim(spec, int(hidden))


def resolve_prompt(spec: STSpec, *, prompt: str | None = None, prompt_name: str | None = None) -> str:
    """The prefix put before every text, as sentence-transformers' encode() picks it: an explicit
    prompt (even ""), else the named prompt, else the model's default_prompt_name, else none."""
    if prompt is not None and prompt_name is not None:
        raise ValueError(f"both a prompt {prompt!r} and a prompt_name {prompt_name!r} are given; set only one")
    if prompt is not None:
        return prompt
    if prompt_name is not None:
        if prompt_name not in spec.prompts:
            known = ", ".join(repr(k) for k in spec.prompts) or "none: the model defines no prompts"
            raise ValueError(f"{prompt_name!r} is not one of the model's prompts (available: {known})")
        return spec.prompts[prompt_name]
    if spec.default_prompt_name is not None:
        return spec.prompts.get(spec.default_prompt_name) or ""
    return ""
