"""The storage layer: every file the pipeline reads or writes under its work directory goes through here.

A location is a local path or a URI (``file://``, ``s3://``, ``gs://``); pyarrow's filesystems serve
them (``get_fs``), so the same code writes shards, manifests and summaries to a laptop folder or an
object store.

- work directory: ``--workdir`` > env ``ADLM_WORKDIR`` > ``./work`` (``resolve_workdir``)
- ``join`` keeps URIs URIs; ``write_bytes_atomic`` writes ``<path>.tmp`` then renames (a reader never
  sees half a file; on object stores a put is atomic anyway).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any


def is_uri(path: str | os.PathLike) -> bool:
    """A remote location (``s3://``, ``gs://``, ...); ``file://`` and plain paths are local."""
    s = str(path)
    return "://" in s and not s.startswith("file://")


def get_fs(path: str | os.PathLike) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) for a local path, ``file://`` or an object-store URI."""
    import pyarrow.fs as pafs

    s = str(path)
    if "://" in s:
        fs, inner = pafs.FileSystem.from_uri(s)
        return fs, inner.rstrip("/")
    return pafs.LocalFileSystem(), str(Path(s).expanduser().resolve())


def join(base: str | os.PathLike, *parts: str) -> str:
    """Join path components, keeping URIs URIs."""
    s = str(base)
    if "://" in s:
        return "/".join([s.rstrip("/"), *parts])
    return str(Path(s, *parts))


def read_bytes(path: str | os.PathLike) -> bytes:
    fs, p = get_fs(path)
    with fs.open_input_stream(p) as f:
        return f.read()


def exists(path: str | os.PathLike) -> bool:
    import pyarrow.fs as pafs

    fs, p = get_fs(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write to ``<path>.tmp`` then rename: a reader never sees a half-written file."""
    fs, p = get_fs(path)
    parent = p.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    tmp = p + ".tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, p)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    fs, p = get_fs(path)
    h = hashlib.sha256()
    with fs.open_input_stream(p) as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def resolve_workdir(workdir: str | os.PathLike | None = None) -> Path:
    """The work directory (``--workdir`` > ``$ADLM_WORKDIR`` > ``./work``), created."""
    d = Path(workdir or os.environ.get("ADLM_WORKDIR") or "work").expanduser().resolve()
    d.mkdir(parents=True, exist_ok=True)
    return d
