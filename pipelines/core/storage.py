"""The storage layer: every file the pipeline reads or writes under its work directory goes through here.

A location is a local path or a URI (``file://``, ``s3://``; tested against a real S3 server; ``gs://`` is
served by pyarrow's GCS filesystem too but is untested and has no recipe); pyarrow's filesystems serve them
(``get_fs``), so the same code writes shards, manifests, checkpoints, sweep tables and summaries to a laptop
folder or to an object store that every node of a cluster shares.

- work directory: ``--workdir`` > env ``ADLM_WORKDIR`` > ``./work`` (``resolve_workdir``: a local one is
  created and made absolute; a remote one is checked once, ``check_location``, so an unreachable store, a
  missing bucket, missing credentials or a scheme nothing serves fail in one line before any work).
- ``join`` keeps URIs URIs; ``write_bytes_atomic`` writes ``<path>.tmp`` then renames (a reader never sees
  half a file; on object stores a put is atomic anyway); ``upload_dir`` / ``download_dir`` move folders
  (checkpoints, plots, tables) between a node's disk and the store.
- ``cache_dir``: a node's own cache (``$ADLM_CACHE`` > ``<workdir>/cache`` for a local work directory >
  ``~/.cache/adlm``); what is cached there is re-derivable, never the only copy of a result.
  ``shared_cache_entry``: an entry built once per cluster (the converted evaluation LM) and shared through
  ``<workdir>/cache`` in the object store; registry downloads stay per node (their source, MLflow's
  artifact store, is already shared).
- ``warn_if_node_local``: one line when a local path is used while Ray's work runs on other nodes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipelines.core.logs import first_line, get_logger
from pipelines.core.runtime import spans_nodes

log = get_logger(__name__)

SCHEMES = ("file", "s3", "gs")
"""URI schemes the pipeline serves (pyarrow filesystems)."""


class StorageError(ValueError):
    """A location that cannot be used (unknown scheme, unreachable store, missing bucket or credentials)."""


class WorkdirError(StorageError):
    """A work directory that cannot be used (a path under a regular file, no permission, an unreachable store):
    bad input to every command, one line and exit code 2 (``pipelines.core.cli``)."""

    exit_code = 2


def is_uri(path: str | os.PathLike) -> bool:
    """A remote location (``s3://``, ``gs://``, ...); ``file://`` and plain paths are local."""
    s = str(path)
    return "://" in s and not s.startswith("file://")


def local_path(path: str | os.PathLike) -> Path | None:
    """The local path of a local location (plain or ``file://``), None for a remote one."""
    s = str(path)
    if is_uri(s):
        return None
    return Path(s[len("file://"):] if s.startswith("file://") else s).expanduser()


def get_fs(path: str | os.PathLike) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) for a local path, ``file://`` or an object-store URI."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.fs as pafs

    s = str(path)
    if "://" in s:
        scheme = s.split("://", 1)[0]
        if scheme not in SCHEMES:
            raise StorageError(f"{s}: no filesystem serves the scheme {scheme!r}; use a local path or one of "
                               f"{', '.join(f'{x}://' for x in SCHEMES)}")
        fs, inner = pafs.FileSystem.from_uri(s)
        return fs, inner.rstrip("/")
    return pafs.LocalFileSystem(), str(Path(s).expanduser().resolve())


def join(base: str | os.PathLike, *parts: str) -> str:
    """Join path components, keeping URIs URIs."""
    s = str(base)
    if "://" in s:
        return "/".join([s.rstrip("/"), *parts])
    return str(Path(s, *parts))


