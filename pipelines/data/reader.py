"""Reading rows back from prepared shards (training's validation rows, evaluation's splits).

Rows come in manifest order; only the shards that hold the requested rows are read (local paths and
object-store URIs alike).
"""

from __future__ import annotations

import numpy as np

from pipelines.core.storage import get_fs
from pipelines.data.manifest import read_manifest


def read_rows(split_dir: str, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows ``[start, stop)`` of a prepared split (manifest order): ``input_ids`` (int64) and the attention
    mask (int8) in pad mode, else None. Only the shards that hold those rows are read."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.parquet as pq

    m = read_manifest(split_dir)
    stop = m.rows if stop is None else min(stop, m.rows)
    ids_parts, mask_parts = [], []
    offset = 0
    for info, uri in zip(m.shards, m.shard_uris(), strict=True):
        lo, hi = offset, offset + info.rows
        offset = hi
        if hi <= start or lo >= stop:
            continue
        fs, path = get_fs(uri)
        cols = ["input_ids"] + (["attention_mask"] if m.mode == "pad" else [])
        table = pq.read_table(path, filesystem=fs, columns=cols)
        a, b = max(start, lo) - lo, min(stop, hi) - lo
        ids = table.column("input_ids").combine_chunks().flatten().to_numpy().reshape(-1, m.length)
        ids_parts.append(ids[a:b].astype(np.int64))
        if "attention_mask" in table.column_names:
            mask = table.column("attention_mask").combine_chunks().flatten().to_numpy().reshape(-1, m.length)
            mask_parts.append(mask[a:b].astype(np.int8))
    if not ids_parts:
        return np.zeros((0, m.length), np.int64), None
    return np.concatenate(ids_parts), (np.concatenate(mask_parts) if mask_parts else None)


def read_row_indices(split_dir: str, indices: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows at ``indices`` (sorted, distinct, in ``[0, rows)``) of a prepared split, in that order; each
    shard that holds one of them is read once."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.parquet as pq

    m = read_manifest(split_dir)
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx[0] < 0 or idx[-1] >= m.rows or np.any(np.diff(idx) <= 0)):
        raise ValueError(f"row indices must be sorted, distinct and in [0, {m.rows}) for {split_dir}")
    ids_parts, mask_parts = [], []
    offset = 0
    for info, uri in zip(m.shards, m.shard_uris(), strict=True):
        lo, hi = offset, offset + info.rows
        offset = hi
        local = idx[(idx >= lo) & (idx < hi)] - lo
        if not local.size:
            continue
        fs, path = get_fs(uri)
        cols = ["input_ids"] + (["attention_mask"] if m.mode == "pad" else [])
        table = pq.read_table(path, filesystem=fs, columns=cols)
        ids = table.column("input_ids").combine_chunks().flatten().to_numpy().reshape(-1, m.length)
        ids_parts.append(ids[local].astype(np.int64))
        if "attention_mask" in table.column_names:
            mask = table.column("attention_mask").combine_chunks().flatten().to_numpy().reshape(-1, m.length)
            mask_parts.append(mask[local].astype(np.int8))
    if not ids_parts:
        return np.zeros((0, m.length), np.int64), None
    return np.concatenate(ids_parts), (np.concatenate(mask_parts) if mask_parts else None)


def spread_indices(total: int, n: int) -> np.ndarray:
    """``n`` row indices spread evenly over ``[0, total)`` (all of them when ``n`` is 0 or at least ``total``).

    A split is its documents in order, so its first rows are one or two documents (on the embedded corpus,
    Wikipedia only, where most of the split is the Bible): a subset for validation, a fast stage or MAUVE's
    references is taken across the whole split instead."""
    if n <= 0 or n >= total:
        return np.arange(total, dtype=np.int64)
    return np.linspace(0, total - 1, n).round().astype(np.int64)


def read_subset(split_dir: str, n: int, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows ``[start, stop)`` of the split's ``n``-row subset (``spread_indices``; the whole split for 0)."""
    m = read_manifest(split_dir)
    idx = spread_indices(m.rows, n)[start:stop]
    if idx.size and idx[-1] - idx[0] + 1 == idx.size:  # contiguous: one range read
        return read_rows(split_dir, int(idx[0]), int(idx[-1]) + 1)
    return read_row_indices(split_dir, idx)
