"""The reasoning sources of ``pipelines.prepare_data``: ProsQA-like and ProntoQA-like problems generated here,
GSM8K from the hub, or local files of question/steps/answer rows; written as Parquet shards + a manifest per
split, like every corpus.

    python -m pipelines.prepare_data --source prosqa --out work/data/prosqa
    python -m pipelines.prepare_data --source prosqa --reasoning nodes=10 --reasoning min_path=2 \\
        --reasoning train_rows=2000 --reasoning names=/path/prosqa_valid.json --out work/data/prosqa-small
    python -m pipelines.prepare_data --source prontoqa --reasoning hops=3 --out work/data/prontoqa
    python -m pipelines.prepare_data --source gsm8k --out work/data/gsm8k                    # online
    python -m pipelines.prepare_data --source train=rows.json --source test=test.jsonl --reasoning task=prosqa \\
        --out work/data/mine

Rows are kept as rows, not packed: the layout of a row (how many ``[ANT]``, which steps are left) changes with
the stage of the schedule (``layout``), so the shards hold each row's texts (``question``, ``steps``,
``answer``, its ``anchors``) and their token ids (``question_ids``, ``step_ids``, ``answer_ids``,
``anchor_ids``: the first token of each anchor), and ``extra`` (the row's other keys as JSON: ProsQA's graph).
The manifest's ``mode`` is ``reasoning``, its ``length`` the longest row laid out as plain chain of thought
(stage 0), and its ``options`` hold the marker ids (``[BoA]``, ``[EoA]``, ``[ANT]``, the answer's ``###``).

The default tokenizer is word-level over the rows' words and punctuation (specials ``<pad> <bos> <eos> <mask>
[BoA] [EoA] [ANT] <unk>`` = 0-7), so that a CPU model has a small vocabulary; ``--tokenizer gpt2`` (or any)
encodes the texts with that tokenizer and appends the three markers after its vocabulary. Generated splits
draw ``generate(rows, derive_seed(seed, split code))``: the same options give the same shards on every
machine; a rerun verifies and reuses them; other options are refused unless ``--overwrite``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.core.seeds import derive_seed
from pipelines.core.storage import exists, get_fs, join, read_bytes, resolve_workdir, write_bytes_atomic
from pipelines.data.manifest import Manifest, ShardInfo
from pipelines.data.plan import PrepareConfig, PrepareError, key_values, log
from pipelines.data.reasoning import gsm8k, prontoqa, prosqa
from pipelines.data.reasoning.anchors import ANCHORS, anchors_of
from pipelines.data.reasoning.rows import ReasoningError, Row, parse_rows, read_rows
from pipelines.data.shards import existing_split, shard_name
from pipelines.data.tokenizer import TokenizerInfo, load_tokenizer, tokenizer_from_json

SOURCES = ("prosqa", "prontoqa", "gsm8k")
GENERATED = ("prosqa", "prontoqa")
SPLITS = {"train": 1, "validation": 2, "test": 3}
"""The generated tasks' splits and the codes their seeds derive from (independent streams)."""
ROW_OPTIONS = {"train_rows": 10_000, "validation_rows": 300, "test_rows": 500, "shard_rows": 4096, "seed": 0}
MARKERS = ("[BoA]", "[EoA]", "[ANT]")
ANSWER_MARKER = "###"
SPECIALS = ("<pad>", "<bos>", "<eos>", "<mask>", *MARKERS, "<unk>")
FORMAT = 1


def is_reasoning(cfg: PrepareConfig) -> bool:
    """A reasoning task: one of ``SOURCES`` named, or local files with ``--reasoning`` options."""
    names = [s.lower() for s in cfg.source]
    return names in ([s] for s in SOURCES) or cfg.reasoning is not None


def reasoning_options(cfg: PrepareConfig) -> dict[str, Any]:
    """``cfg.reasoning`` as a mapping (``KEY=VALUE`` strings, values read as JSON where they parse)."""
    return key_values(cfg.reasoning, "reasoning", "train_rows=2000 or task=prosqa")


def _generator_config(task: str, knobs: dict[str, Any]) -> Any:
    try:
        return (prosqa.ProsQAConfig if task == "prosqa" else prontoqa.ProntoQAConfig).from_dict(knobs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ReasoningError):
            raise
        raise ReasoningError(f"--reasoning: {e}") from None


