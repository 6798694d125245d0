"""Tokenize and pack a corpus into Parquet shards with Ray Data (docs/design/method.md, section 5).

    python -m pipelines.prepare_data --source embedded --out work/data/embedded
    python -m pipelines.prepare_data --source openwebtext --out s3://bucket/owt       # online
    python -m pipelines.prepare_data --source train=corpus/*.jsonl --source validation=val.jsonl \\
        --tokenizer gpt2 --length 1024 --out work/data/mine

Output per split: ``OUT/<split>/part-00000.parquet ...`` (``input_ids``: fixed_size_list<int32>[L]; in
``pad`` mode also ``attention_mask``: fixed_size_list<int8>[L]) and ``OUT/<split>/manifest.json``
(``pipelines.data.manifest``); a trained tokenizer is ``OUT/tokenizer.json``.

Modes (the reference's semantics):

- ``wrap``: EOS appended to every document; the documents, in order, form a token stream cut into rows of
  ``L - 2`` tokens, each framed ``BOS ... EOS``. The stream is packed a unit of work at a time, on the actor
  that tokenised it; each unit's remainder (fewer than ``L - 2`` tokens) goes back to the driver, which packs
  the remainders in unit order into the split's last shard and drops what is left of them (counted as
  ``dropped_tail_tokens``). The cost against one stream over the whole split: none in tokens (the same rows,
  the same fewer than ``L - 2`` dropped tokens; sum of floors plus the floor of the remainders' sum is the floor
  of the sum), only the rows' boundaries differ: a unit's last document continues in a tail row instead of
  the next row. (The reference wraps each batch of 1,000 documents and drops each batch's remainder: up to
  ``L - 3`` tokens lost a batch; this keeps them.)
- ``pad``: one document (sentence) a row, ``BOS ... EOS PAD ...`` with an attention mask; documents
  longer than ``L - 2`` tokens are truncated and counted. Tolerance: before any Ray work the first
  2,000 documents are tokenised; if more than ``--max-truncated`` of them (default 1%) would be cut,
  the run stops and names a length that fits 99% of them.

How the work is split, and why the output is deterministic and resumable:

1. Before Ray starts, the input is cut into *units* with stable indices (byte ranges of text/JSONL files cut
   at newlines, row ranges of one Parquet file each, row ranges of a Hugging Face dataset; a named source on a
   cluster is its Parquet files on the hub, ``data.hub``, of which the driver reads the footers only). Their
   size depends on the input only, never on the cluster.
2. Ray Data runs the units through a class-based ``map_batches`` on an autoscaling actor pool
   (``ActorPoolStrategy``; fractional CPUs so that 2-core machines do not starve; for a small text input, no
   more actors than its size is worth: ``ACTOR_BYTES``). Each actor
   (``data.worker``) loads the tokenizer once and, per unit, reads it where it runs (local, S3, GCS,
   ``hf://``), tokenises it (tiktoken's BPE core for GPT-2, else ``tokenizers``: ``pipelines.data.encoder``),
   packs it and writes ``part-<unit>.parquet`` (``.tmp`` then rename), then the unit's record
   ``_units/<unit>.json`` (rows, sha256, counters, the count of every token id, the remainder). Actors
   whose node dies are restarted and their units done again (same bytes); a transient I/O error is retried.
3. The driver receives only the records, in completion order, sums the token counts, and at the end orders
   the records by unit, writes the tail shard (``wrap``) and ``manifest.json``. Its memory does not grow with
   the corpus beyond a record a unit; nothing re-reads the shards to count tokens.
4. A rerun with the same options keeps every unit whose shard matches its record and does only the others;
   the same input gives byte-identical shards; ``--overwrite`` starts again.

Ray Data's own ``write_parquet`` is not used for the shards: it names files by task and block, which gives
neither deterministic names and bytes nor resumption by unit.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import time
import warnings
from typing import Any

import numpy as np

from pipelines.core.faults import fault
from pipelines.core.logs import get_logger, quiet_ray_data, verbosity
from pipelines.core.placement import own_ray
from pipelines.core.runtime import cpu_work_selector, init_ray
from pipelines.core.storage import delete_dir, exists, get_fs, join, read_bytes, warn_if_node_local, write_bytes_atomic
from pipelines.data.encoder import EncoderError, resolve_engine
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
from pipelines.data.reasoning.source import is_reasoning, prepare_reasoning
from pipelines.data.shards import (
    Progress,
    add_counts,
    load_progress,
    pack_unit,
    shard_bytes,
    shard_name,
    text_array,
    token_counts,
    write_progress,
)
from pipelines.data.sources import Unit
from pipelines.data.synthetic import is_testbed, prepare_testbed
from pipelines.data.tokenizer import TokenizerInfo, load_tokenizer, tokenizer_from_json, train_bpe
from pipelines.data.worker import PrepareUnits

_log = get_logger(__name__)

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
# One split: the units' records in, the tail rows and the manifest out


def _versions() -> dict[str, str]:
    # lazy: keeps pyarrow, ray, tokenizers out of this module's import
    import pyarrow
    import ray
    import tokenizers

    return {"ray": ray.__version__, "pyarrow": pyarrow.__version__, "tokenizers": tokenizers.__version__,
            "numpy": np.__version__, "python": sys.version.split()[0]}


def _project_version() -> str:
    """The installed project's version, read without importing ``adlm_model`` (its torch import costs 2 s)."""
    if "adlm_model" in sys.modules:
        return sys.modules["adlm_model"].__version__
    try:
        return importlib.metadata.version("adlm-pipeline")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        # lazy: keeps torch out of this module's import
        from adlm_model import __version__

        return __version__


