"""Named Hugging Face datasets read as the hub serves them: Parquet files, read on the workers.

``datasets.load_dataset`` downloads and converts a whole split in one process; for OpenWebText that is
about 40 GB of Arrow text on the driver. On a cluster (an object-store ``--out``), or when a hub
mirror is given, a named source's split is instead its Parquet files on the hub (``hf://datasets/...``,
``huggingface_hub.HfFileSystem``): the driver reads their footers only (row counts, row groups) and cuts
them into units of work that never span two files; each tokenizer actor reads its unit's row groups itself.

- Which files: ``NamedSource.hub_files[split]`` (a glob in the repository's main branch: the dataset's own
  Parquet files) or, without one, the hub's Parquet conversion ``refs/convert/parquet``,
  ``<config>/<split>/*.parquet`` (which holds only the first 5 GB of a larger split: ``partial-<split>``,
  refused). Sorted by name, as ``datasets`` orders data files: the row order is the reference's, and
  OpenWebText's validation split (the last 100,000 documents of ``train``) is the same documents.
- A mirror (``--hub-mirror`` or ``$ADLM_HUB_MIRROR``: a local folder or an object-store prefix laid out as
  ``<mirror>/<dataset id>/<path in the repository>``) is read instead of the hub through the same code: an
  air-gapped cluster's copy in its bucket, and how the tests put a stand-in for a hub dataset in place.
- A source that is one file at a URL (LAMBADA's OpenAI JSONL) is streamed once into ``<out>/_inputs/``
  (never held whole in memory) and read from there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import urllib.request

from pipelines.core.storage import exists, get_fs, hub_errors, join, name_of
from pipelines.data.sources import NamedSource, SourceError, expand_local, parquet_rows

CONVERSION_REVISION = "refs%2Fconvert%2Fparquet"
"""The hub's automatic Parquet conversion of every dataset (URL-encoded for ``HfFileSystem`` paths)."""
MIRROR_ENV = "ADLM_HUB_MIRROR"


def resolve_mirror(mirror: str | None) -> str | None:
    """``--hub-mirror`` > ``$ADLM_HUB_MIRROR`` > none (read the hub)."""
    m = mirror or os.environ.get(MIRROR_ENV) or None
    return m.rstrip("/") if m else None


def hub_pattern(src: NamedSource, split: str) -> tuple[str, str]:
    """(revision, glob inside the dataset repository) of the Parquet files of our ``split``."""
    hf_split = src.splits[split]
    if hf_split in src.hub_files:
        return "main", src.hub_files[hf_split]
    return CONVERSION_REVISION, f"{src.hf_name or 'default'}/{hf_split}/*.parquet"


def hub_files(src: NamedSource, split: str, mirror: str | None) -> list[str]:
    """The split's Parquet files in row order: ``hf://`` paths, or the mirror's copies of the same paths."""
    revision, pattern = hub_pattern(src, split)
    if mirror:
        try:
            return expand_local(join(mirror, src.hf_path, pattern))
        except SourceError as e:
            raise SourceError(f"the hub mirror {mirror} has no {src.hf_path}/{pattern} for {src.name}'s {split} "
                              "split; copy the dataset's files there (same paths as in the repository)") from e
    # lazy: keeps huggingface_hub out of this module's import
    from huggingface_hub import HfFileSystem

    fs = HfFileSystem()
    base = f"datasets/{src.hf_path}@{revision}"
    try:
        found = sorted(fs.glob(f"{base}/{pattern}"))
    except hub_errors() as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SourceError(f"could not list {src.name}'s Parquet files on the Hugging Face Hub ({base}/{pattern}): "
                          f"{msg}; with no network use a local --out (the datasets path), --hub-mirror, or local "
                          "files (--source PATH)") from e
    if not found:
        partial = pattern.replace(f"/{src.splits[split]}/", f"/partial-{src.splits[split]}/")
        hint = ""
        if revision == CONVERSION_REVISION and fs.glob(f"{base}/{partial}"):
            hint = (" (the hub converted only its first 5 GB: add the dataset's own Parquet files to "
                    f"NamedSource.hub_files for {src.name})")
        raise SourceError(f"no Parquet files at hf://{base}/{pattern}{hint}")
    return [f"hf://{p}" for p in found]


def split_window(src: NamedSource, split: str, files: list[str]) -> tuple[int, int] | None:
    """Rows ``[lo, hi)`` of the files that form our split (OpenWebText's held-out tail), or None for all."""
    if not src.holdout_last:
        return None
    n = parquet_rows(files)
    if n <= src.holdout_last:
        raise SourceError(f"{src.name}: {n} documents, fewer than the {src.holdout_last} held out for validation")
    return (n - src.holdout_last, n) if split == "validation" else (0, n - src.holdout_last)


def stage_url(url: str, out: str, mirror: str | None) -> str:
    """A one-file source at a URL as a file every node reads: ``<mirror>/<file name>`` when mirrored, else
    streamed once into ``<out>/_inputs/`` (chunk by chunk, never whole in memory)."""
    if mirror:
        path = join(mirror, name_of(url))
        if not exists(path):
            raise SourceError(f"the hub mirror {mirror} has no {name_of(url)} (the copy of {url})")
        return path
    dest = join(out, "_inputs", f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name_of(url)}")
    if exists(dest):
        return dest
    fs, inner = get_fs(dest)
    fs.create_dir(inner.rsplit("/", 1)[0], recursive=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as src, fs.open_output_stream(inner + ".tmp") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except OSError as e:
        raise SourceError(f"could not download {url}: {e}; with no network use local files (--source PATH)") from e
    fs.move(inner + ".tmp", inner)
    return dest
