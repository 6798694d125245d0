"""The pydantic settings every config dataclass of the project is validated with (``configlib``), in a module of
its own: ``pipelines.data.plan`` needs them without importing ``configlib``, whose ``adlm_model`` import pulls in
torch (2 s in every tokenizer actor and in reading the manifest's project version)."""

from __future__ import annotations

from pydantic import ConfigDict

PYDANTIC_CONFIG = ConfigDict(use_attribute_docstrings=True, coerce_numbers_to_str=True, extra="forbid")
"""Set on every config dataclass the library validates: docstrings as descriptions, ``name: 2024`` read as the
text "2024" (as before), and ``additionalProperties: false`` in the schemas (editors flag unknown keys)."""

__all__ = ["PYDANTIC_CONFIG"]
