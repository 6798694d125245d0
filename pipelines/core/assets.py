"""Offline assets that pip packages ship (docs/offline-assets.md): found by package folder, never by importing
the package (some import heavy dependencies, one is not importable at all).

Who uses what: ``data.sources`` (gensim's Wikipedia sample, the KJV database), ``data.tokenizer``
(GPT-2's BPE files, bert-base-uncased's vocabulary), ``evaluation.eval_lm`` (SmolLM2 GGUF, MiniLM).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(module: str) -> Path | None:
    """Folder of an installed package, or None when it is not installed."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])
