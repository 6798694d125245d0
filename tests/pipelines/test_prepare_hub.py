"""Named hub datasets read as the hub serves them: Parquet files, cut into units of one file's rows,
read by the tokenizer actors; the driver reads footers only. Offline, a mirror holds a stand-in for a hub
dataset (tests/support/hub.py) and goes through the same code as ``hf://`` paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.data.embedded import bible_documents
from pipelines.data.hub import hub_files
from pipelines.data.manifest import read_manifest
from pipelines.data.plan import PrepareConfig, make_plan
from pipelines.data.prepare import prepare
from pipelines.data.sources import NAMED_SOURCES, READS, SourceError, read_unit
from tests.support.hub import REPO, stand_in_source, write_stand_in


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return [c[:1200] for c in bible_documents()[:90]]


def test_a_hub_split_is_the_references_rows_in_the_references_order(tmp_path: Path, docs: list[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenWebText's recipe: validation is the last N documents of the hub's train split, train the rest, in the
    order ``datasets.load_dataset`` gives. Units never span two files, and planning reads no row."""
    import datasets

    files = write_stand_in(tmp_path / "mirror", docs)
    monkeypatch.setitem(NAMED_SOURCES, "standin", stand_in_source(holdout=20))
    for key in READS:  # a running count over the process: earlier tests' reads are not this one's
        monkeypatch.setitem(READS, key, 0)
    before = dict(READS)
    plan = make_plan(PrepareConfig(source=["standin"], out=str(tmp_path / "out"), hub_mirror=str(tmp_path / "mirror")))
    assert READS == before  # footers only
    reference = datasets.load_dataset("parquet", data_files=files, split="train")["text"]
    rows_per_file = 30
    for split, want in (("train", reference[:70]), ("validation", reference[70:])):
        sp = plan.splits[split]
        assert all(u.kind == "parquet" and 0 <= u.start < u.stop <= rows_per_file for u in sp.units)
        got = [d for u in sp.units for d in read_unit(u.to_dict(), "text").docs]
        assert got == want, split
    val = plan.splits["validation"].units
    assert (val[0].path, val[0].start) == (files[2], 10)  # the held-out tail starts inside the last file
    assert READS["max_rows"] <= rows_per_file  # one read holds at most one file's rows (here: its row groups)
    # The hub itself, offline: one line that says what to do instead.
    with pytest.raises(SourceError, match="could not list openwebtext's Parquet files.*--hub-mirror"):
        hub_files(NAMED_SOURCES["openwebtext"], "train", None)


def test_a_mirrored_hub_dataset_gives_the_shards_of_the_same_local_files(ray_session, tmp_path: Path,
                                                                       docs: list[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = tmp_path / "mirror"
    write_stand_in(mirror, docs)
    monkeypatch.setitem(NAMED_SOURCES, "standin", stand_in_source())
    hub = prepare(PrepareConfig(source=["standin"], out=str(tmp_path / "hub"), hub_mirror=str(mirror)))["train"]
    local = prepare(PrepareConfig(source=[f"train={mirror / REPO / 'plain_text'}"], out=str(tmp_path / "local"),
                         tokenizer="gpt2", length=64))["train"]
    assert hub.source == "standin" and len(hub.shards) >= 4
    assert [(s.name, s.sha256) for s in hub.shards] == [(s.name, s.sha256) for s in local.shards]
    assert hub.content_hash() == local.content_hash() and hub.token_frequency == local.token_frequency
    for s in hub.shards:
        assert (tmp_path / "hub" / "train" / s.name).read_bytes() == (tmp_path / "local" / "train" / s.name).read_bytes()
    assert read_manifest(tmp_path / "hub" / "train").documents == len(docs)
