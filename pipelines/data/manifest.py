"""The manifest of one prepared split: what the shards hold and how they were made (docs/design/method.md, section 5).

``python -m pipelines.prepare_data ... --out DIR`` writes ``DIR/<split>/part-00000.parquet ...`` (column
``input_ids``: fixed_size_list<int32>[L]; in ``pad`` mode also ``attention_mask``: fixed_size_list<int8>[L])
and ``DIR/<split>/manifest.json``. Training and evaluation call ``read_manifest(split_dir)`` and
``Manifest.check_fits(model_cfg)`` so that data made with another tokenizer, mask id or length is refused
with one clear line instead of training on garbage.

Paths may be local or object-store URIs (``s3://``, ``file://``) through ``pipelines.core.storage``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pipelines.core.logs import first_line
from pipelines.core.storage import exists, get_fs, is_uri, join, read_bytes, sha256_file, write_bytes_atomic

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1


class DataMismatchError(ValueError):
    """Prepared data that does not fit the model (tokenizer vocabulary, mask id, length)."""


class ManifestError(ValueError):
    """A missing, unreadable or inconsistent manifest / shard; the message says the fix."""


@dataclass
class ShardInfo:
    """One Parquet shard of a split."""

    name: str
    """File name inside the split folder (``part-00000.parquet``)."""
    rows: int
    """Rows in the shard."""
    sha256: str
    """sha256 of the file's bytes."""
    bytes: int = 0
    """File size."""


