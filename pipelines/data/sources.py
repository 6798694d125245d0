"""Where documents come from: named Hugging Face sets, local files, and the embedded offline corpus.

Named sources (docs/design/method.md, section 5) load through Hugging Face ``datasets`` exactly as an online user
loads them; each carries its reference split, text field, detokenizer and default tokenizer/mode/length.

The ``embedded`` source is a real English corpus that pip packages ship (``data/embedded.py``), so the demo
and the tests run offline.
"""

from __future__ import annotations

import fnmatch
import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.core.storage import get_fs, hub_errors

READS = {"units": 0, "max_rows": 0}
"""Parquet units this process read through ``read_unit`` and the most rows it held from one read (a probe:
the driver reads none on the hub path, a worker at most one file's rows)."""


class SourceError(ValueError):
    """A source that cannot be read (unknown name, missing files, missing text field); says the fix."""


@dataclass(frozen=True)
class NamedSource:
    """A named corpus and the reference's way of preparing it."""

    name: str
    hf_path: str
    """Hugging Face dataset id (or ``json`` with ``data_files`` for LAMBADA's OpenAI file)."""
    hf_name: str | None
    splits: dict[str, str]
    """Our split -> the Hugging Face split it comes from."""
    field: str
    detokenizer: str | None
    tokenizer: str
    mode: str
    length: int
    default_splits: tuple[str, ...]
    data_files: str | None = None
    holdout_last: int = 0
    """OpenWebText: the last N documents of ``train`` form validation; training gets the rest."""
    keep_empty: bool = False
    """Keep empty documents (a lone EOS each in ``wrap`` mode): the reference's loader of the zero-shot sets
    appends EOS to every row, empty rows (WikiText's blank lines) included."""
    note: str = ""
    hub_files: dict[str, str] = field(default_factory=dict)
    """Hugging Face split -> glob of its Parquet files in the dataset repository's main branch, for datasets
    too large for the hub's own Parquet conversion (``refs/convert/parquet`` holds only the first 5 GB of
    those); without an entry the conversion's ``<config>/<split>/*.parquet`` is read (``data.hub``)."""


LAMBADA_URL = "https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl"

NAMED_SOURCES: dict[str, NamedSource] = {s.name: s for s in [
    NamedSource("openwebtext", "Skylion007/openwebtext", None, {"train": "train", "validation": "train"}, "text",
                None, "gpt2", "wrap", 1024, ("train", "validation"), holdout_last=100_000,
                note="no official split: validation = the last 100,000 documents of train",
                hub_files={"train": "plain_text/train-*.parquet"}),
    NamedSource("lm1b", "dvruette/lm1b", None, {"train": "train", "test": "test"}, "text", "lm1b",
                "bert-base-uncased", "pad", 128, ("train", "test"),
                note="one sentence a row, padded (use --mode wrap for the packed BD3-LM variant)"),
    NamedSource("wikitext2", "Salesforce/wikitext", "wikitext-2-raw-v1",
                {"train": "train", "validation": "validation", "test": "test"}, "text", "wikitext", "gpt2", "wrap",
                1024, ("validation",), keep_empty=True),
    NamedSource("wikitext103", "Salesforce/wikitext", "wikitext-103-raw-v1",
                {"train": "train", "validation": "validation", "test": "test"}, "text", "wikitext", "gpt2", "wrap",
                1024, ("validation",), keep_empty=True),
    NamedSource("ptb", "ptb-text-only/ptb_text_only", None,
                {"train": "train", "validation": "validation", "test": "test"}, "sentence", "ptb", "gpt2", "wrap",
                1024, ("validation",), keep_empty=True),
    NamedSource("lambada", "json", None, {"test": "train"}, "text", "lambada", "gpt2", "wrap", 1024, ("test",),
                data_files=LAMBADA_URL, note="OpenAI's LAMBADA test file, as the reference", keep_empty=True),
    NamedSource("ag_news", "fancyzhx/ag_news", None, {"train": "train", "test": "test"}, "text", None, "gpt2",
                "wrap", 1024, ("test",), keep_empty=True),
    NamedSource("pubmed", "ccdv/pubmed-summarization", None,
                {"train": "train", "validation": "validation", "test": "test"}, "article", "scientific_papers",
                "gpt2", "wrap", 1024, ("validation",), note="scientific_papers/pubmed as Parquet", keep_empty=True),
    NamedSource("arxiv", "ccdv/arxiv-summarization", None,
                {"train": "train", "validation": "validation", "test": "test"}, "article", "scientific_papers",
                "gpt2", "wrap", 1024, ("validation",), note="scientific_papers/arxiv as Parquet", keep_empty=True),
]}