def name_of(path: str | os.PathLike) -> str:
    """The last component of a path or URI."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def parent_of(path: str | os.PathLike) -> str:
    s = str(path).rstrip("/")
    return s.rsplit("/", 1)[0] if "://" in s else str(Path(s).parent)


def read_bytes(path: str | os.PathLike) -> bytes:
    fs, p = get_fs(path)
    with fs.open_input_stream(p) as f:
        return f.read()


def read_text(path: str | os.PathLike) -> str:
    return read_bytes(path).decode("utf-8")


def exists(path: str | os.PathLike) -> bool:
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.fs as pafs

    fs, p = get_fs(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def is_file(path: str | os.PathLike) -> bool:
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.fs as pafs

    fs, p = get_fs(path)
    return fs.get_file_info(p).type == pafs.FileType.File


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write to ``<path>.tmp`` then rename: a reader never sees a half-written file."""
    fs, p = get_fs(path)
    parent = p.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    tmp = p + ".tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, p)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def make_dirs(path: str | os.PathLike) -> None:
    fs, p = get_fs(path)
    fs.create_dir(p, recursive=True)


def list_dir(path: str | os.PathLike) -> list[str]:
    """Names of the entries directly under ``path`` (empty when it does not exist)."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.fs as pafs

    fs, p = get_fs(path)
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return []
    return sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(p, allow_not_found=True)))


def delete_dir(path: str | os.PathLike) -> None:
    """Remove a folder and everything under it (nothing when it does not exist). A folder that stays (permissions,
    a store that refuses) is a StorageError: the caller meant it gone (``--overwrite``, a stale temporary)."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.fs as pafs

    fs, p = get_fs(path)
    try:
        fs.delete_dir(p)
    except FileNotFoundError:
        pass
    except OSError as e:  # an object store may say "does not exist" as a plain OSError: only a folder left is one
        if fs.get_file_info(p).type != pafs.FileType.NotFound:
            raise StorageError(f"cannot delete {path} ({first_line(e)}); remove it by hand or fix its "
                               "permissions") from e


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


def upload_dir(local: str | os.PathLike, dest: str | os.PathLike) -> str:
    """Copy a local folder to ``dest`` (local or remote), replacing what was there; returns ``dest``."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.fs as pafs

    dest = str(dest)
    delete_dir(dest)
    fs, p = get_fs(dest)
    fs.create_dir(p, recursive=True)
    pafs.copy_files(str(Path(local).resolve()), p, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    return dest


def download_dir(src: str | os.PathLike, local: str | os.PathLike) -> Path:
    """Copy a folder (local or remote) to a local folder; returns it."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.fs as pafs

    fs, p = get_fs(src)
    out = Path(local)
    out.mkdir(parents=True, exist_ok=True)
    pafs.copy_files(p, str(out.resolve()), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return out


def scratch_root() -> Path:
    """``<temp dir>/adlm-scratch-<uid>``: the folder of every ``temp_dir`` (one per user: another user's is not
    writable)."""
    return Path(tempfile.gettempdir()) / f"adlm-scratch-{os.getuid()}"


def temp_dir(prefix: str = "adlm-") -> Path:
    """A fresh local scratch folder (the caller removes it), in ``scratch_root()`` and named after this process and
    host. A process killed before it removed its folder leaves a whole checkpoint there: a sweep trial
    that ASHA stops while its best checkpoint uploads, a training worker on a preempted node (a kill runs no
    ``finally``). So each new scratch folder first removes those of this host's processes that are gone."""
    root = scratch_root()
    root.mkdir(exist_ok=True)
    host = _host_tag()
    for old in root.iterdir():
        pid, _, rest = old.name.partition(".")
        if pid.isdigit() and rest.startswith(f"{host}.") and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)  # another process may be removing it too
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}.{host}.{prefix}", dir=root))