def load_splits(cfg: PrepareConfig, opts: dict[str, Any]) -> tuple[str, str, dict[str, list[Row]], dict[str, Any]]:
    """(task, source label, rows of every split, what identifies them) of the options; one-line errors."""
    opts = dict(opts)
    rows_opts = {k: int(opts.pop(k, d)) for k, d in ROW_OPTIONS.items()}
    names_path = opts.pop("names", None)
    named = [s.lower() for s in cfg.source if s.lower() in SOURCES and "=" not in s]
    task = str(opts.pop("task", named[0] if named else "")).lower()
    if task not in ANCHORS:
        raise ReasoningError(f"--reasoning task={task or '?'}: name the task of the rows ({', '.join(ANCHORS)})")
    if named and (len(cfg.source) > 1 or named[0] != task):
        raise ReasoningError(f"--source {' '.join(cfg.source)}: a named reasoning source stands alone (its task is "
                             "its name); run prepare_data once per source")
    inventory = prosqa.DEFAULT_INVENTORY
    if names_path is not None:
        inventory = prosqa.inventory_from_rows(read_rows(str(names_path)))
    for k, n in rows_opts.items():
        if k != "seed" and n < 1:
            raise ReasoningError(f"--reasoning {k}={n}: must be at least 1")
    if named and task in GENERATED:
        gcfg = _generator_config(task, opts)
        splits = list(cfg.split or SPLITS)
        bad = [s for s in splits if s not in SPLITS]
        if bad:
            raise ReasoningError(f"{task} has no split {bad[0]!r}; it has {', '.join(SPLITS)}")
        gen = prosqa.generate if task == "prosqa" else prontoqa.generate
        out = {s: gen(rows_opts[f"{s}_rows"], derive_seed(rows_opts["seed"], SPLITS[s]), gcfg, inventory)
               for s in splits}
        ident = {"generator": task, "config": vars(gcfg), "seed": rows_opts["seed"],
                 "rows": {s: rows_opts[f"{s}_rows"] for s in splits}, "names": sorted(inventory.people) +
                 sorted(inventory.concepts)}
        return task, task, out, {**ident, "shard_rows": rows_opts["shard_rows"]}
    if opts:
        raise ReasoningError(f"--reasoning {', '.join(sorted(opts))}: options of a generated task (prosqa, "
                             "prontoqa); files and gsm8k take task, names and shard_rows")
    if named:  # gsm8k from the hub
        out = {s: gsm8k.load_gsm8k(s) for s in (cfg.split or gsm8k.SPLITS)}
        return task, task, out, {"hub": gsm8k.HF_PATH, "name": gsm8k.HF_NAME, "shard_rows": rows_opts["shard_rows"]}
    default_split = (cfg.split or ["train"])[0]
    out, files = {}, {}
    for spec in cfg.source:
        split, path = spec.split("=", 1) if "=" in spec else (default_split, spec)
        if not Path(path).is_file():
            raise ReasoningError(f"--source {spec}: no such file; pass SPLIT=PATH with a JSON or JSONL file of "
                                 "question/steps/answer rows")
        rows = (_gsm8k_rows(path) if task == "gsm8k" else read_rows(path))
        out.setdefault(split, []).extend(rows)
        files.setdefault(split, []).append([str(Path(path).resolve()), hashlib.sha256(Path(path).read_bytes())
                                            .hexdigest()])
    return task, ",".join(cfg.source), out, {"files": files, "shard_rows": rows_opts["shard_rows"]}


def _gsm8k_rows(path: str) -> list[Row]:
    """A local GSM8K file: rows in Coconut's format, or GSM8K's own (``answer`` with ``#### N``, no steps)."""
    text = Path(path).read_text(encoding="utf-8")
    if '"steps"' in text:
        return read_rows(path)
    lines = [json.loads(x) for x in text.splitlines() if x.strip()] if not text.lstrip().startswith("[") else \
        json.loads(text)
    return [gsm8k.parse_example(r, f"{path}: row {i}") for i, r in enumerate(lines)] if lines else \
        parse_rows(text, path)


def word_tokenizer(rows: list[Row]) -> str:
    """tokenizer.json of a word-level vocabulary over the rows' words, numbers and punctuation runs (the
    ``Whitespace`` pre-tokenizer's pieces), after ``SPECIALS``; unknown pieces are ``<unk>``."""
    # lazy: keeps tokenizers out of this module's import
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    pre = pre_tokenizers.Whitespace()
    words: set[str] = {ANSWER_MARKER}
    for r in rows:
        for text in (r["question"], r["answer"], *r["steps"]):
            words.update(w for w, _ in pre.pre_tokenize_str(text))
    vocab = {n: i for i, n in enumerate(SPECIALS)}
    for w in sorted(words - set(vocab)):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    tok.add_special_tokens([AddedToken(n, special=True) for n in SPECIALS])
    return tok.to_str()


