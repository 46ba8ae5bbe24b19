"""config.json's ``model_type`` -> its family: the torch-free config class and the module of the torch encoder.

The one table of the model types embedpipe implements. The driver reads a model's facts through it without
importing torch (preflight: the model type, its default pooling and positions; the report: FLOPs per token);
`registry.model_class` imports the encoder module it names, whose ``@register`` must agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embedpipe.models.bert_config import BertConfig, XLMRobertaConfig
from embedpipe.models.modernbert_config import ModernBertConfig
from embedpipe.models.qwen3_config import BIDIRECTIONAL_MODEL_TYPES, Qwen3Config


@dataclass(frozen=True)
class Family:
    config_class: type  # from_hf_config(config.json), max_seq_len, default_pooling, flops_per_token
    module: str  # embedpipe.models.<module> registers the torch encoder for this model_type


FAMILIES: dict[str, Family] = {
    "bert": Family(BertConfig, "bert"),
    "xlm-roberta": Family(XLMRobertaConfig, "xlm_roberta"),
    "roberta": Family(XLMRobertaConfig, "xlm_roberta"),
    "modernbert": Family(ModernBertConfig, "modernbert"),
    "qwen3": Family(Qwen3Config, "qwen3"),
    **{name: Family(Qwen3Config, "qwen3") for name in sorted(BIDIRECTIONAL_MODEL_TYPES)},
}


def family(model_type: str | None) -> Family:
    """The family of config.json's ``model_type``; the error names the supported ones and the fix."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    problem = "has no model_type" if model_type is None else f"model_type {model_type!r} is not supported"
    raise ValueError(
        f"config.json {problem}; embedpipe implements {', '.join(sorted(FAMILIES))}: use a model of one of "
        f"these architectures (a fine-tune keeps its base model's model_type), or add an encoder for it with "
        f"@register in embedpipe/models")


def family_config(config_json: dict) -> Any:
    """config.json parsed by its family's config class (e.g. a BertConfig); ValueError names what is wrong."""
    model_type = config_json.get("model_type") if isinstance(config_json, dict) else None
    return family(model_type).config_class.from_hf_config(config_json)
