"""Shards: packing the ordered token stream into rows, writing deterministic Parquet, and resuming.

- ``Packer``: ``wrap`` (documents back to back, rows of ``L - 2`` framed ``BOS ... EOS``, tail dropped)
  or ``pad`` (one document a row, ``BOS ... EOS PAD ...`` with an attention mask); METHOD.md section 5.
- ``shard_bytes``: the Parquet bytes of one shard, identical for identical rows (no timestamps).
- Resumption: after each shard ``_progress.json`` records its sha256 and the packer state (next unit,
  carried tokens, counters); ``load_progress`` verifies the recorded shards and keeps the longest intact
  prefix, so a rerun continues exactly where a killed run stopped.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipelines.data.plan import PrepareError
from pipelines.storage import exists, get_fs, join, read_bytes, sha256_file, write_bytes_atomic

PROGRESS_NAME = "_progress.json"


# ----------------------------------------------------------------------------------------------------------
# Packing: deterministic in the stream order.


class Packer:
    """Turns the ordered token stream into framed rows (``wrap``) or padded rows (``pad``)."""

    def __init__(self, mode: str, length: int, bos: int, eos: int, pad: int | None,
                 carry: np.ndarray | None = None) -> None:
        self.mode, self.L, self.bos, self.eos, self.pad = mode, length, bos, eos, pad
        self.carry = np.zeros(0, np.int32) if carry is None else carry.astype(np.int32)
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.pending = 0
        self.truncated = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        L = self.L
        if self.mode == "wrap":
            buf = np.concatenate([self.carry, flat]) if len(self.carry) else flat
            k = len(buf) // (L - 2)
            if k:
                rows = np.empty((k, L), np.int32)
                rows[:, 0] = self.bos
                rows[:, 1:-1] = buf[: k * (L - 2)].reshape(k, L - 2)
                rows[:, -1] = self.eos
                self.ids.append(rows)
                self.pending += k
            self.carry = buf[k * (L - 2):].copy()
            return
        n = len(lengths)
        if not n:
            return
        lengths = lengths.astype(np.int64)
        m = np.minimum(lengths, L - 2)
        self.truncated += int((lengths > L - 2).sum())
        offsets = np.zeros(n, np.int64)
        offsets[1:] = np.cumsum(lengths)[:-1]
        rows = np.full((n, L), self.pad, np.int32)
        rows[:, 0] = self.bos
        pos = np.arange(L - 2)
        take = pos[None, :] < m[:, None]
        body = rows[:, 1:-1]
        body[take] = flat[(offsets[:, None] + pos[None, :])[take]]
        rows[np.arange(n), m + 1] = self.eos
        mask = (np.arange(L)[None, :] < (m + 2)[:, None]).astype(np.int8)
        self.ids.append(rows)
        self.masks.append(mask)
        self.pending += n

    def take(self) -> tuple[np.ndarray, np.ndarray | None]:
        ids = np.concatenate(self.ids) if self.ids else np.zeros((0, self.L), np.int32)
        mask = (np.concatenate(self.masks) if self.masks else np.zeros((0, self.L), np.int8)) \
            if self.mode == "pad" else None
        self.ids, self.masks, self.pending = [], [], 0
        return ids, mask


def shard_bytes(ids: np.ndarray, mask: np.ndarray | None) -> bytes:
    """Parquet bytes of one shard: fixed_size_list<int32>[L] (+ fixed_size_list<int8>[L]); deterministic."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    L = ids.shape[1]
    cols = {"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1), pa.int32()), L)}
    if mask is not None:
        cols["attention_mask"] = pa.FixedSizeListArray.from_arrays(pa.array(mask.reshape(-1), pa.int8()), L)
    sink = io.BytesIO()
    # Small row groups let readers (Ray Data, training) split a shard; no per-write metadata (no timestamps).
    pq.write_table(pa.table(cols), sink, row_group_size=max(1, min(len(ids), 1024)), compression="zstd",
                   use_dictionary=False, write_statistics=False)
    return sink.getvalue()


def shard_name(i: int) -> str:
    return f"part-{i:05d}.parquet"

# ----------------------------------------------------------------------------------------------------------
# Resumption


@dataclass
class State:
    """Packer state after the last committed shard: everything a rerun needs to continue identically."""

    next_unit: int = 0
    carry: list[int] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=lambda: dict(docs=0, used=0, empty=0, invalid_utf8=0,
                                                               missing_field=0, truncated=0))
    shards: list[dict[str, Any]] = field(default_factory=list)


