"""A stand-in for a Hugging Face Hub dataset served as Parquet files: real documents (King James
chapters) in several Parquet files with small row groups, laid out as a hub mirror
(``<mirror>/<dataset id>/<path>``), and a named source that reads them (``data.hub``)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.data.sources import NamedSource

REPO = "standin/corpus"
PATTERN = "plain_text/train-*.parquet"


def stand_in_source(holdout: int = 0) -> NamedSource:
    """A named source shaped like OpenWebText (one hub split ``train``; ``holdout`` documents of its tail form
    ``validation``) whose Parquet files the mirror holds."""
    splits = {"train": "train", "validation": "train"} if holdout else {"train": "train"}
    return NamedSource("standin", REPO, None, splits, "text", None, "gpt2", "wrap", 64, tuple(splits),
                       holdout_last=holdout, hub_files={"train": PATTERN})


def write_stand_in(mirror: Path | str, docs: list[str], files: int = 3, row_group: int = 7) -> list[str]:
    """``docs`` in ``files`` Parquet files (row groups of ``row_group`` rows, an extra column as the hub's have)
    under ``<mirror>/<REPO>/plain_text/``; a local folder or an object-store URI. Returns the files in order."""
    from pipelines.storage import get_fs, join

    per = -(-len(docs) // files)
    out = []
    for i in range(files):
        part = docs[i * per:(i + 1) * per]
        path = join(str(mirror), REPO, "plain_text", f"train-{i:05d}-of-{files:05d}.parquet")
        fs, inner = get_fs(path)
        fs.create_dir(inner.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(inner) as f:
            pq.write_table(pa.table({"text": part, "id": list(range(i * per, i * per + len(part)))}), f,
                           row_group_size=row_group)
        out.append(path)
    return out
