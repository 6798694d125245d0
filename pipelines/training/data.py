"""The data a training run reads: both splits' manifests checked against the model before Ray starts.

``plan_data`` refuses data that does not fit the model (tokenizer vocabulary, mask id, length), splits
tokenised differently, missing shards and splits too small for one batch, each in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from adlm_model.config import ConfigError
from pipelines.core.storage import exists, is_file
from pipelines.data.manifest import Manifest, ManifestError, read_manifest
from pipelines.training.config import TrainConfig


@dataclass
class DataPlan:
    """What the driver and the workers need to know about the two splits."""

    train_uris: list[str]
    """Training shards (Ray Data reads them)."""
    val_split: str
    """Validation split folder (the workers read their rows of it)."""
    columns: list[str]
    """``input_ids`` (+ ``attention_mask`` in pad mode)."""
    manifest_hash: str
    """Content hash of the training split (tags, params, checkpoints)."""
    tokenizer_spec: str
    tokenizer_path: str | None
    """The data's ``tokenizer.json`` (a local path or a URI) to copy into checkpoints, if it has one."""
    train_rows: int
    val_rows: int
    tokenizer_hash: str = ""
    """The tokenizer's identity (``TokenizerInfo.content_hash``): two tokenizers of one size differ here."""
    train_manifest: Manifest | None = None
    """The training split's manifest (its shards' rows: Ray Data reads them without sampling the files)."""


def plan_data(cfg: TrainConfig, workdir: str) -> DataPlan:
    """Read both manifests and refuse data that does not fit the model; one-line errors."""
    manifests = {}
    for split in ("train", "validation"):
        d = cfg.resolve_path(getattr(cfg.data, split), workdir)
        try:
            m = read_manifest(d)
        except ManifestError as e:
            raise ConfigError(f"data.{split}: {e}") from None
        m.check_fits(cfg.model)
        missing = [u for u in m.shard_uris() if not exists(u)]
        if missing or not m.shards:
            raise ConfigError(f"data.{split}: shard {missing[0] if missing else '(none listed)'} is missing; "
                              "rerun pipelines.prepare_data for this split")
        try:
            m.check_shards()  # their footers: a truncated shard or a manifest that lies, before any work
        except ManifestError as e:
            raise ConfigError(f"data.{split}: {e}") from None
        manifests[split] = m
    tr, va = manifests["train"], manifests["validation"]
    for split, m in manifests.items():
        if cfg.data.mode and m.mode != cfg.data.mode:
            raise ConfigError(f"data.{split} was prepared in {m.mode} mode but the recipe wants {cfg.data.mode} (data.mode);"
                              f" prepare it with --mode {cfg.data.mode}")
    if tr.tokenizer.get("hash") != va.tokenizer.get("hash"):
        raise ConfigError("data.train and data.validation were tokenized differently; prepare both with one tokenizer")
    need = cfg.batch.micro_batch * cfg.world
    if tr.rows < need:
        raise ConfigError(f"data.train has {tr.rows} rows, fewer than micro_batch x workers = {need}; "
                          "use more data or a smaller batch.micro_batch")
    if va.rows < need:
        raise ConfigError(f"data.validation has {va.rows} rows, fewer than micro_batch x workers = {need}; "
                          "use more data or a smaller batch.micro_batch")
    cols = ["input_ids"] + (["attention_mask"] if tr.mode == "pad" else [])
    tok_path = tr.tokenizer.get("path")
    return DataPlan(train_uris=tr.shard_uris(), val_split=va.split_dir, columns=cols,
                    manifest_hash=tr.content_hash(), tokenizer_spec=str(tok_path or tr.tokenizer.get("name")),
                    tokenizer_path=tok_path if tok_path and is_file(tok_path) else None,
                    train_rows=tr.rows, val_rows=va.rows, tokenizer_hash=str(tr.tokenizer.get("hash") or ""),
                    train_manifest=tr)