def _host_tag() -> str:
    """This host, as a folder-name part: process ids are only comparable on one host (a temp dir shared by
    containers with their own process ids would otherwise lose a live process's folder)."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts: its parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def publish_dir(local: str | os.PathLike, dest: str | os.PathLike) -> str:
    """Make the local folder ``local`` the content of ``dest``: a move for a local destination, an upload for
    a remote one (the local folder is removed either way)."""
    lp = local_path(dest)
    if lp is not None:
        if lp.exists():
            shutil.rmtree(lp)
        lp.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(local), lp)
        return str(lp)
    upload_dir(local, dest)
    shutil.rmtree(local, ignore_errors=True)
    return str(dest)


def warn_if_node_local(paths: list[str] | tuple[str, ...], what: str) -> bool:
    """Say so (one line) when ``paths`` include a path on this node's disk while Ray's work runs on other
    nodes: they must see it at the same path (a shared filesystem), else each node reads and writes its own
    partial copy. Returns whether it warned."""
    local = [str(p) for p in paths if not is_uri(p)]
    if not local or not spans_nodes():
        return False
    log.warning(f"{what} {local[0]} is a path on this node's disk, but Ray's work runs on other nodes: every node "
                "must see it at that path (a shared filesystem), or use an object store (ADLM_WORKDIR=s3://...)")
    return True


SHARED_DONE = "_COMPLETE"
"""Marks an entry of a shared cache as whole (written after its files)."""


def shared_cache_entry(local: Path, build: Callable[[Path], None], complete: Callable[[Path], bool],
                       shared: str | None = None) -> Path:
    """The cache entry ``local`` (a folder on this node), filled once: ``build(tmp)`` writes a temporary folder
    that becomes ``local`` by an atomic rename. Processes of the node that ask at once take turns (a lock beside
    the entry): one builds, the others find it built.

    ``shared``: the same entry in the work directory's object store (a cluster, whose nodes share nothing
    else). A node without the entry fetches it from there instead of building it, and a node that has it
    (built or found) puts it there when it is missing, so an expensive derivation runs once per cluster.
    Sharing is best effort: without it each node builds its own."""

    def share() -> None:
        # lazy: keeps pyarrow out of this module's import
        from pyarrow.lib import ArrowException

        try:
            upload_dir(local, shared)
            write_bytes_atomic(join(shared, SHARED_DONE), b"")  # last: a reader never takes half an entry
        except (OSError, ArrowException) as e:  # best effort: the node's own copy serves, another node builds its own
            log.warning(f"could not share the cache entry {local.name} at {shared}: {type(e).__name__}")

    if complete(local):
        if shared and not exists(join(shared, SHARED_DONE)):
            share()
        return local
    with _node_lock(local.with_name(local.name + ".lock")):  # processes of one node that ask at once build it once
        if complete(local):
            return local
        tmp = local.with_name(local.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        fetched = bool(shared) and exists(join(shared, SHARED_DONE))
        if fetched:
            download_dir(shared, tmp)
        else:
            build(tmp)
        try:
            os.replace(tmp, local)
        except OSError as e:  # another process finished first: keep theirs; anything else leaves the entry unwritten
            shutil.rmtree(tmp, ignore_errors=True)
            if not complete(local):
                raise StorageError(f"cannot write the cache entry {local} ({e}); check the disk and its permissions, "
                                   "or point ADLM_CACHE elsewhere") from e
        if shared and not fetched:
            share()
        return local


@contextlib.contextmanager
def _node_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` among this node's processes (``flock``; released when the holder exits,
    however it ends). Where there is no ``fcntl``, no lock: concurrent builders then each build, and the first
    rename wins."""
    try:
        # lazy: optional: fcntl may be absent, and that is handled
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def node_cache_dir(*parts: str) -> Path:
    """This machine's cache shared by every work directory (then ``parts``), created: ``$ADLM_CACHE`` >
    ``~/.cache/adlm``. For what depends on no work directory (the converted evaluation LM)."""
    env = os.environ.get("ADLM_CACHE")
    d = (Path(env).expanduser() if env else Path.home() / ".cache" / "adlm").joinpath(*parts)
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_dir(workdir: str | os.PathLike | None = None, *parts: str) -> Path:
    """This node's cache folder (then ``parts``), created: ``$ADLM_CACHE`` > ``<workdir>/cache`` for a local
    work directory > ``~/.cache/adlm`` (a remote work directory: a cache belongs to the node that filled it).
    What is cached (the extracted embedded corpus, converted evaluation LMs, downloaded registry versions) is
    re-derivable, never the only copy of a result."""
    env = os.environ.get("ADLM_CACHE")
    if env:
        base = Path(env).expanduser()
    else:
        raw = str(workdir) if workdir else resolve_workdir(None)
        base = Path.home() / ".cache" / "adlm" if is_uri(raw) else local_path(raw).resolve() / "cache"
    d = base.joinpath(*parts)
    d.mkdir(parents=True, exist_ok=True)
    return d