EMBEDDED = NamedSource("embedded", "", None, {s: s for s in ("train", "validation", "test")}, "text", None, "", "wrap", 128,
                       ("train", "validation", "test"), note="gensim's Wikipedia sample + King James Bible, offline")
"""The offline demo corpus; its default tokenizer is an 8,192-entry BPE trained on its train split."""
EMBEDDED_TOKENIZER_VOCAB = 8192

KNOWN_SOURCES = ("embedded", *NAMED_SOURCES, "testbed", "prosqa", "prontoqa", "gsm8k")
"""``testbed``: the ground-truth synthetic language, generated rather than read (``pipelines.data.synthetic``);
``prosqa``, ``prontoqa``, ``gsm8k``: reasoning tasks as question/steps/answer rows
(``pipelines.data.reasoning.source``)."""


# ----------------------------------------------------------------------------------------------------------
# Local files and units of work


def source_fs(path: str) -> tuple[Any, str]:
    """(pyarrow filesystem, inner path) of an input: ``pipelines.core.storage.get_fs`` plus ``hf://`` (the Hugging
    Face Hub's files through ``huggingface_hub.HfFileSystem``, read where the caller runs: on the workers)."""
    if path.startswith("hf://"):
        # lazy: keeps huggingface_hub, pyarrow out of this module's import
        import pyarrow.fs as pafs
        from huggingface_hub import HfFileSystem

        return pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem())), path[len("hf://"):]
    return get_fs(path)


TEXT_EXTS = (".txt", ".text", ".md")
JSONL_EXTS = (".jsonl", ".json", ".ndjson")
PARQUET_EXTS = (".parquet", ".pq")


def file_kind(path: str) -> str:
    p = path.lower()
    for suf in (".gz", ".bz2", ".zst"):
        if p.endswith(suf):
            raise SourceError(f"{path}: compressed input is not supported; decompress it first")
    if p.endswith(PARQUET_EXTS):
        return "parquet"
    if p.endswith(JSONL_EXTS):
        return "jsonl"
    return "text"


def expand_local(spec: str) -> list[str]:
    """Files of a local path / glob / directory or object-store URI, sorted; SourceError if none."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.fs as pafs

    if not spec.strip():  # ``--source train=``: not the working directory
        raise SourceError("--source has an empty path; pass SPLIT=PATH with a file, a directory or a glob")

    if "://" in spec and not spec.startswith("file://"):
        fs, inner = source_fs(spec)
        scheme = spec.split("://", 1)[0]
        if any(ch in inner for ch in "*?["):
            base = inner.split("*", 1)[0].rsplit("/", 1)[0]
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
            files = sorted(i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, inner))
        else:
            info = fs.get_file_info(inner)
            if info.type == pafs.FileType.Directory:
                infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
                files = sorted(i.path for i in infos if i.type == pafs.FileType.File)
            elif info.type == pafs.FileType.File:
                files = [inner]
            else:
                files = []
        files = [f"{scheme}://{f}" for f in files if not Path(f).name.startswith((".", "_"))]
    else:
        if spec.startswith("file://"):
            spec = spec[len("file://"):]
        p = Path(spec).expanduser()
        if p.is_dir():
            files = sorted(str(f) for f in p.rglob("*") if f.is_file() and not f.name.startswith((".", "_")))
        elif any(ch in spec for ch in "*?["):
            files = sorted(f for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        else:
            files = [str(p)] if p.is_file() else []
    if not files:
        raise SourceError(f"no input files at {spec!r}; pass existing text/JSONL/Parquet files, a directory or a "
                          f"glob, or a named source ({', '.join(KNOWN_SOURCES)})")
    return files


@dataclass
class Unit:
    """One unit of work for a tokenizer actor: a byte range of a text/JSONL file, rows of a Parquet file
    or of a Hugging Face dataset. Units have stable indices: they define the stream order and resumption."""

    index: int
    kind: str
    """``text``, ``jsonl``, ``parquet`` or ``hf``."""
    path: str = ""
    start: int = 0
    stop: int = 0
    """Byte range (text, jsonl), row range within the file (parquet) or row range (hf)."""

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "path": self.path, "start": self.start, "stop": self.stop}


def _newline_aligned_cuts(path: str, size: int, target: int) -> list[int]:
    """Byte offsets cutting a file into pieces of about ``target`` bytes, each right after a newline."""
    cuts = [0]
    if size <= target:
        return [0, size]
    fs, inner = source_fs(path)
    with fs.open_input_file(inner) as f:
        pos = target
        while pos < size:
            f.seek(pos)
            chunk = f.read(1 << 16)
            while chunk and b"\n" not in chunk:
                more = f.read(1 << 16)
                if not more:
                    break
                chunk += more
            nl = chunk.find(b"\n")
            if nl < 0:
                break
            cut = pos + nl + 1
            if cut >= size:
                break
            cuts.append(cut)
            pos = cut + target
    cuts.append(size)
    return cuts


def plan_units(files: list[str], unit_bytes: int, start_index: int = 0,
               rows: tuple[int, int | None] | None = None) -> list[Unit]:
    """Deterministic units of files: text/JSONL cut at newlines every ``unit_bytes``, Parquet by row groups
    (grouped to about ``unit_bytes`` of uncompressed data) as row ranges within one file, so that a unit never
    spans two files. ``rows``: only rows ``[lo, hi)`` of the files' concatenation (Parquet only: OpenWebText's
    held-out tail); a unit that straddles a bound is cut there."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.parquet as pq

    lo, hi = rows if rows is not None else (0, None)
    units: list[Unit] = []
    i = start_index
    offset = 0  # rows of the files before this one
    for path in files:
        kind = file_kind(path)
        fs, inner = source_fs(path)
        if kind == "parquet":
            with fs.open_input_file(inner) as fh:
                md = pq.ParquetFile(fh).metadata  # the footer only
            r0 = r = acc = 0
            for g in range(md.num_row_groups):
                acc += md.row_group(g).total_byte_size
                r += md.row_group(g).num_rows
                if acc >= unit_bytes or g == md.num_row_groups - 1:
                    a, b = max(r0, lo - offset), r if hi is None else min(r, hi - offset)
                    if b > a:
                        units.append(Unit(i, kind, path, a, b))
                        i += 1
                    r0, acc = r, 0
            offset += md.num_rows
        else:
            if rows is not None:
                raise SourceError(f"{path}: a row window applies to Parquet input only")
            size = fs.get_file_info(inner).size
            cuts = _newline_aligned_cuts(path, size, unit_bytes)
            for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                if b > a:
                    units.append(Unit(i, kind, path, a, b))
                    i += 1
    return units


