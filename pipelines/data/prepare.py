"""Tokenize and pack a corpus into Parquet shards with Ray Data (METHOD.md section 5).

    python -m pipelines.prepare_data --source embedded --out work/data/embedded
    python -m pipelines.prepare_data --source openwebtext --out s3://bucket/owt       # online
    python -m pipelines.prepare_data --source train=corpus/*.jsonl --source validation=val.jsonl \\
        --tokenizer gpt2 --length 1024 --out work/data/mine

Output per split: ``OUT/<split>/part-00000.parquet ...`` (``input_ids``: fixed_size_list<int32>[L]; in
``pad`` mode also ``attention_mask``: fixed_size_list<int8>[L]) and ``OUT/<split>/manifest.json``
(``pipelines.manifest``); a trained tokenizer is ``OUT/tokenizer.json``.

Modes (the reference's semantics):

- ``wrap``: EOS appended to every document; the documents of the split, in order, form one token
  stream; it is cut into rows of ``L - 2`` tokens, each framed ``BOS ... EOS``; the incomplete tail of
  the stream is dropped (and counted).
- ``pad``: one document (sentence) a row, ``BOS ... EOS PAD ...`` with an attention mask; documents
  longer than ``L - 2`` tokens are truncated and counted. Tolerance: before any Ray work the first
  2,000 documents are tokenised; if more than ``--max-truncated`` of them (default 1%) would be cut,
  the run stops and names a length that fits 99% of them.

How the work is split, and why the output is deterministic and resumable:

1. Before Ray starts, the input is cut into *units* with stable indices (byte ranges of text/JSONL
   files cut at newlines, row-group ranges of Parquet files, row ranges of a Hugging Face dataset).
   Their size depends on the input only, never on the cluster.
2. Ray Data runs the units through a class-based ``map_batches`` on an actor pool
   (``ActorPoolStrategy``; fractional CPUs so that 2-core machines do not starve): each actor loads
   the tokenizer once, reads its unit (any pyarrow filesystem: local, S3, GCS), detokenises, drops
   empty documents, replaces invalid UTF-8, and returns the unit's tokens as pyarrow ``list<int32>``
   columns. ``preserve_order`` keeps the units in index order. The tokens come from
   ``pipelines.doc_encoder``: tiktoken's BPE core for GPT-2 (same ids, several times faster), else the
   tokenizer's own ``tokenizers`` backend (``--engine``).
3. The driver packs the ordered stream (cheap numpy work: framing is a reshape) and writes a shard
   whenever at least ``--shard-rows`` rows are pending at a unit boundary: written to
   ``part-NNNNN.parquet.tmp``, then renamed. After each shard ``_progress.json`` records its sha256
   and the packer state (next unit, carried tokens, counters).
4. A rerun with the same options verifies the recorded shards' sha256, keeps the longest intact
   prefix, and restarts from the recorded state: units already packed are not even read again. The
   same input gives byte-identical shards; ``--overwrite`` starts again.

Ray Data's own ``write_parquet`` is not used for the shards: it names files by task and writes them
in completion order, which gives neither byte-identical shards nor a resumable prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipelines.corpora import (
    EMBEDDED,
    EMBEDDED_TOKENIZER_VOCAB,
    KNOWN_SOURCES,
    NAMED_SOURCES,
    NamedSource,
    SourceError,
    Unit,
    check_text_field,
    embedded_corpus,
    expand_local,
    file_kind,
    load_hf_split,
    plan_hf_units,
    plan_units,
    read_unit,
)
from pipelines.detokenizers import DETOKENIZERS, get_detokenizer
from pipelines.doc_encoder import ENGINES, DocEncoder, EncoderError, resolve_engine
from pipelines.manifest import (
    Manifest,
    ShardInfo,
    exists,
    get_fs,
    join,
    read_bytes,
    read_manifest,
    sha256_file,
    write_bytes_atomic,
)
from pipelines.tokenization import TokenizerError, TokenizerInfo, load_tokenizer, train_bpe

PROGRESS_NAME = "_progress.json"
FORMAT_VERSION = 1
FAIL_ENV = "ADLM_PREPARE_FAIL_AFTER_SHARDS"
"""Test hook: raise after this many shards were committed in this process (simulates a killed run)."""


class PrepareError(ValueError):
    """Bad input for data preparation; the message names the problem and the fix."""


@dataclass
class PrepareConfig:
    """Options of ``prepare`` (each is a ``--flag`` of the CLI)."""

    source: list[str] = field(default_factory=lambda: ["embedded"])
    """A named source (``embedded``, ``openwebtext``, ``lm1b``, ...) or local/object-store paths, globs and
    directories; ``split=PATH`` assigns a path to a split (repeatable)."""
    split: list[str] | None = None
    """Splits to prepare (named sources: their reference splits by default; a bare local path: ``train``)."""
    out: str | None = None
    """Output directory or URI (default: ``<workdir>/data/<source>`` for named sources)."""
    workdir: str | None = None
    """Work directory (``--workdir`` > ``$ADLM_WORKDIR`` > ``./work``), used for defaults and the cache."""
    tokenizer: str | None = None
    """``gpt2``, ``bert-base-uncased``, a tokenizer.json or directory, or a hub name (default: the source's)."""
    train_tokenizer: int | None = None
    """Train a byte-level BPE of this many entries on the train split, save it as ``OUT/tokenizer.json``."""
    length: int | None = None
    """Row length L (default: the source's; reference 1024, LM1B 128, embedded 128)."""
    mode: str | None = None
    """``wrap`` or ``pad`` (default: the source's)."""
    text_field: str | None = None
    """Text column/field of JSONL and Parquet input (default ``text``; named sources know theirs)."""
    text_unit: str = "line"
    """Plain-text files: ``line`` (one document a line) or ``file`` (one document a file)."""
    detokenizer: str | None = None
    """Detokenizer before tokenisation (default: the named source's; ``none`` to switch it off)."""
    shard_rows: int = 4096
    """Rows per shard, at least (shards end at unit boundaries, so that a rerun can resume there)."""
    unit_mb: float = 16.0
    """Largest unit of work in MB of input text (smaller for small corpora: total / 32, at least 16 KB)."""
    unit_docs: int = 20000
    """Documents per unit for Hugging Face datasets."""
    actors: int | None = None
    """Tokenizer actors (default: the cluster's CPU count)."""
    actor_cpus: float = 0.5
    """CPUs each actor reserves (fractional on purpose: whole-CPU actors starve Ray Data on small machines)."""
    engine: str = "auto"
    """Tokenizer engine: ``auto`` (tiktoken for GPT-2's BPE, several times faster, same ids; else
    ``tokenizers``), ``tiktoken`` or ``tokenizers`` (``pipelines.doc_encoder``). Shards are identical."""
    max_truncated: float = 0.01
    """``pad`` mode: largest fraction of (sampled) documents that may be truncated before the run refuses."""
    overwrite: bool = False
    """Delete what the output holds for these splits (and a trained tokenizer) and start again."""
    ray_address: str | None = None
    """Ray cluster address (default: ``$RAY_ADDRESS`` or a new local Ray)."""
    progress_interval: float = 2.0
    """Seconds between progress lines."""
    quiet: bool = False
    """No progress lines (the summary still prints)."""


# ----------------------------------------------------------------------------------------------------------
# Planning (no Ray)


@dataclass
class SplitPlan:
    split: str
    source_label: str
    units: list[Unit]
    text_field: str
    detokenizer: str | None
    identity: dict[str, Any]
    hf_dataset: Any = None


@dataclass
class Plan:
    cfg: PrepareConfig
    out: str
    named: NamedSource | None
    splits: dict[str, SplitPlan]
    tokenizer_spec: str | None
    train_vocab: int | None
    length: int
    mode: str


def _log(cfg: PrepareConfig, msg: str, force: bool = False) -> None:
    if force or not cfg.quiet:
        print(f"[prepare_data] {msg}", file=sys.stderr, flush=True)


def _unit_bytes(total: int, unit_mb: float) -> int:
    """Unit size from the input size only (never the cluster), so shard layout is the same everywhere."""
    return int(max(16 << 10, min(unit_mb * (1 << 20), total // 32 + 1)))


def _local_plan(files: list[str], cfg: PrepareConfig, text_field: str) -> tuple[list[Unit], dict[str, Any]]:
    for f in files:
        if file_kind(f) in ("jsonl", "parquet"):
            check_text_field(f, text_field)
    sizes = []
    for f in files:
        fs, inner = get_fs(f)
        sizes.append(fs.get_file_info(inner).size or 0)
    units = plan_units(files, _unit_bytes(sum(sizes), cfg.unit_mb))
    ident = {"files": [[f, s] for f, s in zip(files, sizes, strict=True)], "text_unit": cfg.text_unit}
    return units, ident


def make_plan(cfg: PrepareConfig) -> Plan:
    """Validate everything that can be validated without Ray; PrepareError / SourceError / TokenizerError."""
    from pipelines.common import resolve_workdir

    if not cfg.source:
        raise PrepareError("no --source given; use a named source (" + ", ".join(KNOWN_SOURCES) + ") or a path")
    if cfg.mode is not None and cfg.mode not in ("wrap", "pad"):
        raise PrepareError(f"--mode {cfg.mode!r}: use wrap or pad")
    if cfg.engine not in ENGINES:
        raise PrepareError(f"--engine {cfg.engine!r}: use one of {', '.join(ENGINES)}")
    if cfg.length is not None and cfg.length < 4:
        raise PrepareError(f"--length {cfg.length} is below 4: a row needs BOS, EOS and at least two tokens")
    if cfg.shard_rows < 1:
        raise PrepareError(f"--shard-rows {cfg.shard_rows}: must be at least 1")
    if cfg.actors is not None and cfg.actors < 1:
        raise PrepareError(f"--actors {cfg.actors}: must be at least 1")
    if not 0 < cfg.actor_cpus <= 64:
        raise PrepareError(f"--actor-cpus {cfg.actor_cpus}: must be in (0, 64]")
    if cfg.text_unit not in ("line", "file"):
        raise PrepareError(f"--text-unit {cfg.text_unit!r}: use line or file")
    if not 0 <= cfg.max_truncated <= 1:
        raise PrepareError(f"--max-truncated {cfg.max_truncated}: a fraction in [0, 1]")
    if cfg.detokenizer not in (None, "none") and cfg.detokenizer not in DETOKENIZERS:
        raise PrepareError(f"unknown --detokenizer {cfg.detokenizer!r}; known: none, {', '.join(sorted(DETOKENIZERS))}")
    if cfg.tokenizer and cfg.train_tokenizer:
        raise PrepareError("--tokenizer and --train-tokenizer exclude each other; pass one")

    named_specs = [s for s in cfg.source if "=" not in s and s.lower() in KNOWN_SOURCES]
    local_specs = [s for s in cfg.source if s not in named_specs]
    named: NamedSource | None = None
    splits: dict[str, SplitPlan] = {}
    if named_specs:
        if len(cfg.source) > 1:
            raise PrepareError(f"--source {' '.join(cfg.source)}: a named source cannot be combined with other "
                               "sources; run prepare_data once per source")
        name = named_specs[0].lower()
        named = EMBEDDED if name == "embedded" else NAMED_SOURCES[name]
        wanted = list(cfg.split or named.default_splits)
        for s in wanted:
            if s not in named.splits:
                raise PrepareError(f"{named.name} has no split {s!r}; it has {', '.join(named.splits)}")
        text_field = cfg.text_field or named.field
        detok = named.detokenizer if cfg.detokenizer is None else (None if cfg.detokenizer == "none"
                                                                   else cfg.detokenizer)
        if named is EMBEDDED:
            files = embedded_corpus(cfg.workdir, progress=lambda m: _log(cfg, m))
            if cfg.train_tokenizer is None and cfg.tokenizer is None and "train" not in wanted:
                wanted = ["train", *wanted]  # the default tokenizer is trained on train
            for s in wanted:
                units, ident = _local_plan([str(files[s])], cfg, "text")
                ident = {"embedded": "embedded-v1", "split": s, "bytes": ident["files"][0][1]}
                splits[s] = SplitPlan(s, "embedded", units, "text", detok, ident)
        else:
            for s in wanted:
                ds, start, n = load_hf_split(named, s)
                units = plan_hf_units(n, cfg.unit_docs, offset=start)
                ident = {"hf": named.hf_path, "name": named.hf_name, "split": named.splits[s], "start": start,
                         "rows": n, "fingerprint": getattr(ds, "_fingerprint", None)}
                splits[s] = SplitPlan(s, named.name, units, text_field, detok, ident, hf_dataset=ds)
        out = cfg.out or join(str(resolve_workdir(cfg.workdir)), "data", named.name)
    else:
        bare = [s for s in local_specs if "=" not in s or "://" in s.split("=", 1)[0]]
        if any(s.lower() == s and "/" not in s and "." not in s and not os.path.exists(s) for s in bare):
            unknown = next(s for s in bare if s.lower() == s and "/" not in s and "." not in s)
            raise SourceError(f"unknown dataset {unknown!r}; known: {', '.join(KNOWN_SOURCES)}; or pass a path")
        by_split: dict[str, list[str]] = {}
        default_split = (cfg.split or ["train"])[0]
        for s in local_specs:
            if "=" in s and "://" not in s.split("=", 1)[0]:
                sp, path = s.split("=", 1)
            else:
                sp, path = default_split, s
            by_split.setdefault(sp, []).extend(expand_local(path))
        if cfg.split:
            missing = [s for s in cfg.split if s not in by_split]
            if missing and len(by_split) > 1:
                raise PrepareError(f"--split {' '.join(missing)}: no --source assigned to it (use SPLIT=PATH)")
        text_field = cfg.text_field or "text"
        detok = None if cfg.detokenizer in (None, "none") else cfg.detokenizer
        for s, files in by_split.items():
            units, ident = _local_plan(files, cfg, text_field)
            label = ",".join(x.split("=", 1)[-1] for x in local_specs if x.startswith(f"{s}=") or "=" not in x)
            splits[s] = SplitPlan(s, label, units, text_field, detok, ident)
        if not cfg.out:
            raise PrepareError("local sources need --out DIR (where the shards go)")
        out = cfg.out

    tokenizer_spec = cfg.tokenizer
    train_vocab = cfg.train_tokenizer
    if named is not None and tokenizer_spec is None and train_vocab is None:
        if named is EMBEDDED:
            train_vocab = EMBEDDED_TOKENIZER_VOCAB
        else:
            tokenizer_spec = named.tokenizer
    if tokenizer_spec is None and train_vocab is None:
        raise PrepareError("no tokenizer: pass --tokenizer (gpt2, bert-base-uncased, a tokenizer.json) or "
                           "--train-tokenizer VOCAB_SIZE")
    if train_vocab is not None and "train" not in splits:
        raise PrepareError("--train-tokenizer trains on the train split, but there is none; add --split train or "
                           "--source train=PATH")
    length = cfg.length or (named.length if named else 1024)
    mode = cfg.mode or (named.mode if named else "wrap")
    if length < 4:
        raise PrepareError(f"--length {length} is below 4")
    return Plan(cfg, str(out), named, splits, tokenizer_spec, train_vocab, length, mode)


def _split_docs(plan: Plan, sp: SplitPlan, limit: int | None = None) -> list[str]:
    """Detokenised, non-empty documents of a split, in order (driver side: tokenizer training, checks)."""
    detok = get_detokenizer(sp.detokenizer)
    docs: list[str] = []
    for u in sp.units:
        ut = read_unit(u.to_dict(), sp.text_field, plan.cfg.text_unit, sp.hf_dataset)
        for d in ut.docs:
            if detok is not None:
                d = detok(d)
            if d.strip():
                docs.append(d)
                if limit is not None and len(docs) >= limit:
                    return docs
    return docs


def resolve_tokenizer(plan: Plan) -> TokenizerInfo:
    """Load, or train and save (``OUT/tokenizer.json``), the tokenizer; check its special tokens."""
    cfg = plan.cfg
    if plan.train_vocab is not None:
        tok_path = join(plan.out, "tokenizer.json")
        meta_path = join(plan.out, "tokenizer.meta.json")
        trained_on = {"vocab_size": plan.train_vocab, "train": plan.splits["train"].identity,
                      "detokenizer": plan.splits["train"].detokenizer, "text_field": plan.splits["train"].text_field}
        if not cfg.overwrite and exists(tok_path):
            try:
                meta = json.loads(read_bytes(meta_path))
            except (OSError, json.JSONDecodeError):
                meta = None
            if meta != trained_on:
                raise PrepareError(f"{tok_path} exists but was trained on other data or with another size; "
                                   "pass --overwrite (or another --out)")
            from pipelines.tokenization import tokenizer_from_json

            info = tokenizer_from_json(read_bytes(tok_path).decode("utf-8"), f"bpe-{plan.train_vocab}",
                                       path=tok_path if "://" in tok_path else os.path.abspath(tok_path))
            _log(cfg, f"reusing the trained tokenizer {tok_path}")
        else:
            t0 = time.time()
            docs = _split_docs(plan, plan.splits["train"])
            if not docs:
                raise PrepareError("the train split holds no text to train a tokenizer on")
            info = train_bpe(iter(docs), plan.train_vocab, name=f"bpe-{plan.train_vocab}")
            write_bytes_atomic(tok_path, info.tokenizer_json.encode("utf-8"))
            write_bytes_atomic(meta_path, json.dumps(trained_on, sort_keys=True).encode())
            info.path = tok_path if "://" in tok_path else os.path.abspath(tok_path)
            _log(cfg, f"trained a {info.vocab_size}-entry byte-level BPE on {len(docs)} train documents in "
                      f"{time.time() - t0:.1f}s -> {tok_path}")
    else:
        info = load_tokenizer(plan.tokenizer_spec)
    if plan.mode == "wrap":
        info.require("bos", "eos")
    else:
        info.require("bos", "eos", "pad")
    return info


def _fingerprint(plan: Plan, sp: SplitPlan, tok: TokenizerInfo) -> str:
    payload = {
        "format": FORMAT_VERSION, "identity": sp.identity, "split": sp.split, "text_field": sp.text_field,
        "detokenizer": sp.detokenizer, "tokenizer": tok.content_hash, "length": plan.length, "mode": plan.mode,
        "shard_rows": plan.cfg.shard_rows, "units": [u.to_dict() for u in sp.units],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def check_pad_length(plan: Plan, sp: SplitPlan, tok: TokenizerInfo, sample: int = 2000) -> None:
    """``pad`` mode: refuse a length that truncates more than ``--max-truncated`` of the first documents."""
    docs = _split_docs(plan, sp, limit=sample)
    if not docs:
        return
    lens = np.array([len(x) for x in tok.encode(docs)]) + 2
    frac = float((lens > plan.length).mean())
    if frac > plan.cfg.max_truncated:
        need = int(np.percentile(lens, 99))
        need = -(-need // 8) * 8
        raise PrepareError(
            f"--length {plan.length} truncates {frac:.1%} of the first {len(docs)} {sp.split} documents "
            f"(longest needs {int(lens.max())} with BOS/EOS; allowed: {plan.cfg.max_truncated:.1%}); use --length "
            f"{need} (fits 99%), --mode wrap, or raise --max-truncated")


# ----------------------------------------------------------------------------------------------------------
# The Ray Data stage: read + detokenise + tokenise one unit per call, in a reused actor.


COUNT_KEYS = ("docs", "empty", "invalid_utf8", "missing_field")


class TokenizeUnits:
    """Ray Data callable class: loads the tokenizer once per actor, turns units into token lists.

    ``splits``: per split, its text field, detokenizer name and (Hugging Face sources) the dataset.
    Returns one row per unit: ``tokens`` (large_list<int32>: the unit's documents back to back, EOS after
    each in ``wrap`` mode), ``lengths`` (large_list<int32>: tokens per document) and counters.
    """

    def __init__(self, tokenizer_json: str, splits: dict[str, dict[str, Any]], text_unit: str,
                 append_eos: int | None, engine: str = "auto") -> None:
        self.encode = DocEncoder(tokenizer_json, engine)
        self.splits = splits
        self.detok = {s: get_detokenizer(v["detokenizer"]) for s, v in splits.items()}
        self.text_unit = text_unit
        self.append_eos = append_eos

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        out: dict[str, list[Any]] = {k: [] for k in ("seq", "unit", *COUNT_KEYS)}
        split_names: list[str] = []
        token_arrays, length_arrays = [], []
        for u in batch.to_pylist():
            conf = self.splits[u["split"]]
            ut = read_unit(u, conf["text_field"], self.text_unit, conf["hf_dataset"])
            detok = self.detok[u["split"]]
            docs = ut.docs if detok is None else [detok(d) for d in ut.docs]
            keep = [d for d in docs if d.strip()]
            flat, lengths = self.encode(keep, self.append_eos)
            token_arrays.append(flat)
            length_arrays.append(lengths)
            split_names.append(u["split"])
            out["seq"].append(u["seq"])
            out["unit"].append(u["index"])
            out["docs"].append(len(docs))
            out["empty"].append(len(docs) - len(keep) - ut.missing_field)
            out["invalid_utf8"].append(ut.invalid_utf8)
            out["missing_field"].append(ut.missing_field)

        def lists(arrs: list[np.ndarray]) -> pa.Array:
            offsets = np.zeros(len(arrs) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(a) for a in arrs])
            values = np.concatenate(arrs) if arrs else np.zeros(0, np.int32)
            return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32()))

        cols = {k: pa.array(v, pa.int64()) for k, v in out.items()}
        cols["split"] = pa.array(split_names, pa.string())
        cols["tokens"] = lists(token_arrays)
        cols["lengths"] = lists(length_arrays)
        return pa.table(cols)


# ----------------------------------------------------------------------------------------------------------
# Packing (driver): deterministic in the stream order.


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


def _load_progress(split_dir: str, fingerprint: str, cfg: PrepareConfig) -> tuple[State, bool]:
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
            _log(cfg, f"{s['name']} is missing or does not match its sha256: resuming before it")
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


def _write_progress(split_dir: str, fingerprint: str, st: State, complete: bool) -> None:
    doc = {"fingerprint": fingerprint, "complete": complete, "shards": st.shards}
    write_bytes_atomic(join(split_dir, PROGRESS_NAME), json.dumps(doc).encode())


# ----------------------------------------------------------------------------------------------------------
# One split end to end


def _versions() -> dict[str, str]:
    import pyarrow
    import ray
    import tokenizers

    return {"ray": ray.__version__, "pyarrow": pyarrow.__version__, "tokenizers": tokenizers.__version__,
            "numpy": np.__version__, "python": sys.version.split()[0]}


def _project_version() -> str:
    """The installed project's version, read without importing ``adlm_model`` (its torch import costs 2 s)."""
    if "adlm_model" in sys.modules:
        return sys.modules["adlm_model"].__version__
    import importlib.metadata

    try:
        return importlib.metadata.version("adlm-pipeline")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        from adlm_model import __version__

        return __version__


def _token_frequency(split_dir: str, shards: list[dict[str, Any]], width: int, mode: str) -> tuple[np.ndarray, int]:
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


class SplitRun:
    """Packing state of one split while the ordered stream flows through the driver."""

    def __init__(self, plan: Plan, sp: SplitPlan, tok: TokenizerInfo, fingerprint: str, state: State,
                 engine: str) -> None:
        self.plan, self.sp, self.tok, self.fingerprint, self.state = plan, sp, tok, fingerprint, state
        self.engine = engine
        self.split_dir = join(plan.out, sp.split)
        fs, inner = get_fs(self.split_dir)
        fs.create_dir(inner, recursive=True)
        self.packer = Packer(plan.mode, plan.length, tok.bos_id, tok.eos_id, tok.pad_id,
                             carry=np.array(state.carry, np.int32))
        self.stats = dict(state.stats)
        self.new_rows = self.new_tokens = 0
        self.t0: float | None = None
        self.units_total = sum(1 for u in sp.units if u.index >= state.next_unit)
        self.units_done = 0

    def add(self, unit: int, flat: np.ndarray, lengths: np.ndarray, counts: dict[str, int]) -> int:
        """Pack one unit's tokens; commit a shard when enough rows are pending. Returns shards committed."""
        if self.t0 is None:
            self.t0 = time.time()
        before = self.packer.pending
        self.packer.add(flat, lengths)
        self.new_rows += self.packer.pending - before
        self.new_tokens += int(len(flat)) + (2 * len(lengths) if self.plan.mode == "pad" else 0)
        for k, v in counts.items():
            self.stats[k] += v
        self.stats["used"] += int(len(lengths))
        self.units_done += 1
        if self.packer.pending >= self.plan.cfg.shard_rows:
            self._commit(unit + 1)
            return 1
        return 0

    def _commit(self, next_unit: int) -> None:
        self.stats["truncated"] += self.packer.truncated
        self.packer.truncated = 0
        ids, mask = self.packer.take()
        data = shard_bytes(ids, mask)
        name = shard_name(len(self.state.shards))
        write_bytes_atomic(join(self.split_dir, name), data)
        self.state.shards.append({"name": name, "rows": int(len(ids)), "sha256": hashlib.sha256(data).hexdigest(),
                                  "bytes": len(data), "next_unit": next_unit, "carry": self.packer.carry.tolist(),
                                  "stats": dict(self.stats)})
        self.state.next_unit = next_unit
        _write_progress(self.split_dir, self.fingerprint, self.state, complete=False)

    def progress_line(self) -> str:
        dt = max(time.time() - (self.t0 or time.time()), 1e-9)
        return (f"{self.sp.split}: units {self.units_done}/{self.units_total}, rows {self.new_rows:,} "
                f"({self.new_rows / dt:,.0f} rows/s), tokens {self.new_tokens:,} ({self.new_tokens / dt:,.0f} tokens/s), "
                f"shards {len(self.state.shards)}")

    def finish(self) -> Manifest:
        """Commit the last rows, drop the tail, write the manifest."""
        plan, sp, tok, cfg = self.plan, self.sp, self.tok, self.plan.cfg
        if self.packer.pending:
            self._commit(sp.units[-1].index + 1)
        self.stats["truncated"] += self.packer.truncated
        self.packer.truncated = 0
        dropped = int(len(self.packer.carry))
        if not self.state.shards:
            raise PrepareError(f"{sp.split}: the data gave no rows ({self.stats['used']} documents, {dropped} tokens "
                               f"for rows of {plan.length - 2}): use a shorter --length or more data")
        _write_progress(self.split_dir, self.fingerprint, self.state, complete=True)
        counts, real_tokens = _token_frequency(self.split_dir, self.state.shards, tok.width, plan.mode)
        stats = self.stats
        skipped = {k: stats[k] for k in ("empty", "missing_field") if stats[k]}
        project_version = _project_version()

        m = Manifest(
            source=sp.source_label, split=sp.split, tokenizer=tok.to_dict(), vocab_size=tok.vocab_size,
            mask_id=tok.mask_id, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id, length=plan.length,
            mode=plan.mode, rows=sum(s["rows"] for s in self.state.shards), tokens=real_tokens,
            shards=[ShardInfo(s["name"], s["rows"], s["sha256"], s["bytes"]) for s in self.state.shards],
            documents=stats["docs"], documents_used=stats["used"], skipped=skipped,
            invalid_utf8_replaced=stats["invalid_utf8"], truncated=stats["truncated"],
            dropped_tail_tokens=dropped if plan.mode == "wrap" else 0,
            detokenizer=sp.detokenizer, text_field=sp.text_field,
            token_frequency={str(i): int(c) for i, c in enumerate(counts) if c},
            project_version=project_version, created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            versions=_versions(),
            options={"source": cfg.source, "tokenizer": plan.tokenizer_spec, "train_tokenizer": plan.train_vocab,
                     "length": plan.length, "mode": plan.mode, "shard_rows": cfg.shard_rows,
                     "text_unit": cfg.text_unit, "units": len(sp.units), "fingerprint": self.fingerprint,
                     "engine": self.engine},
        )
        m.write(self.split_dir)
        dt = time.time() - (self.t0 or time.time())
        _log(cfg, f"{sp.split}: {m.rows:,} rows x {m.length} in {len(m.shards)} shards, {m.tokens:,} tokens, "
                  f"{m.documents_used:,}/{m.documents:,} documents used, skipped {m.skipped or 'none'}, invalid "
                  f"UTF-8 {m.invalid_utf8_replaced}, truncated {m.truncated}, tail dropped {m.dropped_tail_tokens}; "
                  f"{self.new_tokens:,} tokens in {dt:.1f}s ({self.new_tokens / max(dt, 1e-9):,.0f} tokens/s) "
                  f"-> {self.split_dir}", force=True)
        return m


def run_splits(plan: Plan, tok: TokenizerInfo, runs: dict[str, SplitRun], engine: str) -> dict[str, Manifest]:
    """One Ray Data pipeline over the remaining units of every split (one actor pool for all of them)."""
    import ray
    import ray.data as rdata

    cfg = plan.cfg
    items = []
    for s, run in runs.items():
        sp = run.sp
        for u in sp.units:
            if u.index >= run.state.next_unit:
                items.append({**u.to_dict(), "split": s, "seq": len(items)})
    results: dict[str, Manifest] = {}
    fail_after = int(os.environ.get(FAIL_ENV, "0") or 0)
    committed = 0
    order = list(runs)
    if items:
        ctx = rdata.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # the stream order is the packing order
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        actors = cfg.actors or max(1, int(ray.cluster_resources().get("CPU", 1)))
        actors = min(actors, len(items))
        per_split = {s: {"text_field": r.sp.text_field, "detokenizer": r.sp.detokenizer,
                         "hf_dataset": r.sp.hf_dataset} for s, r in runs.items()}
        ds = rdata.from_items(items, override_num_blocks=len(items))
        with warnings.catch_warnings():
            # max_restarts has no named parameter yet (Ray 2.60 deprecates the remote-args route): without it Ray
            # logs an error that an actor whose constructor arguments (the tokenizer) live in the object store
            # may fail to restart. A failed actor fails the run instead; a rerun resumes.
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*")
            ds = ds.map_batches(
                TokenizeUnits, batch_size=1, batch_format="pyarrow",
                fn_constructor_kwargs=dict(tokenizer_json=tok.tokenizer_json, splits=per_split,
                                           text_unit=cfg.text_unit,
                                           append_eos=tok.eos_id if plan.mode == "wrap" else None,
                                           engine=engine),
                compute=rdata.ActorPoolStrategy(size=actors), num_cpus=cfg.actor_cpus, max_restarts=0)
        expect = 0
        last_print = time.time()
        current: str | None = None
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
            tokens_col = batch.column("tokens").combine_chunks()
            lengths_col = batch.column("lengths").combine_chunks()
            meta = batch.select(["seq", "unit", "split", *COUNT_KEYS]).to_pylist()
            for r, row in enumerate(meta):
                if row["seq"] != expect:
                    raise RuntimeError(f"units arrived out of order ({row['seq']} after {expect - 1}); Ray Data must "
                                       "preserve order for deterministic packing")
                expect += 1
                s = row["split"]
                if s != current:
                    # Splits arrive one after the other: finish the ones before this one.
                    while order and order[0] != s:
                        done = order.pop(0)
                        results[done] = runs[done].finish()
                    current = s
                flat = tokens_col[r].values.to_numpy(zero_copy_only=False)
                lengths = lengths_col[r].values.to_numpy(zero_copy_only=False)
                committed += runs[s].add(row["unit"], flat, lengths, {k: int(row[k]) for k in COUNT_KEYS})
                if fail_after and committed >= fail_after:
                    raise RuntimeError(f"{FAIL_ENV}={fail_after}: simulated crash after {committed} shards")
            if time.time() - last_print >= cfg.progress_interval and current is not None:
                _log(cfg, runs[current].progress_line())
                last_print = time.time()
    for s in order:
        results[s] = runs[s].finish()
    return results


# ----------------------------------------------------------------------------------------------------------
# Entry points


def _coerce(cfg: Any) -> PrepareConfig:
    if isinstance(cfg, PrepareConfig):
        return cfg
    if isinstance(cfg, list | tuple):
        return _coerce(build_parser().parse_args(list(cfg)))
    if isinstance(cfg, argparse.Namespace):
        cfg = vars(cfg)
    if isinstance(cfg, dict):
        known = {f.name for f in dataclasses.fields(PrepareConfig)}
        bad = set(cfg) - known
        if bad:
            raise PrepareError(f"unknown prepare option(s) {', '.join(sorted(bad))}; known: {', '.join(sorted(known))}")
        d = dict(cfg)
        if isinstance(d.get("source"), str):
            d["source"] = [d["source"]]
        if isinstance(d.get("split"), str):
            d["split"] = [d["split"]]
        return PrepareConfig(**d)
    raise TypeError(f"prepare() takes a PrepareConfig, dict, argparse.Namespace or argv list, not {type(cfg)}")


def _ensure_ray(cfg: PrepareConfig) -> bool:
    """Start (or connect to) Ray unless already initialised; True if this call started it."""
    import ray

    if ray.is_initialized():
        return False
    from pipelines.common import quiet_environment

    quiet_environment()
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {}
    if address:
        # A cluster's workers do not inherit this shell: pass the settings that matter. A local Ray's workers do,
        # and a job runtime_env would keep them off the workers the raylet prestarts (seconds of start-up).
        env = {k: v for k, v in os.environ.items() if k.startswith(("HF_", "TRANSFORMERS_", "TOKENIZERS_", "ADLM_"))}
        kwargs["runtime_env"] = {"env_vars": env}
    ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=True, **kwargs)
    return True


def prepare(config: Any = None, *, shutdown_ray: bool = False) -> dict[str, Manifest]:
    """Prepare every split of ``config`` (PrepareConfig, dict, argparse.Namespace or argv list).

    Returns ``{split: Manifest}``. Bad input raises PrepareError / SourceError / TokenizerError (all
    ValueError) before Ray starts. Splits already complete with the same options are verified and reused.
    """
    cfg = _coerce(config if config is not None else PrepareConfig())
    t0 = time.time()
    plan = make_plan(cfg)
    if cfg.overwrite:
        for s in plan.splits:
            fs, inner = get_fs(join(plan.out, s))
            try:
                fs.delete_dir(inner)
            except (FileNotFoundError, OSError):
                pass
    tok = resolve_tokenizer(plan)
    try:
        engine = resolve_engine(tok.tokenizer_json, cfg.engine)
    except EncoderError as e:
        raise PrepareError(str(e)) from e
    if plan.mode == "pad":
        for sp in plan.splits.values():
            check_pad_length(plan, sp, tok)
    todo: dict[str, tuple[SplitPlan, str, State]] = {}
    results: dict[str, Manifest] = {}
    for s, sp in plan.splits.items():
        fp = _fingerprint(plan, sp, tok)
        st, complete = _load_progress(join(plan.out, s), fp, cfg)
        if complete:
            results[s] = read_manifest(join(plan.out, s))
            _log(cfg, f"{s}: up to date ({len(st.shards)} shards verified) -> {join(plan.out, s)}", force=True)
        else:
            if st.shards:
                _log(cfg, f"{s}: resuming after {len(st.shards)} verified shards (unit {st.next_unit}/"
                          f"{len(sp.units)})", force=True)
            todo[s] = (sp, fp, st)
    if todo:
        _log(cfg, f"tokenizer {tok.name} (vocab {tok.vocab_size}, bos {tok.bos_id}, eos {tok.eos_id}, pad "
                  f"{tok.pad_id}, mask {tok.mask_id}; engine {engine}); mode {plan.mode}, length {plan.length}; "
                  f"splits {', '.join(todo)} -> {plan.out}")
        started = _ensure_ray(cfg)
        try:
            runs = {s: SplitRun(plan, sp, tok, fp, st, engine) for s, (sp, fp, st) in todo.items()}
            results.update(run_splits(plan, tok, runs, engine))
        finally:
            if started and shutdown_ray:
                import ray

                ray.shutdown()
    _log(cfg, f"done in {time.time() - t0:.1f}s: " + ", ".join(f"{s} {m.rows:,} rows" for s, m in results.items()),
         force=True)
    return {s: results[s] for s in plan.splits}


def build_parser() -> argparse.ArgumentParser:
    d = PrepareConfig()
    p = argparse.ArgumentParser(
        prog="python -m pipelines.prepare_data",
        description="Tokenize and pack a corpus into Parquet shards + manifest.json with Ray Data "
                    "(deterministic, resumable). Named sources: " + ", ".join(KNOWN_SOURCES) + ".",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--source", action="append", default=None, metavar="NAME|PATH|SPLIT=PATH",
                   help="named source (" + ", ".join(KNOWN_SOURCES) + "; default embedded) or local/object-store "
                   "text (.txt: one document a line), JSONL or Parquet files, globs or directories; SPLIT=PATH puts "
                   "a path into a split; repeatable")
    p.add_argument("--split", action="append", default=None,
                   help="split(s) to prepare (named sources: their reference splits; a bare local path: train); "
                   "repeatable")
    p.add_argument("--out", default=None, help="output directory or URI (s3://, gs://); default "
                   "<workdir>/data/<source> for named sources")
    p.add_argument("--workdir", default=None, help="work directory (> $ADLM_WORKDIR > ./work)")
    p.add_argument("--tokenizer", default=None, help="gpt2, bert-base-uncased, a tokenizer.json or directory, or a hub "
                   "name; default: the source's (offline, gpt2/bert come from pip packages)")
    p.add_argument("--train-tokenizer", type=int, default=None, metavar="VOCAB_SIZE",
                   help="train a byte-level BPE of this size on the train split and save it as OUT/tokenizer.json "
                   f"(embedded default: {EMBEDDED_TOKENIZER_VOCAB})")
    p.add_argument("--length", type=int, default=None, help="row length L (default: the source's: 1024; lm1b 128; "
                   "embedded 128)")
    p.add_argument("--mode", choices=("wrap", "pad"), default=None,
                   help="wrap: EOS after each document, rows of L-2 framed BOS...EOS, tail dropped; pad: one "
                   "document a row, BOS ... EOS PAD..., attention_mask (default: the source's)")
    p.add_argument("--text-field", default=None, help="text field of JSONL/Parquet input (default text)")
    p.add_argument("--text-unit", choices=("line", "file"), default=d.text_unit,
                   help="plain-text files: one document a line or a file")
    p.add_argument("--detokenizer", default=None, choices=["none", *sorted(DETOKENIZERS)],
                   help="detokenizer applied first (default: the named source's; local: none)")
    p.add_argument("--shard-rows", type=int, default=d.shard_rows,
                   help="rows per shard, at least (shards end at input unit boundaries)")
    p.add_argument("--unit-mb", type=float, default=d.unit_mb, help="largest unit of work (MB of input text)")
    p.add_argument("--unit-docs", type=int, default=d.unit_docs, help="documents per unit (Hugging Face sources)")
    p.add_argument("--actors", type=int, default=None, help="tokenizer actors (default: cluster CPUs)")
    p.add_argument("--actor-cpus", type=float, default=d.actor_cpus,
                   help="CPUs per actor (fractional: whole-CPU actors can starve Ray Data on small machines)")
    p.add_argument("--engine", choices=ENGINES, default=d.engine,
                   help="tokenizer engine: auto = tiktoken for GPT-2's BPE (same ids, several times faster), "
                   "tokenizers for the rest; the shards are identical either way")
    p.add_argument("--max-truncated", type=float, default=d.max_truncated,
                   help="pad mode: largest fraction of the first 2,000 documents allowed to be truncated")
    p.add_argument("--overwrite", action="store_true", help="discard existing shards of these splits and restart")
    p.add_argument("--ray-address", default=None, help="Ray address (default $RAY_ADDRESS or a new local Ray)")
    p.add_argument("--progress-interval", type=float, default=d.progress_interval, help="seconds between progress lines")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.source is None:
        args.source = ["embedded"]
    try:
        prepare(args, shutdown_ray=True)
    except (PrepareError, SourceError, TokenizerError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