def load_progress(split_dir: str, fingerprint: str, log: Callable[[str], Any]) -> tuple[State, bool]:
    """(state to resume from, complete?) after verifying committed shards; PrepareError on an option change."""
    import pyarrow.fs as pafs

    fs, inner = get_fs(split_dir)
    info = fs.get_file_info(inner)
    if info.type == pafs.FileType.NotFound:
        return State(), False
    entries = fs.get_file_info(pafs.FileSelector(inner))
    ours = [e for e in entries if e.base_name.startswith("part-") or e.base_name in (PROGRESS_NAME, "manifest.json")
            or e.base_name.endswith(".tmp")]
    prog_path = join(split_dir, PROGRESS_NAME)
    try:
        prog = json.loads(read_bytes(prog_path))
    except (OSError, json.JSONDecodeError):
        prog = None
    if prog is None:
        # Nothing committed (or a foreign folder): clear only our own file names and start fresh.
        others = [e.base_name for e in entries if e not in ours]
        if others:
            raise PrepareError(f"{split_dir} holds files prepare_data did not write ({', '.join(others[:3])}); "
                               "choose another --out")
        for e in ours:
            fs.delete_file(e.path)
        return State(), False
    if prog.get("fingerprint") != fingerprint:
        raise PrepareError(f"{split_dir} was prepared with other input or options; pass --overwrite to replace it "
                           "(or choose another --out)")
    good: list[dict[str, Any]] = []
    for s in prog["shards"]:
        p = join(split_dir, s["name"])
        if not exists(p) or sha256_file(p) != s["sha256"]:
            log(f"{s['name']} is missing or does not match its sha256: resuming before it")
            break
        good.append(s)
    complete = bool(prog.get("complete")) and len(good) == len(prog["shards"])
    keep = {s["name"] for s in good} | {PROGRESS_NAME}
    if complete:
        keep.add("manifest.json")
    for e in ours:
        if e.base_name not in keep:
            fs.delete_file(e.path)
    if good:
        last = good[-1]
        st = State(next_unit=last["next_unit"], carry=list(last["carry"]), stats=dict(last["stats"]), shards=good)
    else:
        st = State()
    if complete and not exists(join(split_dir, "manifest.json")):
        complete = False
    return st, complete


def write_progress(split_dir: str, fingerprint: str, st: State, complete: bool) -> None:
    doc = {"fingerprint": fingerprint, "complete": complete, "shards": st.shards}
    write_bytes_atomic(join(split_dir, PROGRESS_NAME), json.dumps(doc).encode())

def token_frequency(split_dir: str, shards: list[dict[str, Any]], width: int, mode: str) -> tuple[np.ndarray, int]:
    """Counts of every id over the shards (padding excluded) and the number of real tokens."""
    import pyarrow.parquet as pq

    counts = np.zeros(width, np.int64)
    for s in shards:
        fs, inner = get_fs(join(split_dir, s["name"]))
        t = pq.read_table(fs.open_input_file(inner))
        ids = t.column("input_ids").combine_chunks().flatten().to_numpy()
        if mode == "pad":
            m = t.column("attention_mask").combine_chunks().flatten().to_numpy().astype(bool)
            ids = ids[m]
        counts += np.bincount(ids, minlength=width)[:width]
    return counts, int(counts.sum())
