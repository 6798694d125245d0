"""A prepared split as a Ray Dataset, read from its manifest: no Ray Data task asks for more than it is given.

``ray.data.read_parquet`` (Ray 2.60, either datasource) first samples the files' footers in tasks of one whole
CPU that no argument lowers (``_fetch_parquet_file_info``: no ``num_cpus`` in its options). On a cluster whose
nodes' CPUs are held in part by placement groups (a Tune trial's driver of 0.01 CPU on each 1-CPU node) no node
has a whole CPU free, and the read never starts (a sweep waits until killed). The manifest
already knows every shard's rows, so this source lists nothing and samples nothing: its only tasks are the
read tasks, each asking for the ``num_cpus`` the caller gives (``data.read_cpus``).

A read task's worker process costs about 2 CPU-seconds to start (Python and Ray imported: measured here), far more
than a small split's read. Ray starts a worker for every task that runs at once, so at most one task per
``READ_TASK_BYTES`` of the split runs at a time (``read_concurrency``): a split of a few MB is read by one worker, one
piece after the other (a sweep's trial read 8 pieces with 7 new workers, 15 CPU-seconds, before), and a corpus of
many GB by as many tasks at once as the cluster has room for.
"""

from __future__ import annotations

import functools
from typing import Any

from pipelines.core.storage import get_fs
from pipelines.data.manifest import Manifest


def _read_piece(uri: str, columns: list[str], start: int, stop: int) -> list[Any]:
    """Rows ``[start, stop)`` of one shard, only ``columns`` (a read task's body, on whichever node runs it)."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.parquet as pq

    fs, path = get_fs(uri)
    table = pq.read_table(path, filesystem=fs, columns=columns)
    return [table.slice(start, stop - start)]


READ_TASK_BYTES = 64 * 2**20
"""The split's bytes per read task that may run at once (``read_concurrency``)."""


def read_concurrency(split_bytes: int, pieces: int) -> int:
    """How many of a split's ``pieces`` read tasks run at once: one per ``READ_TASK_BYTES`` of the split, at
    least one, at most one a piece."""
    return max(1, min(pieces, -(-split_bytes // READ_TASK_BYTES)))


def read_pieces(shards: list[tuple[str, int]], blocks: int) -> list[tuple[str, int, int]]:
    """``(uri, start, stop)`` row ranges in manifest order: one a shard (empty shards left out), the largest
    range halved while there are fewer than ``blocks`` (Ray Train's split hands whole blocks to workers: two a
    worker keep their rows equal) and it has rows to halve."""
    out = [(uri, 0, rows) for uri, rows in shards if rows > 0]
    while len(out) < blocks:
        i = max(range(len(out)), key=lambda k: out[k][2] - out[k][1])
        uri, a, b = out[i]
        if b - a < 2:
            break
        mid = (a + b) // 2
        out[i:i + 1] = [(uri, a, mid), (uri, mid, b)]
    return out


def split_dataset(manifest: Manifest, columns: list[str], *, blocks: int, num_cpus: float) -> Any:
    """The split's rows (``columns`` only) as a Ray Dataset of at least ``blocks`` blocks, in manifest order,
    read by tasks of ``num_cpus`` CPUs each and nothing else, ``read_concurrency`` of them at a time."""
    # lazy: keeps pyarrow, ray out of this module's import
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    pieces = read_pieces(list(zip(manifest.shard_uris(), (s.rows for s in manifest.shards), strict=True)), blocks)
    fs, path = get_fs(pieces[0][0])
    file_schema = pq.ParquetFile(path, filesystem=fs).schema_arrow  # one footer, read here: no task
    schema = pa.schema([file_schema.field(c) for c in columns])
    split_bytes = sum(s.bytes for s in manifest.shards)
    bytes_per_row = max(1, split_bytes // max(1, manifest.rows))  # on disk: an estimate

    class ManifestSplit(Datasource):
        def estimate_inmemory_data_size(self) -> int:
            return bytes_per_row * manifest.rows

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                           data_context: Any = None) -> list[ReadTask]:
            return [ReadTask(functools.partial(_read_piece, uri, columns, a, b),
                             BlockMetadata(num_rows=b - a, size_bytes=bytes_per_row * (b - a), input_files=[uri],
                                           exec_stats=None),
                             schema=schema, per_task_row_limit=per_task_row_limit)
                    for uri, a, b in pieces]

    return ray.data.read_datasource(ManifestSplit(), override_num_blocks=len(pieces), num_cpus=num_cpus,
                                    concurrency=read_concurrency(split_bytes, len(pieces)))