@dataclass
class Manifest:
    """Everything a consumer needs to know about one prepared split."""

    source: str
    """Named source (``openwebtext``, ``embedded``, ...) or the local path/glob it was read from."""
    split: str
    """Split name (``train``, ``validation``, ``test``)."""
    tokenizer: dict[str, Any]
    """``{"name", "hash", "path", "origin"}`` of the tokenizer (``hash``: TokenizerInfo.content_hash)."""
    vocab_size: int
    """Tokenizer vocabulary size including added tokens."""
    mask_id: int
    """Absorbing mask id the model must use (GPT-2: 50257, appended; BERT: 103)."""
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    length: int
    """Row length L (the model's seq_len)."""
    mode: str
    """``wrap`` (packed across documents, BOS ... EOS rows) or ``pad`` (one sentence a row, padded)."""
    rows: int
    """Rows over all shards."""
    tokens: int
    """Real (non-padding) token positions over all rows, framing included."""
    shards: list[ShardInfo] = field(default_factory=list)
    documents: int = 0
    """Documents read from the source for this split."""
    documents_used: int = 0
    """Documents that produced tokens."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Documents skipped, by reason (``empty``, ...)."""
    invalid_utf8_replaced: int = 0
    """Documents whose invalid UTF-8 bytes were replaced by U+FFFD."""
    truncated: int = 0
    """``pad`` mode: rows whose sentence was longer than L - 2 and got cut."""
    dropped_tail_tokens: int = 0
    """``wrap`` mode: tokens of the stream's incomplete last row (dropped, as the reference does)."""
    detokenizer: str | None = None
    """Detokenizer applied before tokenisation (``wikitext``, ``ptb``, ``lm1b``, ...)."""
    text_field: str | None = None
    token_frequency: dict[str, int] = field(default_factory=dict)
    """Count of every token id that occurs (framing included, padding excluded); keys are ids as strings."""
    project_version: str = ""
    created_at: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    """Library versions that produced the shards (ray, tokenizers, pyarrow, ...)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The preparation options (for reproduction)."""
    truth: dict[str, Any] | None = None
    """The ``testbed`` source only (``pipelines.data.synthetic``): the language's config, its exact entropy per
    token with the standard error, the unigram and unigram + position floors and the anchors' value."""
    format: int = MANIFEST_FORMAT
    split_dir: str = field(default="", compare=False)
    """Where the manifest was read from (not stored)."""

    # -- paths -------------------------------------------------------------------------------------------
    def shard_uris(self) -> list[str]:
        """Every shard as a path or URI string (works for object stores)."""
        return [join(self.split_dir, s.name) for s in self.shards]

    def shard_paths(self) -> list[Path]:
        """Every shard as a local Path (for object-store data use ``shard_uris``)."""
        if is_uri(self.split_dir):
            raise ManifestError(f"{self.split_dir} is not local; use Manifest.shard_uris()")
        base = self.split_dir[len("file://"):] if self.split_dir.startswith("file://") else self.split_dir
        return [Path(base) / s.name for s in self.shards]

    # -- identity ----------------------------------------------------------------------------------------
    def content_hash(self) -> str:
        """sha256 over what determines the rows: tokenizer, ids, length, mode and every shard's sha256.

        Timestamps and library versions are left out, so identical data gives identical hashes.
        """
        payload = {
            "tokenizer": self.tokenizer.get("hash"), "vocab_size": self.vocab_size, "mask_id": self.mask_id,
            "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id, "length": self.length,
            "mode": self.mode, "rows": self.rows,
            "shards": [[s.name, s.rows, s.sha256] for s in self.shards],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def model_overrides(self) -> dict[str, int]:
        """ModelConfig fields this data dictates: ``vocab_size``, ``mask_id``, ``seq_len``."""
        return {"vocab_size": self.vocab_size, "mask_id": self.mask_id, "seq_len": self.length}

    @property
    def width(self) -> int:
        """Model output width the data needs (vocabulary plus an appended mask id)."""
        return max(self.vocab_size, self.mask_id + 1)

    def check_fits(self, model_cfg: Any, tokenizer_hash: str | None = None) -> None:
        """Raise DataMismatchError (one line) unless the model's vocab_size, mask_id and seq_len fit and, when
        ``tokenizer_hash`` (the checkpoint's) is given, the data was tokenised by that very tokenizer: two
        tokenizers of one size give the same ids to different strings.

        ``model_cfg``: an ``adlm_model.ModelConfig`` or a dict with those keys. The autoregressive kind
        never uses the mask id, so it is not compared for a kind that is not a diffusion kind (the kinds table).
        """
        def get(k: str) -> Any:
            return model_cfg.get(k) if isinstance(model_cfg, dict) else getattr(model_cfg, k, None)

        problems = []
        if get("vocab_size") != self.vocab_size:
            problems.append(f"tokenizer vocab {self.vocab_size} (data) vs vocab_size={get('vocab_size')} (model)")
        if _uses_mask(get("kind")) and get("mask_id") != self.mask_id:
            problems.append(f"mask id {self.mask_id} (data) vs mask_id={get('mask_id')} (model)")
        if get("seq_len") != self.length:
            problems.append(f"length {self.length} (data) vs seq_len={get('seq_len')} (model)")
        own = self.tokenizer.get("hash")
        if not problems and tokenizer_hash and own and tokenizer_hash != own:
            raise DataMismatchError(
                f"data {self.split_dir or self.split} was tokenized by {self.tokenizer.get('name')} (hash {own[:12]}), "
                f"not by the model's tokenizer (hash {tokenizer_hash[:12]}), though both have {self.vocab_size} "
                "entries; prepare the data with the model's tokenizer.json (--tokenizer) or use a model trained on "
                "this data")
        if problems:
            fix = ", ".join(f"{k}={v}" for k, v in self.model_overrides().items())
            raise DataMismatchError(
                f"data {self.split_dir or self.split} (tokenizer {self.tokenizer.get('name')}) does not fit the "
                f"model: {'; '.join(problems)}; fix: build the model with {fix} or prepare the data with the "
                "model's tokenizer and length")

    def verify(self, checksums: bool = True) -> None:
        """Raise ManifestError if a shard is missing or (``checksums``) its sha256 differs."""
        for s, uri in zip(self.shards, self.shard_uris(), strict=True):
            if not exists(uri):
                raise ManifestError(f"shard {uri} listed in the manifest is missing; rerun prepare_data "
                                    "(it resumes and rewrites missing shards)")
            if checksums and sha256_file(uri) != s.sha256:
                raise ManifestError(f"shard {uri} does not match its sha256 in the manifest; rerun "
                                    "prepare_data (it rewrites corrupt shards) or use --overwrite")

    # -- (de)serialisation -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("split_dir", None)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], split_dir: str = "") -> Manifest:
        """The manifest of a mapping (``manifest.json``); a ``ManifestError`` (one line) when what a consumer
        relies on (the ids, the length, the rows, each shard's name, rows and sha256) is missing or of the wrong
        type."""
        where = join(split_dir, MANIFEST_NAME) if split_dir else MANIFEST_NAME
        _check_shape(d, where)
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["shards"] = [ShardInfo(**{k: v for k, v in s.items() if k in SHARD_KEYS}) for s in d.get("shards", [])]
        kw["split_dir"] = split_dir
        return cls(**kw)

    def check_shards(self) -> None:
        """That the shards are what the manifest says, from their sizes and Parquet footers (no row is read):
        each file has the manifest's size and row count, and an ``input_ids`` column of rows of ``length`` int32
        ids; and no id the manifest counted (``token_frequency``) lies outside the vocabulary. A ``ManifestError``
        naming the shard otherwise: a truncated or replaced shard, or a manifest edited by hand, would fail only
        once training reads it (in a worker, after Ray's start-up and an MLflow run)."""
        # lazy: keeps pyarrow out of this module's import
        import pyarrow as pa
        import pyarrow.parquet as pq

        fix = "rerun prepare_data for this split (it rewrites corrupt shards) or with --overwrite"
        total = sum(s.rows for s in self.shards)
        if total != self.rows:
            raise ManifestError(f"{self.split_dir}: the manifest says {self.rows} rows but its shards hold {total}; "
                                + fix)
        ids = [int(k) for k in self.token_frequency if str(k).lstrip("-").isdigit()]
        outside = [i for i in (min(ids, default=0), max(ids, default=0)) if not 0 <= i < self.width]
        if outside:
            raise ManifestError(f"{self.split_dir}: the manifest counts token id {outside[-1]} outside its vocabulary "
                                f"(vocab_size {self.vocab_size}, mask id {self.mask_id}); {fix}")
        for s, uri in zip(self.shards, self.shard_uris(), strict=True):
            fs, path = get_fs(uri)
            try:
                size = fs.get_file_info(path).size
                if s.bytes and size != s.bytes:
                    raise ManifestError(f"shard {uri} has {size:,} bytes, not the {s.bytes:,} of the manifest "
                                        f"(truncated or replaced); {fix}")
                with fs.open_input_file(path) as f:
                    pf = pq.ParquetFile(f)
                    rows, schema = pf.metadata.num_rows, pf.schema_arrow
            except ManifestError:
                raise
            except (OSError, pa.ArrowException) as e:
                raise ManifestError(f"shard {uri} is not a readable Parquet file ({first_line(e)}); {fix}") from None
            col = schema.field("input_ids").type if "input_ids" in schema.names else None
            if rows != s.rows:
                raise ManifestError(f"shard {uri} holds {rows} rows, not the {s.rows} of the manifest; {fix}")
            if not (pa.types.is_fixed_size_list(col) and col.list_size == self.length
                    and pa.types.is_int32(col.value_type)):
                raise ManifestError(f"shard {uri} does not hold rows of {self.length} int32 ids (input_ids: {col}), "
                                    f"as the manifest's length says; {fix}")

    def write(self, split_dir: str | os.PathLike) -> str:
        """Write ``manifest.json`` atomically into ``split_dir``; returns its path."""
        p = join(split_dir, MANIFEST_NAME)
        write_bytes_atomic(p, self.to_json().encode("utf-8"))
        self.split_dir = str(split_dir)
        return p


SHARD_KEYS = ("name", "rows", "sha256", "bytes")
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "vocab_size": int, "mask_id": int, "length": int, "rows": int, "mode": str, "tokenizer": dict,
    "bos_id": (int, type(None)), "eos_id": (int, type(None)), "pad_id": (int, type(None)), "shards": list}


