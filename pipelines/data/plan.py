"""Planning a data preparation: the options, the input cut into units, everything checked before Ray.

``make_plan(PrepareConfig)`` validates the options, resolves a named source (its reference splits, text
field, detokenizer, tokenizer, mode and length) or local/object-store files, and cuts every split's input
into *units* with stable indices (byte ranges of text/JSONL files cut at newlines, row ranges of Parquet
files made of whole row groups of one file, row ranges of a Hugging Face dataset loaded with ``datasets``).
Unit sizes depend on the input only, never on the cluster, so the shard layout is the same everywhere. A named
source on a cluster (or with a hub mirror) is its Parquet files on the hub (``data.hub``): the driver reads
their footers, never their rows. Every error here is one line, before Ray starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import with_config

from pipelines.core.logs import get_logger
from pipelines.core.pydantic_config import PYDANTIC_CONFIG
from pipelines.core.storage import (
    check_location,
    exists,
    get_fs,
    is_uri,
    join,
    local_path,
    name_of,
    resolve_workdir,
    sha256_file,
)
from pipelines.data.detokenizers import DETOKENIZERS, get_detokenizer
from pipelines.data.embedded import embedded_corpus
from pipelines.data.encoder import ENGINES
from pipelines.data.hub import hub_files, hub_pattern, resolve_mirror, split_window, stage_url
from pipelines.data.sources import (
    EMBEDDED,
    EMBEDDED_TOKENIZER_VOCAB,
    KNOWN_SOURCES,
    NAMED_SOURCES,
    NamedSource,
    SourceError,
    Unit,
    check_text_field,
    check_text_file,
    expand_local,
    file_kind,
    load_hf_split,
    plan_hf_units,
    plan_units,
    read_unit,
    source_fs,
)
from pipelines.data.tokenizer import TokenizerInfo, check_trained_vocab

logger = get_logger(__name__)

FORMAT_VERSION = 2
"""Part of every split's fingerprint: bump it when the shard format changes (2: one shard a unit of work)."""
MAX_ACTORS = 64
"""Default upper bound of the tokenizer actor pool."""


class PrepareError(ValueError):
    """Bad input for data preparation; the message names the problem and the fix."""


def key_values(raw: Any, flag: str, example: str) -> dict[str, Any]:
    """A source's options (``--testbed``, ``--reasoning``) as a mapping: a mapping as it is, or ``KEY=VALUE``
    strings with each value read as JSON where it parses (``n=16`` is a number, ``task=prosqa`` a string).
    PrepareError names a string without ``=`` (with ``example``) or anything else."""
    raw = raw or {}
    if isinstance(raw, (list, tuple)):
        pairs: dict[str, Any] = {}
        for item in raw:
            if "=" not in str(item):
                raise PrepareError(f"--{flag} {item!r}: use KEY=VALUE (e.g. {example})")
            k, v = str(item).split("=", 1)
            try:
                pairs[k.strip()] = json.loads(v)
            except json.JSONDecodeError:
                pairs[k.strip()] = v
        raw = pairs
    if not isinstance(raw, dict):
        raise PrepareError(f"{flag} options must be a mapping or KEY=VALUE strings, got {raw!r}")
    return dict(raw)


