"""XLM-RoBERTa / RoBERTa encoders (multilingual-e5, bge-m3, paraphrase-multilingual...) on packed tokens.

The same post-LN blocks as BERT; only positions differ. transformers numbers a RoBERTa
sequence's tokens from padding_idx + 1 (`create_position_ids_from_input_ids`), so
position row = 0-based position + pad_token_id + 1, and the first pad_token_id + 1 rows of
the table are never read: XLM-R's 514 rows give 512 usable positions (`max_seq_len`).
Packed sequences hold no pad tokens, so the cumsum over non-pad tokens is just the position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from embedpipe.models.bert import BertConfig, BertModel
from embedpipe.models.registry import register


@dataclass(frozen=True)
class XLMRobertaConfig(BertConfig):
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> XLMRobertaConfig:
        cfg = super().from_hf_config(hf)
        offset = hf.get("pad_token_id", 1) + 1  # RoBERTa's padding_idx is pad_token_id
        if cfg.max_positions <= offset:
            raise ValueError(
                f"max_position_embeddings {cfg.max_positions} leaves no position after RoBERTa's offset "
                f"pad_token_id + 1 = {offset}; check config.json"
            )
        return dataclasses.replace(cfg, position_offset=offset)


@register("xlm-roberta", "roberta")
class XLMRobertaModel(BertModel):
    config_class: ClassVar[type] = XLMRobertaConfig
    # BERT's table (the "roberta." prefix is stripped there), plus the MLM head of *ForMaskedLM dumps
    WEIGHT_MAP: ClassVar[dict[str, str | tuple[str, int] | None]] = {**BertModel.WEIGHT_MAP, "lm_head.*": None}
