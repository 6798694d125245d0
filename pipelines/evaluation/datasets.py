"""The datasets an evaluation scores: where the prepared data is, the zero-shot sets, and the identity of a
perplexity figure (``ppl_key``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.core.storage import exists, is_uri, join, list_dir, name_of, parent_of, resolve_workdir
from pipelines.data.manifest import MANIFEST_NAME
from pipelines.evaluation.config import EvalConfig, EvalError


@dataclass
class Dataset:
    """One split scored by ``ppl`` / ``zero_shot``."""

    label: str
    """``validation``, ``test`` or ``zero_shot/NAME``."""
    split_dir: str
    rows: int
    tokens: int
    manifest_hash: str
    source: str


def under_workdir(path: str, workdir: str | os.PathLike | None) -> str:
    """``path`` as given when absolute or a URI or existing here, else under the work directory."""
    if is_uri(path) or path.startswith("file://") or Path(path).is_absolute():
        return path
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else join(resolve_workdir(workdir), path)


def has_manifest(d: str) -> bool:
    return exists(join(d, MANIFEST_NAME))


def data_dir_for(cfg: EvalConfig, meta: dict[str, Any], workdir: str | os.PathLike | None) -> str | None:
    """The prepared data folder: ``data=`` or the checkpoint's training data."""
    if cfg.data:
        return under_workdir(cfg.data, workdir)
    val = ((meta.get("train_config") or {}).get("data") or {}).get("validation")
    if val:
        return parent_of(under_workdir(val, workdir))
    return None


def discover_zero_shot(entries: Sequence[str], workdir: str | os.PathLike | None) -> list[tuple[str, str]]:
    """(name, split_dir) of every zero-shot set named by ``entries`` (see ``EvalConfig.zero_shot``).

    An entry is ``NAME=DIR`` or ``DIR``; DIR is a split folder (holds ``manifest.json``), a prepared data
    folder (its ``test`` split, else ``validation``, else its only split) or a folder of data folders.
    """
    found: list[tuple[str, str]] = []

    def split_of(d: str) -> str | None:
        for split in ("test", "validation"):
            if has_manifest(join(d, split)):
                return join(d, split)
        splits = [join(d, c) for c in list_dir(d) if has_manifest(join(d, c))]
        return splits[0] if len(splits) == 1 else None

    for entry in entries:
        name, path = entry.split("=", 1) if "=" in entry else ("", entry)
        d = under_workdir(path, workdir)
        if has_manifest(d):
            base = name_of(parent_of(d)) if name_of(d) in ("train", "validation", "test") else name_of(d)
            found.append((name or base, d))
            continue
        one = split_of(d)
        if one:
            found.append((name or name_of(d), one))
            continue
        many = [(c, split_of(join(d, c))) for c in list_dir(d)]
        many = [(n, sd) for n, sd in many if sd]
        if not many:
            raise EvalError(f"zero-shot set {entry!r}: no prepared split under {d}; prepare it with "
                            "python -m pipelines.prepare_data --source NAME --out DIR and pass DIR")
        found.extend(((f"{name}.{n}" if name else n), sd) for n, sd in many)
    names = [n for n, _ in found]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise EvalError(f"zero-shot sets named twice: {', '.join(dup)}; name them with NAME=DIR")
    return found


def ppl_key(dataset: Dataset, cfg: EvalConfig) -> str:
    """Identity of a perplexity figure: same key, same number (data, rows, batch size, draws, seed, EMA)."""
    rows = min(cfg.max_rows, dataset.rows) if cfg.max_rows else dataset.rows
    # "spread": a subset is spread over the split (reader.spread_indices), not its first rows as before.
    return (f"{dataset.manifest_hash[:16]}:rows={rows}{'-spread' if rows < dataset.rows else ''}:bs={cfg.batch_size}:draws={cfg.t_draws}:seed={cfg.seed}"
            f":ema={int(cfg.use_ema)}")
