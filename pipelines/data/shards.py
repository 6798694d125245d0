"""Shards: packing token streams into rows, writing deterministic Parquet, and resuming.

- ``Packer``: ``wrap`` (documents back to back, rows of ``L - 2`` framed ``BOS ... EOS``, tail dropped)
  or ``pad`` (one document a row, ``BOS ... EOS PAD ...`` with an attention mask); docs/design/method.md, section 5.
  ``pack_unit``: one unit of work's stream on its own (what a tokenizer actor does; its ``wrap`` remainder
  goes to the split's tail rows, ``data.prepare``).
- ``shard_bytes``: the Parquet bytes of one shard, identical for identical rows (no timestamps).
- Resumption: ``_progress.json`` holds the split's fingerprint; the actor that writes a unit's shard then
  writes its record (``_units/NNNNN.json``: rows, sha256, counters, token counts, remainder);
  ``load_progress`` keeps every unit whose shard matches its record, so a rerun does only the others.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipelines.core.storage import exists, get_fs, join, read_bytes, sha256_file, write_bytes_atomic
from pipelines.data.manifest import MANIFEST_NAME, Manifest, ManifestError, read_manifest
from pipelines.data.plan import PrepareError, log

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
    # lazy: keeps pyarrow out of this module's import
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
# One unit of work: packed, written and counted where it was tokenised


def pack_unit(mode: str, length: int, bos: int, eos: int, pad: int | None, flat: np.ndarray,
              lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, int]:
    """(rows, mask or None, remainder, truncated) of one unit's token stream packed on its own: ``wrap`` rows
    of ``L - 2`` stream tokens, the remainder (fewer than ``L - 2`` tokens) returned for the tail rows;
    ``pad`` one row a document, no remainder."""
    p = Packer(mode, length, bos, eos, pad)
    p.add(flat, lengths)
    ids, mask = p.take()
    return ids, mask, p.carry, p.truncated


def token_counts(ids: np.ndarray, mask: np.ndarray | None, width: int) -> np.ndarray:
    """Count of every id over rows (padding excluded: the attention mask's zeros)."""
    flat = ids.reshape(-1) if mask is None else ids.reshape(-1)[mask.reshape(-1).astype(bool)]
    return np.bincount(flat, minlength=width)[:width].astype(np.int64)


def array_text(a: np.ndarray) -> str:
    """A little-endian integer array as base64 text for a unit's record: the driver decodes thousands of records,
    and parsing JSON lists of a GPT-2 unit's 30,000 counts costs it about 20 ms each, base64 about 1 ms."""
    return base64.b64encode(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()).decode("ascii")


def text_array(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)


def sparse_counts(counts: np.ndarray) -> dict[str, str]:
    """The ids that occur and their counts (a unit's record; ``add_counts`` reads it back)."""
    nz = np.flatnonzero(counts)
    return {"ids": array_text(nz.astype(np.int32)), "counts": array_text(counts[nz].astype(np.int32))}  # < 2**31 a unit


def add_counts(total: np.ndarray, freq: dict[str, str]) -> None:
    """``total += `` a record's counts (its ids are distinct)."""
    total[text_array(freq["ids"], "int32")] += text_array(freq["counts"], "int32")

# ----------------------------------------------------------------------------------------------------------
# Resumption: a record a unit, written by the actor after its shard


PROGRESS_NAME = "_progress.json"
UNITS_DIR = "_units"


def unit_record_path(split_dir: str, unit: int) -> str:
    """Where a unit's record goes: written after its shard, so a record means a complete shard."""
    return join(split_dir, UNITS_DIR, f"{unit:05d}.json")


@dataclass
class Progress:
    """What a rerun finds: the units whose shards are intact, the token counts over them, and whether the split
    is complete (its manifest and every listed shard verified)."""

    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    """unit -> record (``name``, ``rows``, ``sha256``, ``bytes``, ``stats``, ``remainder`` as int32 array)."""
    counts: np.ndarray | None = None
    complete: bool = False


def load_progress(split_dir: str, fingerprint: str, width: int, log: Callable[[str], Any]) -> Progress:
    """The progress to resume from after verifying what is there; PrepareError on an option change.

    Keeps every unit whose record has this fingerprint and whose shard matches its sha256 (the records are
    read one at a time and their token counts summed, so the driver holds no more than one); deletes the rest
    of our own files (stale shards, ``.tmp`` files, the tail shard and manifest of an incomplete run)."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.fs as pafs

    fs, inner = get_fs(split_dir)
    counts = np.zeros(width, np.int64)
    if fs.get_file_info(inner).type == pafs.FileType.NotFound:
        return Progress({}, counts)
    entries = fs.get_file_info(pafs.FileSelector(inner))

    def ours(e: Any) -> bool:
        return e.base_name.startswith("part-") or e.base_name.endswith(".tmp") or \
            e.base_name in (PROGRESS_NAME, MANIFEST_NAME, UNITS_DIR)

    def drop(e: Any) -> None:
        (fs.delete_dir if e.type == pafs.FileType.Directory else fs.delete_file)(e.path)

    try:
        prog = json.loads(read_bytes(join(split_dir, PROGRESS_NAME)))
    except (OSError, json.JSONDecodeError):
        prog = None
    if prog is None:
        # Nothing started (or a foreign folder): clear only our own file names and start fresh.
        others = [e.base_name for e in entries if not ours(e)]
        if others:
            raise PrepareError(f"{split_dir} holds files prepare_data did not write ({', '.join(others[:3])}); "
                               "choose another --out")
        for e in entries:
            drop(e)
        return Progress({}, counts)
    if prog.get("fingerprint") != fingerprint:
        raise PrepareError(f"{split_dir} was prepared with other input or options; pass --overwrite to replace it "
                           "(or choose another --out)")
    if prog.get("complete") and exists(join(split_dir, MANIFEST_NAME)):
        try:
            read_manifest(split_dir).verify(checksums=True)
            return Progress({}, None, complete=True)
        except ManifestError as e:
            log(f"{e}: resuming from the units' records")
    records: dict[int, dict[str, Any]] = {}
    units_dir = join(split_dir, UNITS_DIR)
    _, units_inner = get_fs(units_dir)
    found = fs.get_file_info(pafs.FileSelector(units_inner, allow_not_found=True))
    for e in sorted(found, key=lambda x: x.base_name):
        rec = None
        if e.base_name.endswith(".json"):
            try:
                rec = json.loads(read_bytes(join(units_dir, e.base_name)))
            except (OSError, json.JSONDecodeError):
                rec = None
        if rec is None or rec.get("fingerprint") != fingerprint:
            fs.delete_file(e.path)
            continue
        if rec["name"]:
            p = join(split_dir, rec["name"])
            if not exists(p) or sha256_file(p) != rec["sha256"]:
                log(f"{rec['name']} is missing or does not match its sha256: its unit is done again")
                fs.delete_file(e.path)
                continue
        add_counts(counts, rec.pop("freq"))
        rec["remainder"] = text_array(rec["remainder"], "int32")
        records[int(rec["unit"])] = rec
    keep = {r["name"] for r in records.values() if r["name"]} | {PROGRESS_NAME, UNITS_DIR}
    for e in entries:
        if ours(e) and e.base_name not in keep:
            drop(e)
    return Progress(records, counts)


def write_progress(split_dir: str, fingerprint: str, complete: bool) -> None:
    doc = {"fingerprint": fingerprint, "complete": complete}
    write_bytes_atomic(join(split_dir, PROGRESS_NAME), json.dumps(doc).encode())


def existing_split(split_dir: str, cfg: Any, fingerprint: str, tokenizer_hash: str | None = None,
                   what: str = "data") -> Manifest | None:
    """A split written whole by an earlier run, for a source that writes its splits in one go (the testbed, the
    reasoning tasks): its manifest when it was made with these options (``fingerprint``, and ``tokenizer_hash``
    where given) and its shards verify; None to (re)write it (absent, unreadable, damaged, or other options with
    ``--overwrite``). Other options without ``--overwrite``: PrepareError naming the fix."""
    if not exists(join(split_dir, MANIFEST_NAME)):
        return None
    try:
        m = read_manifest(split_dir)
    except ManifestError:
        return None
    same = m.options.get("fingerprint") == fingerprint
    if not same or (tokenizer_hash is not None and m.tokenizer.get("hash") != tokenizer_hash):
        if not cfg.overwrite:
            raise PrepareError(f"{split_dir} holds {what} made with other options; pass --overwrite (or another --out)")
        return None
    try:
        m.verify()
    except ManifestError as e:
        log(cfg, f"{split_dir}: {e}; rewriting it", force=True)
        return None
    return m