STAT_KEYS = ("docs", "used", "empty", "invalid_utf8", "missing_field", "truncated", "tokens")


RATE_AFTER_S = 5.0
"""A rate is printed once the pipeline has run this long: over one unit's arrival it would be noise."""


class SplitRun:
    """One split on the driver: the units' records (small: counters and a remainder each; token counts are summed
    as they arrive), then the tail rows and the manifest. Holds no text and no row."""

    def __init__(self, plan: Plan, sp: SplitPlan, tok: TokenizerInfo, fingerprint: str, progress: Progress,
                 engine: str) -> None:
        self.plan, self.sp, self.tok, self.fingerprint, self.engine = plan, sp, tok, fingerprint, engine
        self.split_dir = join(plan.out, sp.split)
        fs, inner = get_fs(self.split_dir)
        fs.create_dir(inner, recursive=True)
        write_progress(self.split_dir, fingerprint, complete=False)
        self.records = progress.records
        self.counts = progress.counts if progress.counts is not None else np.zeros(tok.width, np.int64)
        self.units_total = len(sp.units) - len(self.records)
        self.units_done = self.new_rows = self.new_tokens = 0
        self.t0: float | None = None

    def todo(self) -> list[Unit]:
        return [u for u in self.sp.units if u.index not in self.records]

    def add(self, rec: dict[str, Any]) -> None:
        """A unit's record, as its actor returned it."""
        add_counts(self.counts, rec.pop("freq"))
        rec["remainder"] = text_array(rec["remainder"], "int32")
        self.records[int(rec["unit"])] = rec
        self.units_done += 1
        self.new_rows += rec["rows"]
        self.new_tokens += rec["stats"]["tokens"]

    def progress_line(self) -> str:
        """Units, rows and tokens so far; their rates over the time since the pipeline started (its actors' start-up
        included), once that is long enough to mean something (``RATE_AFTER_S``)."""
        dt = time.time() - (self.t0 or time.time())
        rates = (f" ({self.new_rows / dt:,.0f} rows/s, {self.new_tokens / dt:,.0f} tokens/s over {dt:.0f} s)"
                 if dt >= RATE_AFTER_S else "")
        return (f"{self.sp.split}: units {self.units_done}/{self.units_total}, rows {self.new_rows:,}, tokens "
                f"{self.new_tokens:,}{rates}")

    def finish(self) -> Manifest:
        """The tail rows (``wrap``: the units' remainders in unit order, packed), the manifest."""
        plan, sp, tok, cfg = self.plan, self.sp, self.tok, self.plan.cfg
        missing = [u.index for u in sp.units if u.index not in self.records]
        if missing:
            raise RuntimeError(f"{sp.split}: units {missing[:5]} never came back from the tokenizer actors; rerun "
                               "(it resumes)")
        ordered = [self.records[u.index] for u in sp.units]
        shards = [ShardInfo(r["name"], r["rows"], r["sha256"], r["bytes"]) for r in ordered if r["name"]]
        dropped = 0
        if plan.mode == "wrap":
            # Each unit packed its own stream; what did not fill a row (fewer than L - 2 tokens a unit) is packed
            # here, in unit order, into the last shard. Rows and dropped tokens are exactly those of packing the
            # whole split as one stream: only the rows' boundaries differ (module docstring).
            rest = [r["remainder"] for r in ordered]
            ids, _, tail, _ = pack_unit("wrap", plan.length, tok.bos_id, tok.eos_id, tok.pad_id,
                                        np.concatenate(rest) if rest else np.zeros(0, np.int32), np.zeros(0, np.int64))
            dropped = int(len(tail))
            if len(ids):
                data = shard_bytes(ids, None)
                name = shard_name(len(sp.units))
                write_bytes_atomic(join(self.split_dir, name), data)
                shards.append(ShardInfo(name, int(len(ids)), hashlib.sha256(data).hexdigest(), len(data)))
                self.counts += token_counts(ids, None, tok.width)
        stats = {k: sum(int(r["stats"][k]) for r in ordered) for k in STAT_KEYS}
        if not shards:
            raise PrepareError(f"{sp.split}: the data gave no rows ({stats['used']} documents, {dropped} tokens "
                               f"for rows of {plan.length - 2}): use a shorter --length or more data")
        skipped = {k: stats[k] for k in ("empty", "missing_field") if stats[k]}
        counts = self.counts
        m = Manifest(
            source=sp.source_label, split=sp.split, tokenizer=tok.to_dict(), vocab_size=tok.vocab_size,
            mask_id=tok.mask_id, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id, length=plan.length,
            mode=plan.mode, rows=sum(s.rows for s in shards), tokens=int(counts.sum()), shards=shards,
            documents=stats["docs"], documents_used=stats["used"], skipped=skipped,
            invalid_utf8_replaced=stats["invalid_utf8"], truncated=stats["truncated"], dropped_tail_tokens=dropped,
            detokenizer=sp.detokenizer, text_field=sp.text_field,
            token_frequency={str(i): int(counts[i]) for i in np.flatnonzero(counts)},
            project_version=_project_version(), created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            versions=_versions(),
            options={"source": cfg.source, "tokenizer": plan.tokenizer_spec, "train_tokenizer": plan.train_vocab,
                     "length": plan.length, "mode": plan.mode, "text_unit": cfg.text_unit, "units": len(sp.units),
                     "packing": "per unit, remainders in unit order into the last shard" if plan.mode == "wrap"
                     else "one document a row", "fingerprint": self.fingerprint, "engine": self.engine,
                     "keep_empty": sp.keep_empty},
        )
        m.write(self.split_dir)
        write_progress(self.split_dir, self.fingerprint, complete=True)
        log(cfg, f"{sp.split}: {m.rows:,} rows x {m.length} in {len(m.shards)} shards, {m.tokens:,} tokens, "
                  f"{m.documents_used:,}/{m.documents:,} documents used, skipped {m.skipped or 'none'}, invalid "
                  f"UTF-8 {m.invalid_utf8_replaced}, truncated {m.truncated}, tail dropped {m.dropped_tail_tokens}; "
                  f"{self.new_tokens:,} stream tokens tokenised by this run "
                  f"-> {self.split_dir}", force=True)
        return m