@with_config(PYDANTIC_CONFIG)  # the field docstrings are the CLI's --help (pipelines.prepare_data)
@dataclass
class PrepareConfig:
    """Options of ``prepare``: each field is a ``--flag`` of ``pipelines.prepare_data``, its docstring the help."""

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
    keep_empty: bool | None = None
    """Keep empty documents (a lone EOS each in ``wrap`` mode, a BOS EOS row in ``pad`` mode). None: the
    source's convention (the zero-shot sets: kept, as the reference's loader appends EOS to every row; the
    rest: dropped and counted)."""
    text_unit: str = "line"
    """Plain-text files: ``line`` (one document a line) or ``file`` (one document a file)."""
    detokenizer: str | None = None
    """Detokenizer before tokenisation (default: the named source's; ``none`` to switch it off)."""
    unit_mb: float = 16.0
    """Largest unit of work in MB of input text (smaller for small corpora: total / 32, at least 16 KB). Each
    unit becomes one shard, written by the actor that tokenised it."""
    unit_docs: int = 20000
    """Documents per unit for Hugging Face datasets loaded with ``datasets`` (a local output)."""
    hub_mirror: str | None = None
    """Named sources: read the dataset's Parquet files from this folder or object-store prefix, laid out as the
    hub (``<mirror>/<dataset id>/<path>``), instead of the hub (``data.hub``; default ``$ADLM_HUB_MIRROR``)."""
    actors: int | None = None
    """Most tokenizer actors of the autoscaling pool (default: one a unit of work, at most 64, and for text input
    one per 4 MB of it: an actor's start costs about as much as tokenizing that)."""
    min_actors: int = 1
    """Tokenizer actors the pool starts with (it grows as the cluster offers CPUs)."""
    actor_cpus: float = 0.5
    """CPUs each actor reserves (fractional on purpose: whole-CPU actors starve Ray Data on small machines)."""
    engine: str = "auto"
    """Tokenizer engine: ``auto`` (tiktoken for GPT-2's BPE, several times faster, same ids; else
    ``tokenizers``), ``tiktoken`` or ``tokenizers`` (``pipelines.data.encoder``). Shards are identical."""
    max_truncated: float = 0.01
    """``pad`` mode: largest fraction of (sampled) documents that may be truncated before the run refuses."""
    overwrite: bool = False
    """Delete what the output holds for these splits (and a trained tokenizer) and start again."""
    ray_address: str | None = None
    """Ray cluster address (default: ``$RAY_ADDRESS`` or a new local Ray)."""
    progress_interval: float = 2.0
    """Seconds between progress lines."""
    testbed: Any = None
    """The ``testbed`` source only: ``TestbedConfig`` fields (``preset=natural``: the language with natural text's
    confidence) and rows per split (``train_rows``, ...), as a mapping or ``KEY=VALUE`` strings
    (``pipelines.data.synthetic``)."""
    reasoning: Any = None
    """The reasoning sources (``prosqa``, ``prontoqa``, ``gsm8k``, or local files with ``task=...``): rows per
    split, seed, generator knobs, ``names=PATH`` (a name inventory), as a mapping or ``KEY=VALUE`` strings
    (``pipelines.data.reasoning.source``)."""

    def __post_init__(self) -> None:
        # One source or split given as a word (a study file's ``source: embedded``) is a list of one.
        if isinstance(self.source, str):
            self.source = [self.source]
        if isinstance(self.split, str):
            self.split = [self.split]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrepareConfig:
        """The options of a mapping (a study's ``data`` block, a script's options): an unknown one is a
        PrepareError; a retired one (``RETIRED``) is ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k not in RETIRED}
        bad = set(d) - known
        if bad:
            raise PrepareError(f"unknown prepare option(s) {', '.join(sorted(bad))}; known: {', '.join(sorted(known))}")
        return cls(**d)


RETIRED = ("shard_rows",)
"""Options of format 1 that no longer mean anything and are ignored (a shard is now one unit of work's rows:
size shards with ``unit_mb``), so that older recipes and scripts keep running."""

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
    keep_empty: bool = False


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


def log(cfg: PrepareConfig, msg: str, force: bool = False) -> None:
    """A progress line, or with ``force`` a line of the run's summary (what was prepared, reused or resumed): both
    log lines (``-q`` hides them; the command prints its result on stdout)."""
    logger.info(msg)


def _unit_bytes(total: int, unit_mb: float) -> int:
    """Unit size from the input size only (never the cluster), so shard layout is the same everywhere."""
    return int(max(16 << 10, min(unit_mb * (1 << 20), total // 32 + 1)))


def _local_plan(files: list[str], cfg: PrepareConfig) -> tuple[list[Unit], dict[str, Any]]:
    """Units of files (local or in an object store) cut by size only, and the files' identity."""
    sizes = []
    for f in files:
        fs, inner = source_fs(f)
        sizes.append(fs.get_file_info(inner).size or 0)
    units = plan_units(files, _unit_bytes(sum(sizes), cfg.unit_mb))
    ident = {"files": [[f, s] for f, s in zip(files, sizes, strict=True)], "text_unit": cfg.text_unit}
    return units, ident