def parquet_rows(files: list[str]) -> int:
    """Rows of Parquet files, from their footers."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.parquet as pq

    n = 0
    for path in files:
        fs, inner = source_fs(path)
        with fs.open_input_file(inner) as fh:
            n += pq.ParquetFile(fh).metadata.num_rows
    return n


def plan_hf_units(n_rows: int, unit_docs: int, offset: int = 0) -> list[Unit]:
    """Row ranges [offset, offset + n_rows) of a Hugging Face dataset in pieces of ``unit_docs``."""
    return [Unit(k, "hf", "", offset + a, offset + min(a + unit_docs, n_rows))
            for k, a in enumerate(range(0, n_rows, unit_docs))]


# ----------------------------------------------------------------------------------------------------------
# Reading a unit (inside Ray actors, and in the driver for the pre-flight checks)


@dataclass
class UnitText:
    """Documents of one unit plus what reading them found."""

    docs: list[str]
    invalid_utf8: int = 0
    missing_field: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def _decode_lines(data: bytes) -> tuple[list[str], int]:
    """Lines of ``data`` (UTF-8); invalid bytes become U+FFFD and the affected lines are counted."""
    try:
        text = data.decode("utf-8")
        return text.splitlines(), 0
    except UnicodeDecodeError:
        out, bad = [], 0
        for raw in data.splitlines():
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(raw.decode("utf-8", errors="replace"))
                bad += 1
        return out, bad


def read_unit(unit: dict[str, Any], text_field: str, text_unit: str = "line", hf_dataset: Any = None) -> UnitText:
    """Documents of one unit, in order. ``text_unit``: ``line`` (one document a line) or ``file`` (text files)."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.parquet as pq

    kind = unit["kind"]
    if kind == "hf":
        col = hf_dataset[unit["start"]:unit["stop"]][text_field]
        return UnitText([c if isinstance(c, str) else "" for c in col],
                        missing_field=sum(1 for c in col if not isinstance(c, str)))
    fs, inner = source_fs(unit["path"])
    if kind == "parquet":
        pf = pq.ParquetFile(fs.open_input_file(inner))
        start, stop = unit["start"], unit["stop"]
        groups, first, at = [], 0, 0
        for g in range(pf.metadata.num_row_groups):  # the row groups that hold rows [start, stop)
            n = pf.metadata.row_group(g).num_rows
            if at + n > start and at < stop:
                first = at if not groups else first
                groups.append(g)
            at += n
        tab = pf.read_row_groups(groups, columns=[text_field])
        READS["units"] += 1
        READS["max_rows"] = max(READS["max_rows"], tab.num_rows)
        col = tab.column(0).slice(start - first, stop - start)
        docs: list[str] = []
        bad = 0
        for v in col.to_pylist():
            if isinstance(v, bytes):
                try:
                    v = v.decode("utf-8")
                except UnicodeDecodeError:
                    v = v.decode("utf-8", errors="replace")
                    bad += 1
            docs.append(v if isinstance(v, str) else "")
        return UnitText(docs, invalid_utf8=bad, missing_field=col.null_count, extra={"rows_read": tab.num_rows})
    with fs.open_input_file(inner) as f:
        f.seek(unit["start"])
        data = f.read(unit["stop"] - unit["start"])
    if kind == "text" and text_unit == "file":
        try:
            return UnitText([data.decode("utf-8")])
        except UnicodeDecodeError:
            return UnitText([data.decode("utf-8", errors="replace")], invalid_utf8=1)
    lines, bad = _decode_lines(data)
    if kind == "text":
        return UnitText(lines, invalid_utf8=bad)
    docs, missing = [], 0
    for line in lines:
        if not line.strip():
            docs.append("")
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            docs.append("")
            missing += 1
            continue
        v = rec.get(text_field) if isinstance(rec, dict) else None
        if not isinstance(v, str):
            missing += 1
            v = ""
        docs.append(v)
    return UnitText(docs, invalid_utf8=bad, missing_field=missing)