def run_splits(plan: Plan, tok: TokenizerInfo, runs: dict[str, SplitRun], engine: str) -> dict[str, Manifest]:
    """One Ray Data pipeline over the remaining units of every split (one actor pool for all of them); the
    driver receives the units' records only, in whatever order they complete."""
    # lazy: keeps ray out of this module's import
    import ray
    import ray.data as rdata

    cfg = plan.cfg
    items = [{**u.to_dict(), "split": s} for s, run in runs.items() for u in run.todo()]
    fail_after = fault("prepare.fail_after_shards") or 0
    received = 0
    if items:
        ctx = rdata.DataContext.get_current()
        saved = (ctx.execution_options.preserve_order, ctx.execution_options.label_selector, ctx.enable_progress_bars,
                 ctx.print_on_execution_start)
        ctx.execution_options.preserve_order = False  # the records are ordered by unit index at the end
        ctx.execution_options.label_selector = cpu_work_selector()  # every task and actor: never on a GPU node
        ctx.enable_progress_bars = False  # the driver's own bar below: one for the whole stage
        ctx.print_on_execution_start = False
        quiet_ray_data()
        sized = all(u["kind"] in ("text", "jsonl") for u in items)  # byte ranges; rows elsewhere
        low, high = actor_pool_bounds(cfg, len(items), sum(u["stop"] - u["start"] for u in items) if sized else None)
        per_split = {s: {"text_field": r.sp.text_field, "detokenizer": r.sp.detokenizer, "hf_dataset": r.sp.hf_dataset,
                         "keep_empty": r.sp.keep_empty, "split_dir": r.split_dir, "fingerprint": r.fingerprint}
                     for s, r in runs.items()}
        frame = {"mode": plan.mode, "length": plan.length, "bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id,
                 "width": tok.width}
        started = time.time()
        for r in runs.values():
            r.t0 = started
        # lazy: keeps tqdm out of this module's import
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc="prepare", unit="unit", disable=verbosity() < 0, dynamic_ncols=True)
        try:
            ds = rdata.from_items(items, override_num_blocks=len(items))
            # Spot nodes go away: Ray Data's actor pool defaults are kept on purpose, max_restarts=-1 (an
            # actor whose node died is started again elsewhere) and max_task_retries=-1 (its units are submitted
            # again until it is back: a bounded count runs out within seconds while the cluster has not yet
            # declared the node dead, each try failing "actor temporarily unavailable"). A unit done twice writes
            # the same bytes. The restarted actor's constructor arguments (the tokenizer) are owned by this driver,
            # on the head node, which outlives worker nodes. Transient I/O errors are retried inside the actor
            # (data.worker), a bounded number of times, so a permanent one cannot loop forever.
            with warnings.catch_warnings():
                # A one-node Ray this process started has no node to lose: its actors are not restarted. (Ray's default
                # restarts them, and for an actor whose constructor arguments are in the object store, as the
                # tokenizer is, prints an error line on the console.) Ray 2.60 takes max_restarts only among the
                # extra remote arguments, which it marks deprecated.
                warnings.simplefilter("ignore", DeprecationWarning)
                ds = ds.map_batches(
                    PrepareUnits, batch_size=1, batch_format="pyarrow",
                    fn_constructor_kwargs=dict(tokenizer_json=tok.tokenizer_json, splits=per_split,
                                               text_unit=cfg.text_unit, frame=frame, engine=engine),
                    compute=rdata.ActorPoolStrategy(min_size=low, max_size=high), num_cpus=cfg.actor_cpus,
                    **({"max_restarts": 0} if own_ray() and len([n for n in ray.nodes() if n["Alive"]]) == 1 else {}))
            last_print = time.time()
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
                for s, rec in zip(batch.column("split").to_pylist(), batch.column("record").to_pylist(), strict=True):
                    runs[s].add(json.loads(rec))
                    received += 1
                    bar.update(1)
                    if fail_after and received >= fail_after:
                        raise RuntimeError(f"fault prepare.fail_after_shards={fail_after}: simulated crash after "
                                           f"{received} units")
                if time.time() - last_print >= cfg.progress_interval:
                    bar.set_postfix_str(f"rows {sum(r.new_rows for r in runs.values()):,}")
                    _log.debug("; ".join(r.progress_line() for r in runs.values()))  # -v
                    last_print = time.time()
        finally:
            bar.close()
            (ctx.execution_options.preserve_order, ctx.execution_options.label_selector, ctx.enable_progress_bars,
             ctx.print_on_execution_start) = saved
    return {s: run.finish() for s, run in runs.items()}

