"""The one storage layer (``pipelines/core/storage.py``) behaves the same on a plain path, a ``file://`` URI and an
``s3://`` URI (a real S3 server on loopback): what a stage writes it reads back, folders list, publish, download
and delete alike, a reader never sees a half-written file, and the run's checkpoint scan and export work on
either. An export that lacks its weights is an error, never an empty folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import s3_server


@pytest.fixture(scope="module")
def s3() -> Iterator[object]:
    with s3_server("store-test") as srv:
        yield srv


@pytest.fixture(params=["path", "file", "s3"])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "path":
        return str(tmp_path / "wd")
    if request.param == "file":
        return f"file://{tmp_path / 'wd'}"
    request.getfixturevalue("s3")
    return f"s3://store-test/{tmp_path.name}/wd"


def test_what_is_written_is_read_back_listed_published_and_deleted_alike(base: str, tmp_path: Path) -> None:
    from pipelines.core import storage as st

    f = st.join(base, "data", "manifest.json")
    assert not st.exists(f) and st.list_dir(st.join(base, "data")) == []
    st.write_text(f, '{"rows": 3}')
    assert st.read_text(f) == '{"rows": 3}' and st.is_file(f) and st.exists(f)
    assert st.list_dir(st.join(base, "data")) == ["manifest.json"]  # no ".tmp" left behind by the atomic write
    assert st.name_of(f) == "manifest.json" and st.parent_of(f) == st.join(base, "data")
    assert (st.local_path(base) is None) == base.startswith("s3://")

    local = tmp_path / "ckpt"
    (local / "sub").mkdir(parents=True)
    (local / "a.bin").write_bytes(b"\x00\x01")
    (local / "sub" / "b.txt").write_text("b")
    dest = st.join(base, "checkpoints", "run")
    st.publish_dir(local, dest)
    assert not local.exists()  # published: the local folder is gone, its content is at dest
    assert st.list_dir(dest) == ["a.bin", "sub"] and st.read_bytes(st.join(dest, "a.bin")) == b"\x00\x01"
    back = st.download_dir(dest, tmp_path / "back")
    assert (back / "sub" / "b.txt").read_text() == "b"

    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "c.txt").write_text("c")
    st.publish_dir(tmp_path / "again", dest)  # replaces what was there
    assert st.list_dir(dest) == ["c.txt"]
    st.delete_dir(dest)
    assert not st.exists(dest) and st.list_dir(dest) == []
    st.delete_dir(dest)  # deleting what is not there is no error


def test_the_checkpoint_scan_and_export_read_a_run_folder_in_any_store(base: str, tmp_path: Path) -> None:
    from pipelines.core import storage as st
    from pipelines.training.checkpoints import (
        TRAINER_STATE,
        checkpoint_name,
        fetch_export,
        latest_checkpoint,
        list_checkpoints,
    )

    run = st.join(base, "ray_results", "r")
    for step, complete in [(10, True), (20, True), (30, False)]:  # 30: still being written (no trainer state)
        d = st.join(run, checkpoint_name(step))
        st.write_text(st.join(d, "config.json"), f'{{"meta": {{"step": {step}}}}}')
        st.write_text(st.join(d, "model.safetensors"), "w")
        st.write_text(st.join(d, "ema.safetensors"), "e")
        if complete:
            st.write_text(st.join(d, f"{TRAINER_STATE}.json"), "{}")
    assert [s for s, _ in list_checkpoints(run)] == [10, 20]
    step, loc = latest_checkpoint(run)
    out = fetch_export(loc, tmp_path / "export")
    assert step == 20 and sorted(p.name for p in out.iterdir()) == ["config.json", "ema.safetensors", "model.safetensors"]

    broken = st.join(run, "broken")
    st.write_text(st.join(broken, "config.json"), "{}")
    with pytest.raises(FileNotFoundError, match="lacks model.safetensors, ema.safetensors"):
        fetch_export(broken, tmp_path / "export2")
    st.write_text(st.join(broken, "model.safetensors"), "w")  # weights without their EMA: still refused
    with pytest.raises(FileNotFoundError, match="lacks ema.safetensors"):
        fetch_export(broken, tmp_path / "export3")


def test_a_scheme_no_filesystem_serves_is_one_clear_error() -> None:
    from pipelines.core.storage import StorageError, get_fs

    with pytest.raises(StorageError, match="no filesystem serves the scheme 'ftp'"):
        get_fs("ftp://host/run")


def test_a_scratch_folder_whose_process_was_killed_goes_with_the_next_one(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed with its scratch folder still there (a stopped trial, a preempted node's worker) leaves it;
    the next scratch folder made on the host removes it, and leaves those of live processes alone."""
    import os
    import subprocess
    import sys
    import tempfile

    from pipelines.core.storage import scratch_root, temp_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = temp_dir("adlm-best-")
    (mine / "model.safetensors").write_bytes(b"x")
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal; from pipelines.core.storage import temp_dir; d = temp_dir('adlm-best-'); "
        "(d / 'model.safetensors').write_bytes(b'x'); print(d, flush=True); os.kill(os.getpid(), signal.SIGKILL)")],
        capture_output=True, text=True, env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=120)
    orphan = Path(killed.stdout.strip())
    assert scratch_root() == tmp_path / f"adlm-scratch-{os.getuid()}"
    assert killed.returncode == -9 and orphan.parent == scratch_root() and orphan.is_dir(), killed.stderr[-2000:]
    new = temp_dir("adlm-ckpt-")
    assert not orphan.exists() and mine.is_dir() and new.is_dir()
    assert sorted(p.name for p in scratch_root().iterdir()) == sorted([mine.name, new.name])
