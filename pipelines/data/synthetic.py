"""The ``testbed`` source: shards of the ground-truth synthetic language (``adlm_model.testbed.language``), with its exact
entropy and floors in every split's manifest.

    python -m pipelines.prepare_data --source testbed --out work/data/testbed
    python -m pipelines.prepare_data --source testbed --testbed n_classes=32 --testbed train_rows=50000 --out DIR
    python -m pipelines.prepare_data --source testbed --testbed preset=natural --out work/data/natural

``--testbed preset=natural`` picks the language with natural text's confidence profile
(``adlm_model.testbed.natural``; its own defaults, e.g. 256 symbols); the default is the anchored one.
Rows are drawn from the language itself (no text, no tokenisation, no Ray): shard ``k`` of split ``s`` holds
``Testbed.sample(rows, derive_seed(seed, s, k))``, so the same options give byte-identical shards on every
machine. The output has the layout of every corpus: ``OUT/tokenizer.json`` (a word-level tokenizer over the
language's symbols, specials ``<pad> <bos> <eos> <mask>`` = 0-3, so the mask id lies inside the vocabulary),
``OUT/<split>/part-*.parquet`` and ``OUT/<split>/manifest.json``, whose ``truth`` holds the testbed's config,
its exact entropy per token (with its standard error), the unigram and unigram + position floors and what the
anchors are worth (``Testbed.summary``). A rerun with the same options verifies the shards and reuses them;
other options are refused unless ``--overwrite``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

from pipelines.core.seeds import derive_seed
from pipelines.core.storage import exists, get_fs, join, resolve_workdir, write_bytes_atomic
from pipelines.data.manifest import Manifest, ShardInfo
from pipelines.data.plan import PrepareConfig, PrepareError, key_values, log
from pipelines.data.shards import existing_split, shard_bytes, shard_name
from pipelines.data.tokenizer import TokenizerInfo, tokenizer_from_json

SOURCE = "testbed"
SPLITS = {"train": 1, "validation": 2, "test": 3}
"""The testbed's splits and the code each one's row seeds derive from (independent streams)."""
ROW_OPTIONS = {"train_rows": 200_000, "validation_rows": 2048, "test_rows": 2048, "shard_rows": 4096}
"""Rows per split (``--testbed train_rows=N``) and per shard (``shard_rows``); the rest of ``--testbed`` are
``TestbedConfig`` fields."""
FORMAT = 1


def is_testbed(cfg: PrepareConfig) -> bool:
    return [s.lower() for s in cfg.source] == [SOURCE]


def testbed_options(cfg: PrepareConfig) -> tuple[dict[str, Any], dict[str, int]]:
    """(TestbedConfig fields, rows per split) from ``cfg.testbed`` (``KEY=VALUE`` strings or a mapping) and
    ``--length``; PrepareError naming a bad key or value."""
    # lazy: keeps torch out of this module's import
    from adlm_model.testbed.language import TestbedConfig, TestbedError

    raw = key_values(cfg.testbed, "testbed", "n_classes=16 or train_rows=50000")
    rows = {k: int(raw.get(k, d)) for k, d in ROW_OPTIONS.items()}
    fields = {k: v for k, v in raw.items() if k not in ROW_OPTIONS}
    if cfg.length is not None:
        if "length" in fields and fields["length"] != cfg.length:
            raise PrepareError(f"--length {cfg.length} and --testbed length={fields['length']} disagree; pass one")
        fields["length"] = cfg.length
    try:
        TestbedConfig.from_dict(fields)
    except (TestbedError, TypeError) as e:
        raise PrepareError(f"--testbed: {e}; row counts: {', '.join(ROW_OPTIONS)}") from None
    for k, n in rows.items():
        if n < 1:
            raise PrepareError(f"--testbed {k}={n}: every split needs at least one row")
    return fields, rows


def testbed_tokenizer(names: list[str]) -> str:
    """tokenizer.json of the language: one word a symbol, split on whitespace; specials recognised by name."""
    # lazy: keeps tokenizers out of this module's import
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={n: i for i, n in enumerate(names)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(n, special=True) for n in names[:4]])
    return tok.to_str()


def _check_tokenizer(info: TokenizerInfo) -> None:
    # lazy: keeps torch out of this module's import
    from adlm_model.testbed.language import BOS_ID, EOS_ID, MASK_ID, PAD_ID

    got = (info.bos_id, info.eos_id, info.pad_id, info.mask_id)
    if got != (BOS_ID, EOS_ID, PAD_ID, MASK_ID):
        raise PrepareError(f"the testbed tokenizer's special ids {got} differ from the language's; a bug")


def prepare_testbed(cfg: PrepareConfig) -> dict[str, Manifest]:
    """Write the testbed's splits (module docstring); returns ``{split: Manifest}``."""
    # lazy: keeps torch out of this module's import
    from adlm_model.testbed.language import Testbed, TestbedConfig

    fields, rows = testbed_options(cfg)
    splits = list(cfg.split or SPLITS)
    bad = [s for s in splits if s not in SPLITS]
    if bad:
        raise PrepareError(f"testbed has no split {bad[0]!r}; it has {', '.join(SPLITS)}")
    if cfg.tokenizer or cfg.train_tokenizer:
        raise PrepareError("the testbed brings its own tokenizer (one word a symbol); drop --tokenizer/--train-tokenizer")
    if cfg.mode not in (None, "wrap"):
        raise PrepareError("testbed rows are framed BOS ... EOS with no padding (wrap mode); drop --mode pad")
    out = cfg.out or join(resolve_workdir(cfg.workdir), "data", SOURCE)
    t0 = time.time()
    tcfg = TestbedConfig.from_dict(fields)
    tb = Testbed(tcfg)
    tjson = testbed_tokenizer(tb.token_names())
    tok_path = join(out, "tokenizer.json")
    if cfg.overwrite or not exists(tok_path):
        write_bytes_atomic(tok_path, tjson.encode("utf-8"))
    info = tokenizer_from_json(tjson, SOURCE, path=tok_path if "://" in tok_path else _abs(tok_path))
    _check_tokenizer(info)
    results: dict[str, Manifest] = {}
    truth: dict[str, Any] | None = None
    for split in splits:
        options = {"source": SOURCE, "testbed": tcfg.to_dict(), "rows": rows[f"{split}_rows"],
                   "shard_rows": rows["shard_rows"], "format": FORMAT}
        fingerprint = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()
        split_dir = join(out, split)
        done = existing_split(split_dir, cfg, fingerprint, info.content_hash, "testbed data")
        if done is not None:
            results[split] = done
            log(cfg, f"{split}: up to date ({len(done.shards)} shards verified) -> {split_dir}", force=True)
            continue
        if truth is None:
            log(cfg, f"testbed: computing the exact entropy ({tcfg.entropy_rows:,} rows), floors and anchor value")
            truth = tb.summary()
            log(cfg, f"testbed: entropy {truth['entropy_per_token']:.4f} ± {truth['entropy_per_token_se']:.4f} "
                     f"nats/token, floors unigram {truth['floors']['unigram']:.4f}, unigram+position "
                     f"{truth['floors']['unigram_position']:.4f}", force=True)
        results[split] = _write_split(tb, split, rows[f"{split}_rows"], split_dir, info, options, fingerprint,
                                      truth, cfg)
    log(cfg, f"done in {time.time() - t0:.1f}s: " + ", ".join(f"{s} {m.rows:,} rows" for s, m in results.items()),
        force=True)
    return results