def encode_rows(task: str, rows: list[Row], info: TokenizerInfo) -> dict[str, list[Any]]:
    """The shard columns of rows (module docstring); texts are encoded with a leading space (a BPE's word
    boundary; the word-level tokenizer ignores it)."""
    anchors = [anchors_of(task, r) for r in rows]
    enc = info.encode
    cols: dict[str, list[Any]] = {
        "question": [r["question"] for r in rows], "steps": [r["steps"] for r in rows],
        "answer": [r["answer"] for r in rows], "anchors": anchors,
        "question_ids": enc([r["question"] for r in rows]),
        "answer_ids": enc([" " + r["answer"] for r in rows]),
        "step_ids": [enc([" " + s for s in r["steps"]]) if r["steps"] else [] for r in rows],
        "anchor_ids": [[ids[0] for ids in enc([" " + a for a in a_s])] if a_s else [] for a_s in anchors],
        "extra": [json.dumps({k: v for k, v in r.items() if k not in ("question", "steps", "answer")},
                             sort_keys=True) for r in rows]}
    return cols


def shard_table_bytes(cols: dict[str, list[Any]], lo: int, hi: int) -> bytes:
    """Parquet bytes of rows ``[lo, hi)`` of the columns; deterministic (no timestamps, no statistics)."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {"question": pa.string(), "steps": pa.list_(pa.string()), "answer": pa.string(),
             "anchors": pa.list_(pa.string()), "question_ids": pa.list_(pa.int32()),
             "step_ids": pa.list_(pa.list_(pa.int32())), "answer_ids": pa.list_(pa.int32()),
             "anchor_ids": pa.list_(pa.int32()), "extra": pa.string()}
    table = pa.table({k: pa.array(cols[k][lo:hi], t) for k, t in types.items()})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=1024, compression="zstd", use_dictionary=False,
                   write_statistics=False)
    return sink.getvalue()


def resolve_reasoning_tokenizer(cfg: PrepareConfig, out: str, rows: list[Row]) -> tuple[TokenizerInfo, dict[str, Any]]:
    """(tokenizer, marker ids): the word-level one written to ``OUT/tokenizer.json``, or ``--tokenizer``'s with
    the markers appended after its vocabulary."""
    if cfg.train_tokenizer:
        raise PrepareError("reasoning rows use a word-level vocabulary or --tokenizer NAME; drop --train-tokenizer")
    if cfg.tokenizer:
        info = load_tokenizer(cfg.tokenizer)
        marker_ids = {m: info.width + j for j, m in enumerate(MARKERS)}
        marker_ids["width"] = info.width + len(MARKERS)
    else:
        tjson = word_tokenizer(rows)
        tok_path = join(out, "tokenizer.json")
        if exists(tok_path) and read_bytes(tok_path).decode("utf-8") != tjson and not cfg.overwrite:
            raise PrepareError(f"{tok_path} holds another vocabulary (other rows); pass --overwrite (or another --out)")
        write_bytes_atomic(tok_path, tjson.encode("utf-8"))
        info = tokenizer_from_json(tjson, "reasoning-words", path=tok_path if "://" in tok_path else
                                   str(Path(tok_path).resolve()))
        vocab = json.loads(tjson)["model"]["vocab"]
        marker_ids = {m: vocab[m] for m in MARKERS}
        marker_ids["width"] = info.width
    answer_ids = info.encode([" " + ANSWER_MARKER])[0]
    marker_ids["answer"] = answer_ids
    return info, marker_ids


def stage0_length(cols: dict[str, list[Any]], i: int, answer_marker: int) -> int:
    """Tokens of row ``i`` laid out as plain chain of thought: BOS, question, [BoA] [EoA], steps, ###, answer,
    EOS (``layout``)."""
    return (1 + len(cols["question_ids"][i]) + 2 + sum(len(s) for s in cols["step_ids"][i]) + answer_marker
            + len(cols["answer_ids"][i]) + 1)


def prepare_reasoning(cfg: PrepareConfig) -> dict[str, Manifest]:
    """Write every split of a reasoning source (module docstring); ``{split: Manifest}``."""
    if cfg.mode not in (None, "wrap", "pad"):
        raise PrepareError(f"--mode {cfg.mode!r}: use wrap or pad")
    opts = reasoning_options(cfg)
    t0 = time.time()
    task, label, splits, ident = load_splits(cfg, opts)
    named = cfg.source[0].lower() if cfg.source[0].lower() in SOURCES else None
    if named is None and not cfg.out:
        raise PrepareError("local sources need --out DIR (where the shards go)")
    out = str(cfg.out or join(resolve_workdir(cfg.workdir), "data", named or "reasoning")).rstrip("/")
    for s, rows in splits.items():
        if not rows:
            raise ReasoningError(f"{s}: no rows")
    all_rows = [r for rows in splits.values() for r in rows]
    info, markers = resolve_reasoning_tokenizer(cfg, out, all_rows)
    results: dict[str, Manifest] = {}
    for split, rows in splits.items():
        digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
        options = {"source": label, "task": task, "identity": ident, "rows_sha256": digest, "format": FORMAT,
                   "tokenizer": info.content_hash, "markers": markers}
        fingerprint = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()
        split_dir = join(out, split)
        done = existing_split(split_dir, cfg, fingerprint)
        if done is not None:
            results[split] = done
            log(cfg, f"{split}: up to date ({len(done.shards)} shards verified) -> {split_dir}", force=True)
            continue
        results[split] = _write_split(task, label, split, rows, split_dir, info, options, fingerprint, cfg)
    log(cfg, f"done in {time.time() - t0:.1f}s: " + ", ".join(f"{s} {m.rows:,} rows" for s, m in results.items()),
        force=True)
    return results


def _project_version() -> str:
    """The installed project's version, read without importing ``adlm_model`` (its torch import costs 2 s)."""
    try:
        return importlib.metadata.version("adlm-pipeline")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return ""


