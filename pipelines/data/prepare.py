"""Tokenize and pack a corpus into Parquet shards with Ray Data (METHOD.md section 5).

    python -m pipelines.prepare_data --source embedded --out work/data/embedded
    python -m pipelines.prepare_data --source openwebtext --out s3://bucket/owt       # online
    python -m pipelines.prepare_data --source train=corpus/*.jsonl --source validation=val.jsonl \\
        --tokenizer gpt2 --length 1024 --out work/data/mine

Output per split: ``OUT/<split>/part-00000.parquet ...`` (``input_ids``: fixed_size_list<int32>[L]; in
``pad`` mode also ``attention_mask``: fixed_size_list<int8>[L]) and ``OUT/<split>/manifest.json``
(``pipelines.data.manifest``); a trained tokenizer is ``OUT/tokenizer.json``.

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
   ``pipelines.data.encoder``: tiktoken's BPE core for GPT-2 (same ids, several times faster), else the
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
import json
import os
import sys
import time
import warnings
from typing import Any

import numpy as np

from pipelines.data.detokenizers import get_detokenizer
from pipelines.data.encoder import DocEncoder, EncoderError, resolve_engine
from pipelines.data.manifest import Manifest, ShardInfo, read_manifest
from pipelines.data.plan import (
    MAX_ACTORS,
    Plan,
    PrepareConfig,
    PrepareError,
    SplitPlan,
    fingerprint,
    log,
    make_plan,
    split_docs,
)
from pipelines.data.shards import (
    Packer,
    State,
    load_progress,
    shard_bytes,
    shard_name,
    token_frequency,
    write_progress,
)
from pipelines.data.sources import read_unit
from pipelines.data.tokenizer import TokenizerInfo, load_tokenizer, train_bpe
from pipelines.faults import fault
from pipelines.runtime import init_ray
from pipelines.storage import exists, get_fs, join, read_bytes, warn_if_node_local, write_bytes_atomic

# ----------------------------------------------------------------------------------------------------------
# The tokenizer (trained or loaded) and the pad-mode length check


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
            from pipelines.data.tokenizer import tokenizer_from_json

            info = tokenizer_from_json(read_bytes(tok_path).decode("utf-8"), f"bpe-{plan.train_vocab}",
                                       path=tok_path if "://" in tok_path else os.path.abspath(tok_path))
            log(cfg, f"reusing the trained tokenizer {tok_path}")
        else:
            t0 = time.time()
            docs = split_docs(plan, plan.splits["train"])
            if not docs:
                raise PrepareError("the train split holds no text to train a tokenizer on")
            info = train_bpe(iter(docs), plan.train_vocab, name=f"bpe-{plan.train_vocab}")
            write_bytes_atomic(tok_path, info.tokenizer_json.encode("utf-8"))
            write_bytes_atomic(meta_path, json.dumps(trained_on, sort_keys=True).encode())
            info.path = tok_path if "://" in tok_path else os.path.abspath(tok_path)
            log(cfg, f"trained a {info.vocab_size}-entry byte-level BPE on {len(docs)} train documents in "
                      f"{time.time() - t0:.1f}s -> {tok_path}")
    else:
        info = load_tokenizer(plan.tokenizer_spec)
    if plan.mode == "wrap":
        info.require("bos", "eos")
    else:
        info.require("bos", "eos", "pad")
    return info

def check_pad_length(plan: Plan, sp: SplitPlan, tok: TokenizerInfo, sample: int = 2000) -> None:
    """``pad`` mode: refuse a length that truncates more than ``--max-truncated`` of the first documents."""
    docs = split_docs(plan, sp, limit=sample)
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
            keep = docs if conf["keep_empty"] else [d for d in docs if d.strip()]
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
        write_progress(self.split_dir, self.fingerprint, self.state, complete=False)

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
        write_progress(self.split_dir, self.fingerprint, self.state, complete=True)
        counts, real_tokens = token_frequency(self.split_dir, self.state.shards, tok.width, plan.mode)
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
                     "engine": self.engine, "keep_empty": sp.keep_empty},
        )
        m.write(self.split_dir)
        dt = time.time() - (self.t0 or time.time())
        log(cfg, f"{sp.split}: {m.rows:,} rows x {m.length} in {len(m.shards)} shards, {m.tokens:,} tokens, "
                  f"{m.documents_used:,}/{m.documents:,} documents used, skipped {m.skipped or 'none'}, invalid "
                  f"UTF-8 {m.invalid_utf8_replaced}, truncated {m.truncated}, tail dropped {m.dropped_tail_tokens}; "
                  f"{self.new_tokens:,} tokens in {dt:.1f}s ({self.new_tokens / max(dt, 1e-9):,.0f} tokens/s) "
                  f"-> {self.split_dir}", force=True)
        return m

def run_splits(plan: Plan, tok: TokenizerInfo, runs: dict[str, SplitRun], engine: str) -> dict[str, Manifest]:
    """One Ray Data pipeline over the remaining units of every split (one actor pool for all of them)."""
    import ray.data as rdata

    cfg = plan.cfg
    items = []
    for s, run in runs.items():
        sp = run.sp
        for u in sp.units:
            if u.index >= run.state.next_unit:
                items.append({**u.to_dict(), "split": s, "seq": len(items)})
    results: dict[str, Manifest] = {}
    fail_after = fault("prepare.fail_after_shards") or 0
    committed = 0
    order = list(runs)
    if items:
        ctx = rdata.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # the stream order is the packing order
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        low, high = actor_pool_bounds(cfg, len(items))
        per_split = {s: {"text_field": r.sp.text_field, "detokenizer": r.sp.detokenizer,
                         "hf_dataset": r.sp.hf_dataset, "keep_empty": r.sp.keep_empty} for s, r in runs.items()}
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
                compute=rdata.ActorPoolStrategy(min_size=low, max_size=high), num_cpus=cfg.actor_cpus, max_restarts=0)
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
                    raise RuntimeError(f"fault prepare.fail_after_shards={fail_after}: simulated crash after {committed} shards")
            if time.time() - last_print >= cfg.progress_interval and current is not None:
                log(cfg, runs[current].progress_line())
                last_print = time.time()
    for s in order:
        results[s] = runs[s].finish()
    return results

# ----------------------------------------------------------------------------------------------------------
# Entry point


def _coerce(cfg: Any) -> PrepareConfig:
    """A PrepareConfig from itself, a dict of its fields or the CLI's argparse.Namespace."""
    if isinstance(cfg, PrepareConfig):
        return cfg
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
    raise TypeError(f"prepare() takes a PrepareConfig, dict or argparse.Namespace, not {type(cfg)}")


