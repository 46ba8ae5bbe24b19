"""XLM-RoBERTa / RoBERTa encoders (multilingual-e5, bge-m3, paraphrase-multilingual...) on packed tokens.

The same post-LN blocks as BERT; only positions differ (XLMRobertaConfig, embedpipe/models/bert_config.py):
position row = 0-based position + pad_token_id + 1, and the first pad_token_id + 1 rows of the table are
never read: XLM-R's 514 rows give 512 usable positions (`max_seq_len`). Packed sequences hold no pad tokens,
so the cumsum over non-pad tokens is just the position.
"""

from __future__ import annotations

from typing import ClassVar

from embedpipe.models.bert import BertModel
from embedpipe.models.bert_config import XLM_ROBERTA_WEIGHT_MAP, XLMRobertaConfig
from embedpipe.models.registry import register

__all__ = ["XLMRobertaConfig", "XLMRobertaModel"]


@register("xlm-roberta", "roberta")
class XLMRobertaModel(BertModel):
    config_class: ClassVar[type] = XLMRobertaConfig
    WEIGHT_MAP: ClassVar[dict[str, str | tuple[str, int] | None]] = XLM_ROBERTA_WEIGHT_MAP