@functools.lru_cache(maxsize=32)
def check_location(uri: str) -> None:
    """One-line StorageError unless ``uri``'s store answers: the scheme is served, the endpoint is reachable,
    the bucket exists and the credentials are accepted. Cached per process (checked once)."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.fs as pafs
    from pyarrow.lib import ArrowException

    scheme = uri.split("://", 1)[0]
    try:
        fs, inner = get_fs(uri)
    except StorageError:
        raise
    except (OSError, ArrowException) as e:  # ArrowInvalid (a bad URI) / OSError, with multi-line texts
        raise StorageError(f"{uri}: cannot open the store ({first_line(e)}); check the URI") from None
    if scheme == "s3" and not _aws_credentials():
        raise StorageError(f"{uri}: no AWS credentials: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile) "
                           "on this node, or give the node an instance role; never put them in a job's runtime env")
    bucket = inner.split("/", 1)[0]
    try:
        info = fs.get_file_info(bucket)
    except (OSError, ArrowException) as e:  # endpoint down, credentials refused, ...
        if re.search(r"ACCESS_DENIED|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|\b403\b", str(e)):
            raise StorageError(f"{uri}: the {scheme} store refused this node's credentials ({first_line(e)}); set "
                               "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials allowed on "
                               "the bucket, or grant the node's instance role the bucket prefix "
                               "(deploy/iam/worker.json)") from None
        raise StorageError(f"{uri}: the {scheme} store does not answer ({first_line(e)}); check the endpoint "
                           "(AWS_ENDPOINT_URL), the network and the credentials (AWS_ACCESS_KEY_ID / "
                           "AWS_SECRET_ACCESS_KEY, or the node's instance role)") from None
    if info.type == pafs.FileType.NotFound:
        raise StorageError(f"{uri}: bucket {bucket!r} does not exist; create it or fix the URI")


def _aws_credentials() -> bool:
    """Whether the AWS credential chain (environment, profile files, instance role) yields credentials."""
    try:
        # lazy: optional: botocore may be absent, and that is handled
        import botocore.session
    except ImportError:  # no botocore: leave the check to the store itself
        return True
    session = botocore.session.get_session()
    session.set_config_variable("metadata_service_timeout", 1)
    session.set_config_variable("metadata_service_num_attempts", 1)
    return session.get_credentials() is not None


def hub_errors() -> tuple[type[BaseException], ...]:
    """What a read from the Hugging Face Hub raises when the hub, the network or the files fail: ``OSError`` (the
    hub's HTTP and offline errors, a missing file), ``ValueError`` (a bad name or config) and the HTTP client's own
    errors (huggingface_hub 2 speaks ``httpx2``; its transport errors are not ``OSError``s)."""
    errors: list[type[BaseException]] = [OSError, ValueError]
    for module in ("httpx2", "httpx"):
        try:
            errors.append(__import__(module).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def resolve_workdir(workdir: str | os.PathLike | None = None) -> str:
    """The work directory (``--workdir`` > ``$ADLM_WORKDIR`` > ``./work``): an absolute local path (created)
    or a URI whose store answers (``check_location``)."""
    raw = str(workdir or os.environ.get("ADLM_WORKDIR") or "work")
    if is_uri(raw):
        try:
            check_location(raw.rstrip("/"))
        except WorkdirError:
            raise
        except StorageError as e:
            raise WorkdirError(str(e)) from None
        return raw.rstrip("/")
    d = local_path(raw).resolve()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # a path under a regular file (NotADirectoryError), a file of that name, no permission, a read-only disk
        why = e.strerror or type(e).__name__
        raise WorkdirError(f"the work directory {d} cannot be created ({why}"
                           f"{': ' + str(e.filename) if e.filename and str(e.filename) != str(d) else ''}); "
                           "pass --workdir (or $ADLM_WORKDIR) naming a folder that can be created") from None
    return str(d)
