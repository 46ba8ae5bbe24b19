"""What a model decides where the job says ``auto`` (pooling, longest sequence), read torch-free from config.json,
the sentence-transformers modules and the family's config class (embedpipe/models/families.py): the driver's
preflight and the workers' encoder resolve them through these same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedpipe.models.families import family_config
from embedpipe.models.st import STSpec

MAX_SEQ_LEN_CAP = 8192  # tokens a text keeps when neither the job nor the model's sentence-transformers config says


def effective_max_seq_len(requested: int | None, *, spec: STSpec, max_positions: int) -> int:
    """model.max_seq_len, else the sentence-transformers max length, else the model's positions (capped)."""
    return requested or spec.max_seq_len or min(max_positions, MAX_SEQ_LEN_CAP)


def resolve_pooling(spec: STSpec, *, pooling: str = "auto", default_pooling: str = "mean") -> str:
    """The pooling a head built with these settings uses: the job's, else the Pooling module's, else the class's."""
    return (spec.pooling or default_pooling) if pooling == "auto" else pooling


@dataclass(frozen=True)
class ModelDefaults:
    """What a model's family decides where the job says auto, read without its weights."""

    default_pooling: str  # the family's pooling when the directory has no Pooling module
    max_positions: int  # longest sequence its positions cover

    def pooling(self, spec: STSpec, requested: str = "auto") -> str:
        return resolve_pooling(spec, pooling=requested, default_pooling=self.default_pooling)

    def max_seq_len(self, spec: STSpec, requested: int | None = None) -> int:
        return effective_max_seq_len(requested, spec=spec, max_positions=self.max_positions)


def model_defaults(config_json: dict) -> ModelDefaults:
    """The family's defaults for a model from its transformer's config.json alone (ValueError: what is wrong)."""
    config = family_config(config_json)
    return ModelDefaults(default_pooling=config.default_pooling, max_positions=config.max_seq_len)