def _write_split(task: str, label: str, split: str, rows: list[Row], split_dir: str, info: TokenizerInfo,
                 options: dict[str, Any], fingerprint: str, cfg: PrepareConfig) -> Manifest:
    # lazy: keeps pyarrow out of this module's import
    import pyarrow

    fs, inner = get_fs(split_dir)
    fs.create_dir(inner, recursive=True)
    cols = encode_rows(task, rows, info)
    per = max(1, int(options["identity"]["shard_rows"]))
    shards: list[ShardInfo] = []
    for k, lo in enumerate(range(0, len(rows), per)):
        data = shard_table_bytes(cols, lo, min(len(rows), lo + per))
        write_bytes_atomic(join(split_dir, shard_name(k)), data)
        shards.append(ShardInfo(shard_name(k), min(per, len(rows) - lo), hashlib.sha256(data).hexdigest(), len(data)))
    n_answer = len(options["markers"]["answer"])
    lengths = [stage0_length(cols, i, n_answer) for i in range(len(rows))]
    counts: dict[str, int] = {}
    for key in ("question_ids", "answer_ids"):
        for ids in cols[key]:
            for t in ids:
                counts[str(t)] = counts.get(str(t), 0) + 1
    truth = {"task": task, "anchors_per_row": float(np.mean([len(a) for a in cols["anchors"]])),
             "steps_per_row": float(np.mean([len(s) for s in cols["steps"]]))}
    if task == "prosqa" and all("edges" in r for r in rows):
        truth["graph"] = prosqa.graph_stats(rows)
    m = Manifest(
        source=label, split=split, tokenizer=info.to_dict(), vocab_size=info.vocab_size, mask_id=info.mask_id,
        bos_id=info.bos_id, eos_id=info.eos_id, pad_id=info.pad_id, length=max(lengths), mode="reasoning",
        rows=len(rows), tokens=int(sum(lengths)), shards=shards, documents=len(rows), documents_used=len(rows),
        token_frequency=dict(sorted(counts.items(), key=lambda kv: int(kv[0]))), project_version=_project_version(),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        versions={"pyarrow": pyarrow.__version__, "numpy": np.__version__, "python": sys.version.split()[0]},
        options={**options, "fingerprint": fingerprint}, truth=truth)
    m.write(split_dir)
    log(cfg, f"{split}: {len(rows):,} {task} rows (longest {max(lengths)} tokens) in {len(shards)} shards -> "
             f"{split_dir}", force=True)
    return m