def _abs(p: str) -> str:
    return os.path.abspath(p)


def _write_split(tb: Any, split: str, n_rows: int, split_dir: str, info: TokenizerInfo, options: dict[str, Any],
                 fingerprint: str, truth: dict[str, Any], cfg: PrepareConfig) -> Manifest:
    fs, inner = get_fs(split_dir)
    fs.create_dir(inner, recursive=True)
    seed = tb.config.seed
    shards: list[ShardInfo] = []
    counts = np.zeros(tb.vocab_size, np.int64)
    per = max(1, int(options["shard_rows"]))
    for k, start in enumerate(range(0, n_rows, per)):
        ids = tb.sample(min(per, n_rows - start), derive_seed(seed, SPLITS[split], k)).numpy().astype(np.int32)
        counts += np.bincount(ids.reshape(-1), minlength=tb.vocab_size)
        data = shard_bytes(ids, None)
        name = shard_name(k)
        write_bytes_atomic(join(split_dir, name), data)
        shards.append(ShardInfo(name, int(len(ids)), hashlib.sha256(data).hexdigest(), len(data)))
        log(cfg, f"{split}: shard {k} ({start + len(ids):,}/{n_rows:,} rows)")
    # lazy: keeps pyarrow, torch out of this module's import
    import pyarrow
    import torch

    # lazy: keeps torch out of this module's import
    from adlm_model import __version__

    m = Manifest(
        source=SOURCE, split=split, tokenizer=info.to_dict(), vocab_size=info.vocab_size, mask_id=info.mask_id,
        bos_id=info.bos_id, eos_id=info.eos_id, pad_id=info.pad_id, length=tb.length, mode="wrap", rows=n_rows,
        tokens=n_rows * tb.length, shards=shards, documents=n_rows, documents_used=n_rows,
        token_frequency={str(i): int(c) for i, c in enumerate(counts) if c}, project_version=__version__,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        versions={"torch": torch.__version__, "numpy": np.__version__, "pyarrow": pyarrow.__version__,
                  "python": sys.version.split()[0]},
        options={**options, "fingerprint": fingerprint, "row_seeds": f"derive_seed({seed}, {SPLITS[split]}, shard)"},
        truth=truth)
    m.write(split_dir)
    log(cfg, f"{split}: {n_rows:,} rows x {tb.length} in {len(shards)} shards -> {split_dir}", force=True)
    return m
