"""``--set KEY=VALUE``: the parser and typed coercion every CLI uses, now part of ``pipelines.configlib``.

- Recipes (training, tuning): ``section.key=VALUE`` assignments go into the raw YAML mapping
  (``set_nested``; the value is parsed as YAML), then each section's dataclass is validated by the library.
- Flat settings (evaluation, promotion, generation): ``apply_to`` sets ``KEY=VALUE`` on the first
  dataclass that has the field, through the same ``coerce``.

Every failure is a ``ConfigError`` (a ``ValueError``) of one line naming the key and what it expects. This module
keeps the old import path for the callers.
"""

from __future__ import annotations

from pipelines.configlib import (
    apply_to,
    coerce,
    coerce_fields,
    read_yaml_file,
    set_nested,
    settings_help,
    split_assignment,
)

__all__ = ["apply_to", "coerce", "coerce_fields", "read_yaml_file", "set_nested", "settings_help", "split_assignment"]