BINARY_SNIFF = 8192
"""Bytes of a plain-text input read to tell text from a binary file."""


def check_text_file(path: str) -> None:
    """SourceError (before any work) when a plain-text input is a binary file: NUL bytes in its first
    ``BINARY_SNIFF`` bytes (no text encoding the tokenizers read has them; an image, an archive or a model file
    would be tokenized as replacement characters)."""
    fs, inner = source_fs(path)
    with fs.open_input_file(inner) as f:
        head = f.read(BINARY_SNIFF)
    if b"\x00" in head:
        raise SourceError(f"{path} is a binary file, not text (NUL bytes in its first {BINARY_SNIFF:,} bytes); pass "
                          "UTF-8 text, JSONL or Parquet files")


def check_text_field(path: str, text_field: str) -> None:
    """SourceError (before any work) when a JSONL/Parquet file lacks ``text_field``."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.parquet as pq

    kind = file_kind(path)
    fs, inner = source_fs(path)
    if kind == "parquet":
        names = pq.ParquetFile(fs.open_input_file(inner)).schema_arrow.names
        if text_field not in names:
            raise SourceError(f"{path} has no column {text_field!r} (columns: {', '.join(names)}); "
                              "pass --text-field NAME")
    elif kind == "jsonl":
        with fs.open_input_file(inner) as f:
            head = f.read(1 << 20)
        for line in head.splitlines():
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # a partial first line of a huge record; per-line errors are counted later
                if not isinstance(rec, dict) or text_field not in rec:
                    keys = ", ".join(rec) if isinstance(rec, dict) else type(rec).__name__
                    raise SourceError(f"{path}: the first record has no field {text_field!r} (fields: {keys}); "
                                      "pass --text-field NAME")
                break


def load_hf_split(src: NamedSource, split: str) -> tuple[Any, int, int]:
    """(datasets.Dataset, first row, rows) of ``split`` of a named source, loaded as an online user loads it."""
    # lazy: keeps datasets out of this module's import
    import datasets

    hf_split = src.splits[split]
    try:
        if src.data_files:
            ds = datasets.load_dataset(src.hf_path, data_files=src.data_files, split=hf_split)
        else:
            ds = datasets.load_dataset(src.hf_path, src.hf_name, split=hf_split)
    except hub_errors() as e:  # not found, offline, no such split
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SourceError(f"could not load {src.name} ({src.hf_path}) from the Hugging Face Hub: {msg}; with no "
                          "network use local files (--source PATH) or the offline corpus (--source embedded)") from e
    if src.field not in ds.column_names:
        raise SourceError(f"{src.hf_path} has no field {src.field!r} (columns: {', '.join(ds.column_names)})")
    n = len(ds)
    if src.holdout_last:
        if n <= src.holdout_last:
            raise SourceError(f"{src.name}: {n} documents, fewer than the {src.holdout_last} held out for validation")
        if split == "validation":
            return ds, n - src.holdout_last, src.holdout_last
        return ds, 0, n - src.holdout_last
    return ds, 0, n
