"""The ``transformers`` configuration of an exported ADLM-pipeline model (``AutoConfig`` of the export folder).

Not imported by ``adlm_model`` itself: ``adlm_model.interop.pretrained`` ships this file, ``modeling_adlm.py`` and
the network's modules into an export folder, and ``transformers`` imports them from there
(``trust_remote_code=True``; ``auto_map`` in ``config.json``). Besides ``modeling_adlm`` it is the only module
here that imports ``transformers``.

``config.json`` keeps the export's own layout: the ``ModelConfig`` under ``model`` (the single description of
the network) and the provenance under ``meta``; the Hugging Face keys beside them are derived from it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from transformers import PretrainedConfig

from ..config import KIND_TABLE, ModelConfig


class AdlmConfig(PretrainedConfig):
    """``model``: the ``ModelConfig`` dict; ``meta``: the export's provenance; ``adlm_kind``: the model kind."""

    model_type = "adlm"

    def __init__(self, model: dict[str, Any] | None = None, meta: dict[str, Any] | None = None,
                 adlm_kind: str | None = None, kind_fields: dict[str, bool] | None = None, **kwargs: Any) -> None:
        self.model = dict(model or {})
        self.meta = dict(meta or {})
        self.adlm_kind = adlm_kind or self.model.get("kind")
        self.kind_fields = dict(kind_fields or {})
        super().__init__(**kwargs)

    def model_config(self) -> ModelConfig:
        """The network's ``ModelConfig`` (validated). In an export folder the kinds table is not shipped: the kind's
        fields the export wrote (``kind_fields``: its defaults and capabilities) stand in for its entry."""
        if self.adlm_kind not in KIND_TABLE and self.kind_fields:
            KIND_TABLE[self.adlm_kind] = SimpleNamespace(**self.kind_fields)
        return ModelConfig.from_dict(self.model)


__all__ = ["AdlmConfig"]