def actor_pool_bounds(cfg: PrepareConfig, units: int) -> tuple[int, int]:
    """(min, max) of the tokenizer actor pool: an autoscaling pool that starts at ``--min-actors`` and grows (up
    to one actor a unit of work, or ``--actors``) as the cluster offers CPUs, instead of being sized from the
    CPUs present at start (none on a cluster whose workers are still launching); Ray Data asks the autoscaler
    for the nodes, and idle actors go when the stream ends."""
    high = max(1, min(cfg.actors or MAX_ACTORS, units))
    return min(cfg.min_actors, high), high


def prepare(config: Any = None, *, shutdown_ray: bool = False) -> dict[str, Manifest]:
    """Prepare every split of ``config`` (PrepareConfig, dict, argparse.Namespace or argv list).

    Returns ``{split: Manifest}``. Bad input raises PrepareError / SourceError / TokenizerError (all
    ValueError) before Ray starts. Splits already complete with the same options are verified and reused.
    """
    cfg = _coerce(config if config is not None else PrepareConfig())
    from pipelines.data.synthetic import is_testbed, prepare_testbed

    if is_testbed(cfg):  # generated, not read: no tokenisation, no Ray
        return prepare_testbed(cfg)
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
        fp = fingerprint(plan, sp, tok)
        st, complete = load_progress(join(plan.out, s), fp, lambda m: log(cfg, m))
        if complete:
            results[s] = read_manifest(join(plan.out, s))
            log(cfg, f"{s}: up to date ({len(st.shards)} shards verified) -> {join(plan.out, s)}", force=True)
        else:
            if st.shards:
                log(cfg, f"{s}: resuming after {len(st.shards)} verified shards (unit {st.next_unit}/"
                          f"{len(sp.units)})", force=True)
            todo[s] = (sp, fp, st)
    if todo:
        log(cfg, f"tokenizer {tok.name} (vocab {tok.vocab_size}, bos {tok.bos_id}, eos {tok.eos_id}, pad "
                  f"{tok.pad_id}, mask {tok.mask_id}; engine {engine}); mode {plan.mode}, length {plan.length}; "
                  f"splits {', '.join(todo)} -> {plan.out}")
        started = init_ray(cfg.ray_address, dashboard=False)
        try:
            if warn_if_node_local([plan.out], "prepare_data's output") and any(
                    sp.hf_dataset is not None for sp, _, _ in todo.values()):
                # Staged to the store only for a remote output (data.plan.make_plan); here the tokenizer actors
                # would read this node's Hugging Face cache.
                raise PrepareError(f"--out {plan.out} is on this node's disk, and Ray's tokenizer actors run on other "
                                   "nodes that cannot read its Hugging Face cache: write to an object store (--out "
                                   "s3://... or ADLM_WORKDIR=s3://...)")
            runs = {s: SplitRun(plan, sp, tok, fp, st, engine) for s, (sp, fp, st) in todo.items()}
            results.update(run_splits(plan, tok, runs, engine))
        finally:
            if started and shutdown_ray:
                import ray

                ray.shutdown()
    log(cfg, f"done in {time.time() - t0:.1f}s: " + ", ".join(f"{s} {m.rows:,} rows" for s, m in results.items()),
         force=True)
    return {s: results[s] for s in plan.splits}