def _output(out: str) -> str:
    """The output location, checked (one line before any work): an object store's, or a local folder that can be
    made (no file in its place or above it)."""
    out = str(out).rstrip("/")
    if is_uri(out):
        check_location(out)
        return out
    p = local_path(out) or Path(out)
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                raise PrepareError(f"--out {out}: {q} is a file, not a folder; pass a folder for the shards")
            if not os.access(q, os.W_OK | os.X_OK):
                raise PrepareError(f"--out {out}: {q} is not writable; pass a folder you can write")
            break
    return out


def stage_inputs(files: list[str], out: str) -> list[str]:
    """Input files as every node can read them. With a remote output (a cluster: nodes share only the object
    store) local files are copied once to ``<out>/_inputs/<sha256 prefix>-<name>`` and read from there;
    remote inputs, and every input of a local output, are read where they are."""
    if not is_uri(out):
        return files
    staged = []
    for f in files:
        if is_uri(f):
            staged.append(f)
            continue
        dest = join(out, "_inputs", f"{sha256_file(f)[:16]}-{name_of(f)}")
        if not exists(dest):
            fs, inner = get_fs(dest)
            fs.create_dir(inner.rsplit("/", 1)[0], recursive=True)
            with open(local_path(f), "rb") as src, fs.open_output_stream(inner + ".tmp") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            fs.move(inner + ".tmp", inner)
        staged.append(dest)
    return staged


def _hub_split(named: NamedSource, split: str, mirror: str | None, out: str, text_field: str,
               detok: str | None, cfg: PrepareConfig) -> SplitPlan:
    """A named source's split as the hub serves it (``data.hub``): its Parquet files cut into units (rows of
    one file each), restricted to the split's rows (OpenWebText's held-out tail)."""
    if named.data_files:  # one JSONL file at a URL (LAMBADA): every row is the split
        files = [stage_url(named.data_files, out, mirror)]
        units, ident = _local_plan(files, cfg)
        ident = {"url": named.data_files, "bytes": ident["files"][0][1]}
        return SplitPlan(split, named.name, units, text_field, detok, ident)
    files = hub_files(named, split, mirror)
    check_text_field(files[0], text_field)
    window = split_window(named, split, files)
    sizes = [source_fs(f)[0].get_file_info(source_fs(f)[1]).size or 0 for f in files]
    units = plan_units(files, _unit_bytes(sum(sizes), cfg.unit_mb), rows=window)
    # The files' names and sizes, not where they were read: the hub and a mirror of it give the same shards.
    depth = len(hub_pattern(named, split)[1].split("/"))
    ident = {"hub": named.hf_path, "name": named.hf_name, "split": named.splits[split], "rows": window,
             "files": [["/".join(f.split("/")[-depth:]), n] for f, n in zip(files, sizes, strict=True)]}
    return SplitPlan(split, named.name, units, text_field, detok, ident)