# ----------------------------------------------------------------------------------------------------------
# Entry point


ACTOR_BYTES = 4 << 20
"""Input text worth one more tokenizer actor. An actor's start (a process, its imports, the tokenizer) costs about
the CPU of tokenizing a few MB, and a small input's units take milliseconds each: the pool, growing while units
wait, started actors that had nothing left to do (a 132 KB prepare on 2 cores: 5.6-6.1 CPU-seconds and 3.4 s,
against 2.2-2.4 and 2.0 s with one actor; measured)."""


def actor_pool_bounds(cfg: PrepareConfig, units: int, text_bytes: int | None = None) -> tuple[int, int]:
    """(min, max) of the tokenizer actor pool: an autoscaling pool that starts at ``--min-actors`` and grows (up
    to one actor a unit of work, or ``--actors``) as the cluster offers CPUs, instead of being sized from the
    CPUs present at start (none on a cluster whose workers are still launching); Ray Data asks the autoscaler
    for the nodes, and idle actors go when the stream ends. ``text_bytes``: the input's size where its units are
    byte ranges (text, JSONL); without ``--actors``, one actor per ``ACTOR_BYTES`` of it at most."""
    high = max(1, min(cfg.actors or MAX_ACTORS, units))
    if cfg.actors is None and text_bytes is not None:
        high = min(high, max(1, -(-text_bytes // ACTOR_BYTES)))
    return min(cfg.min_actors, high), high


def prepare(config: PrepareConfig | None = None, *, shutdown_ray: bool = False) -> dict[str, Manifest]:
    """Prepare every split of ``config`` (None: the defaults; a mapping of options: ``PrepareConfig.from_dict``).

    Returns ``{split: Manifest}``. Bad input raises PrepareError / SourceError / TokenizerError (all
    ValueError) before Ray starts. Splits already complete with the same options are verified and reused.
    """
    cfg = config if config is not None else PrepareConfig()
    if not isinstance(cfg, PrepareConfig):
        raise TypeError(f"prepare() takes a PrepareConfig (PrepareConfig.from_dict for a mapping), not {type(cfg)}")
    if is_testbed(cfg):  # generated, not read: no tokenisation, no Ray
        return prepare_testbed(cfg)
    if is_reasoning(cfg):  # rows kept as rows (their layout changes with the stage): no packing, no Ray
        return prepare_reasoning(cfg)
    t0 = time.time()
    plan = make_plan(cfg)
    if cfg.overwrite:
        for s in plan.splits:
            delete_dir(join(plan.out, s))  # a split that cannot be deleted fails here, not under new shards
    tok = resolve_tokenizer(plan)
    try:
        engine = resolve_engine(tok.tokenizer_json, cfg.engine)
    except EncoderError as e:
        raise PrepareError(str(e)) from e
    if plan.mode == "pad":
        for sp in plan.splits.values():
            check_pad_length(plan, sp, tok)
    todo: dict[str, tuple[SplitPlan, str, Progress]] = {}
    results: dict[str, Manifest] = {}
    for s, sp in plan.splits.items():
        fp = fingerprint(plan, sp, tok)
        pr = load_progress(join(plan.out, s), fp, tok.width, lambda m: log(cfg, m))
        if pr.complete:
            results[s] = read_manifest(join(plan.out, s))
            log(cfg, f"{s}: up to date ({len(results[s].shards)} shards verified) -> {join(plan.out, s)}", force=True)
        else:
            if pr.records:
                log(cfg, f"{s}: resuming: {len(pr.records)} of {len(sp.units)} units already done", force=True)
            todo[s] = (sp, fp, pr)
    if todo:
        log(cfg, f"tokenizer {tok.name} (vocab {tok.vocab_size}, bos {tok.bos_id}, eos {tok.eos_id}, pad "
                  f"{tok.pad_id}, mask {tok.mask_id}; engine {engine}); mode {plan.mode}, length {plan.length}; "
                  f"splits {', '.join(todo)} -> {plan.out}")
        started = init_ray(cfg.ray_address, dashboard=False)
        try:
            if warn_if_node_local([plan.out], "prepare_data's output") and any(
                    sp.hf_dataset is not None for sp, _, _ in todo.values()):
                # Read from the hub's files only for a remote output or a mirror (data.plan.make_plan); here the
                # tokenizer actors would read this node's Hugging Face cache.
                raise PrepareError(f"--out {plan.out} is on this node's disk, and Ray's tokenizer actors run on other "
                                   "nodes that cannot read its Hugging Face cache: write to an object store (--out "
                                   "s3://... or ADLM_WORKDIR=s3://...)")
            runs = {s: SplitRun(plan, sp, tok, fp, pr, engine) for s, (sp, fp, pr) in todo.items()}
            results.update(run_splits(plan, tok, runs, engine))
        finally:
            if started and shutdown_ray:
                # lazy: keeps ray out of this module's import
                import ray

                ray.shutdown()
    log(cfg, f"done in {time.time() - t0:.1f}s: " + ", ".join(f"{s} {m.rows:,} rows" for s, m in results.items()),
         force=True)
    return {s: results[s] for s in plan.splits}
