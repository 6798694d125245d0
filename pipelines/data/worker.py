"""A tokenizer actor's work on one unit: read, detokenise, tokenise, pack, write the shard, count.

Runs inside Ray Data's actor pool (``data.prepare``); nothing of a unit's text or tokens goes back to the
driver. Per unit: its documents are read where the actor runs (any pyarrow filesystem, or ``hf://``),
detokenised, empty documents dropped (unless kept), invalid UTF-8 replaced, tokenised
(``pipelines.data.encoder``), packed on their own (``shards.pack_unit``), written as ``part-<unit>.parquet``
(``.tmp`` then rename: a reader never sees half a shard), and then the unit's record
``_units/<unit>.json`` is written: rows, sha256, bytes, counters, the count of every token id and the
``wrap`` remainder (fewer than ``L - 2`` tokens). The record, also returned to the driver, is what the
manifest and the tail rows are made of. The same unit gives the same bytes on any node, any rerun: a unit
done twice (an actor restarted after its node died) writes the same files again.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import numpy as np

from pipelines.core.logs import get_logger
from pipelines.core.storage import join, write_bytes_atomic
from pipelines.data.detokenizers import get_detokenizer
from pipelines.data.encoder import DocEncoder
from pipelines.data.shards import (
    array_text,
    pack_unit,
    shard_bytes,
    shard_name,
    sparse_counts,
    token_counts,
    unit_record_path,
)
from pipelines.data.sources import read_unit

log = get_logger(__name__)

IO_TRIES = 4
"""Tries of a unit whose read or write failed with an I/O error (waits of 1, 2, 4 s between them)."""


class PrepareUnits:
    """Ray Data callable class: loads the tokenizer once per actor, turns each unit into its shard and record.

    ``splits``: per split, its text field, detokenizer, ``keep_empty``, output folder, fingerprint and (a
    Hugging Face dataset loaded with ``datasets``) the dataset. ``frame``: mode, length, BOS, EOS, PAD and the
    width of the token counts. Returns one row per unit: ``split``, ``unit`` and ``record`` (its JSON).
    """

    def __init__(self, tokenizer_json: str, splits: dict[str, dict[str, Any]], text_unit: str,
                 frame: dict[str, Any], engine: str = "auto") -> None:
        self.encode = DocEncoder(tokenizer_json, engine)
        self.splits = splits
        self.detok = {s: get_detokenizer(v["detokenizer"]) for s, v in splits.items()}
        self.text_unit = text_unit
        self.frame = frame

    def __call__(self, batch: Any) -> Any:
        # lazy: keeps pyarrow out of this module's import
        import pyarrow as pa

        out: dict[str, list[Any]] = {"split": [], "unit": [], "record": []}
        for u in batch.to_pylist():
            rec = self.unit(u)
            out["split"].append(u["split"])
            out["unit"].append(u["index"])
            out["record"].append(json.dumps(rec))
        return pa.table({"split": pa.array(out["split"], pa.string()), "unit": pa.array(out["unit"], pa.int64()),
                         "record": pa.array(out["record"], pa.large_string())})

    def unit(self, u: dict[str, Any]) -> dict[str, Any]:
        """The unit done, tried again after a transient I/O error (the hub, the object store): its files are
        written whole or not at all, so a retry never leaves half a shard. A missing file or a refused
        permission is not retried."""
        for attempt in range(IO_TRIES):
            try:
                return self._unit(u)
            except (FileNotFoundError, PermissionError):
                raise
            except OSError as e:
                if attempt == IO_TRIES - 1:
                    raise
                log.warning(f"[prepare_data] unit {u['index']} of {u['split']}: {type(e).__name__}: {e}; trying again")
                time.sleep(2 ** attempt)
        raise AssertionError("unreachable")

    def _unit(self, u: dict[str, Any]) -> dict[str, Any]:
        conf, f = self.splits[u["split"]], self.frame
        ut = read_unit(u, conf["text_field"], self.text_unit, conf["hf_dataset"])
        detok = self.detok[u["split"]]
        docs = ut.docs if detok is None else [detok(d) for d in ut.docs]
        keep = docs if conf["keep_empty"] else [d for d in docs if d.strip()]
        wrap = f["mode"] == "wrap"
        flat, lengths = self.encode(keep, f["eos"] if wrap else None)
        ids, mask, remainder, truncated = pack_unit(f["mode"], f["length"], f["bos"], f["eos"], f["pad"], flat,
                                                    lengths)
        name, sha, size = None, None, 0
        if len(ids):
            data = shard_bytes(ids, mask)
            name, sha, size = shard_name(u["index"]), hashlib.sha256(data).hexdigest(), len(data)
            write_bytes_atomic(join(conf["split_dir"], name), data)
        stats = {"docs": len(docs), "used": int(len(lengths)), "empty": len(docs) - len(keep) - ut.missing_field,
                 "invalid_utf8": ut.invalid_utf8, "missing_field": ut.missing_field, "truncated": truncated,
                 "tokens": int(len(flat)) + (0 if wrap else 2 * int(len(lengths))),
                 "rows_read": int(ut.extra.get("rows_read", len(ut.docs)))}
        rec = {"fingerprint": conf["fingerprint"], "unit": u["index"], "name": name, "rows": int(len(ids)),
               "sha256": sha, "bytes": size, "stats": stats, "remainder": array_text(remainder.astype(np.int32)),
               "freq": sparse_counts(token_counts(ids, mask, f["width"]))}
        write_bytes_atomic(unit_record_path(conf["split_dir"], u["index"]), json.dumps(rec).encode())
        return rec