def make_plan(cfg: PrepareConfig) -> Plan:
    """Validate everything that can be validated without Ray; PrepareError / SourceError / TokenizerError."""
    if not cfg.source:
        raise PrepareError("no --source given; use a named source (" + ", ".join(KNOWN_SOURCES) + ") or a path")
    if cfg.mode is not None and cfg.mode not in ("wrap", "pad"):
        raise PrepareError(f"--mode {cfg.mode!r}: use wrap or pad")
    if cfg.engine not in ENGINES:
        raise PrepareError(f"--engine {cfg.engine!r}: use one of {', '.join(ENGINES)}")
    if cfg.length is not None and cfg.length < 4:
        raise PrepareError(f"--length {cfg.length} is below 4: a row needs BOS, EOS and at least two tokens")
    if cfg.actors is not None and cfg.actors < 1:
        raise PrepareError(f"--actors {cfg.actors}: must be at least 1")
    if cfg.min_actors < 1 or (cfg.actors is not None and cfg.min_actors > cfg.actors):
        raise PrepareError(f"--min-actors {cfg.min_actors}: must be at least 1 and at most --actors")
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
    if cfg.train_tokenizer is not None:
        check_trained_vocab(cfg.train_tokenizer)  # before the corpus is read: 10^12 aborted in the allocator
    for flag, value, least in (("--unit-mb", cfg.unit_mb, 0), ("--progress-interval", cfg.progress_interval, 0)):
        if not (math.isfinite(value) and value > least):
            raise PrepareError(f"{flag} {value}: must be a number above {least}")
    if cfg.unit_docs < 1:
        raise PrepareError(f"--unit-docs {cfg.unit_docs}: must be at least 1 (documents a unit of work)")

    named_specs = [s for s in cfg.source if "=" not in s and (s.lower() == "embedded" or s.lower() in NAMED_SOURCES)]
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
        out = _output(cfg.out or join(resolve_workdir(cfg.workdir), "data", named.name))
        if named is EMBEDDED:
            files = embedded_corpus(cfg.workdir, progress=lambda m: log(cfg, m))
            if cfg.train_tokenizer is None and cfg.tokenizer is None and "train" not in wanted:
                wanted = ["train", *wanted]  # the default tokenizer is trained on train
            for s in wanted:
                units, ident = _local_plan(stage_inputs([str(files[s])], out), cfg)
                ident = {"embedded": "embedded-v1", "split": s, "bytes": ident["files"][0][1]}
                splits[s] = SplitPlan(s, "embedded", units, "text", detok, ident)
        else:
            mirror = resolve_mirror(cfg.hub_mirror)
            for s in wanted:
                if is_uri(out) or mirror:
                    # A cluster (actors on other nodes cannot read this node's Hugging Face cache), or a mirror:
                    # the hub's Parquet files, read by the actors (data.hub); the driver reads footers only.
                    splits[s] = _hub_split(named, s, mirror, out, text_field, detok, cfg)
                    continue
                ds, start, n = load_hf_split(named, s)
                ident = {"hf": named.hf_path, "name": named.hf_name, "split": named.splits[s], "start": start,
                         "rows": n, "fingerprint": getattr(ds, "_fingerprint", None)}
                units = plan_hf_units(n, cfg.unit_docs, offset=start)
                splits[s] = SplitPlan(s, named.name, units, text_field, detok, ident, hf_dataset=ds)
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
        if not cfg.out:
            raise PrepareError("local sources need --out DIR (where the shards go)")
        out = _output(cfg.out)
        for s, files in by_split.items():
            for f in files:
                if file_kind(f) in ("jsonl", "parquet"):
                    check_text_field(f, text_field)
                else:
                    check_text_file(f)
            units, ident = _local_plan(stage_inputs(files, out), cfg)
            label = ",".join(x.split("=", 1)[-1] for x in local_specs if x.startswith(f"{s}=") or "=" not in x)
            splits[s] = SplitPlan(s, label, units, text_field, detok, ident)

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
    keep_empty = cfg.keep_empty if cfg.keep_empty is not None else bool(named is not None and named.keep_empty)
    for sp in splits.values():
        sp.keep_empty = keep_empty
    return Plan(cfg, str(out), named, splits, tokenizer_spec, train_vocab, length, mode)

def split_docs(plan: Plan, sp: SplitPlan, limit: int | None = None) -> list[str]:
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

def fingerprint(plan: Plan, sp: SplitPlan, tok: TokenizerInfo) -> str:
    payload = {
        "format": FORMAT_VERSION, "identity": sp.identity, "split": sp.split, "text_field": sp.text_field,
        "detokenizer": sp.detokenizer, "tokenizer": tok.content_hash, "length": plan.length, "mode": plan.mode,
        "units": [u.to_dict() for u in sp.units],
        **({"keep_empty": True} if sp.keep_empty else {}),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