def _check_shape(d: dict[str, Any], where: str) -> None:
    """One line for a manifest whose fields a consumer relies on are missing or of another type."""
    fix = "rerun prepare_data for this split with --overwrite"
    for k, kind in _REQUIRED.items():
        v = d.get(k)
        if k not in d or not isinstance(v, kind) or isinstance(v, bool):
            raise ManifestError(f"{where}: {k!r} is {'missing' if k not in d else repr(v)[:60]}, not a manifest's; {fix}")
    for i, sh in enumerate(d["shards"]):
        ok = (isinstance(sh, dict) and isinstance(sh.get("name"), str) and "/" not in sh["name"]
              and sh["name"] not in ("", ".", "..")
              and isinstance(sh.get("rows"), int) and sh["rows"] >= 0 and isinstance(sh.get("sha256"), str)
              and isinstance(sh.get("bytes", 0), int))
        if not ok:
            raise ManifestError(f"{where}: shards[{i}] is {repr(sh)[:60]}, not a shard's name, rows and sha256; {fix}")


def read_manifest(split_dir: str | os.PathLike) -> Manifest:
    """Read ``<split_dir>/manifest.json`` (``split_dir`` may also be the manifest file itself or a URI)."""
    s = str(split_dir)
    if s.endswith(".json"):
        s = s.rsplit("/", 1)[0] if "://" in s else str(Path(s).parent)
    p = join(s, MANIFEST_NAME)
    try:
        raw = read_bytes(p)
    except (FileNotFoundError, OSError) as e:
        raise ManifestError(f"no {MANIFEST_NAME} in {s}; prepare the data first: python -m pipelines.prepare_data "
                            "--source ... --out DIR (then pass DIR/<split>)") from e
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{p} is not valid JSON ({e}); rerun prepare_data with --overwrite") from e
    if not isinstance(d, dict) or "shards" not in d:
        raise ManifestError(f"{p} is not a prepare_data manifest; rerun prepare_data with --overwrite")
    if not is_uri(s) and not s.startswith("file://"):
        s = str(Path(s).expanduser().resolve())
    return Manifest.from_dict(d, split_dir=s)


def _uses_mask(kind: str | None) -> bool:
    """Whether a model kind reads the mask id (a diffusion kind; None: assume it does)."""
    if kind is None:
        return True
    # lazy: keeps torch out of this module's import
    from adlm_model.kinds import KINDS  # here, not at import: the data stages' workers need no model code

    return kind not in KINDS or KINDS[kind].diffusion
