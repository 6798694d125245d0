"""pipelines.prepare_data end to end on a small real corpus (King James chapters) with real Ray Data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipelines.core.faults import ENV as FAULT_ENV
from pipelines.data.embedded import bible_documents
from pipelines.data.manifest import DataMismatchError, read_manifest
from pipelines.data.prepare import PrepareConfig, PrepareError, prepare
from pipelines.data.sources import SourceError
from pipelines.data.tokenizer import TokenizerError, load_tokenizer


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """60 real documents (Bible chapters cut to 1,200 characters) with two empty ones among them."""
    d = [c[:1200] for c in bible_documents()[:60]]
    d[5] = ""
    d[17] = "   "
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, docs: list[str]) -> Path:
    p = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    p.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)), encoding="utf-8")
    return p


def _rows(split_dir: Path) -> tuple[np.ndarray, np.ndarray | None, list]:
    m = read_manifest(split_dir)
    tabs = [pq.read_table(p) for p in m.shard_paths()]
    L = m.length
    ids = np.concatenate([t.column("input_ids").combine_chunks().flatten().to_numpy() for t in tabs]).reshape(-1, L)
    mask = None
    if "attention_mask" in tabs[0].column_names:
        mask = np.concatenate([t.column("attention_mask").combine_chunks().flatten().to_numpy()
                               for t in tabs]).reshape(-1, L)
    return ids, mask, tabs


def _shas(out: Path, split: str = "train") -> list[str]:
    return [s.sha256 for s in read_manifest(out / split).shards]


def _expected_wrap(opts: dict, length: int, keep_empty: bool = False) -> tuple[np.ndarray, int, int]:
    """(row bodies, dropped tail tokens, units) that wrap packing must give, computed here from the plan's units:
    each unit's stream (documents + EOS) cut into rows of L - 2, then the units' remainders in unit order."""
    from pipelines.data.plan import make_plan
    from pipelines.data.sources import read_unit

    sp = make_plan(PrepareConfig(**opts)).splits["train"]
    tok = load_tokenizer("gpt2")
    w = length - 2
    bodies, rest = [], []
    for u in sp.units:
        docs = [d for d in read_unit(u.to_dict(), "text").docs if keep_empty or d.strip()]
        stream = np.concatenate([np.array(x + [50256], np.int32) for x in tok.encode(docs)])
        k = len(stream) // w
        bodies.append(stream[: k * w].reshape(k, w))
        rest.append(stream[k * w:])
    r = np.concatenate(rest)
    k = len(r) // w
    bodies.append(r[: k * w].reshape(k, w))
    return np.concatenate(bodies), len(r) - k * w, len(sp.units)


def test_wrap_rows_decode_to_the_documents(ray_session, tmp_path: Path, corpus: Path, docs: list[str]) -> None:
    out = tmp_path / "wrap"
    opts = dict(source=[str(corpus)], out=str(out), tokenizer="gpt2", length=64)
    ms = prepare(PrepareConfig.from_dict(opts))
    m = ms["train"]
    tok = load_tokenizer("gpt2")
    ids, mask, tabs = _rows(out / "train")
    assert mask is None
    assert str(tabs[0].schema.field("input_ids").type) == "fixed_size_list<element: int32>[64]"
    assert len(m.shards) >= 3 and m.rows == len(ids) == sum(s.rows for s in m.shards)
    # Framing: BOS ... EOS, both 50256 for GPT-2.
    assert (ids[:, 0] == 50256).all() and (ids[:, -1] == 50256).all()
    # The bodies of the rows are each unit's stream of documents + EOS cut into rows, then the units' remainders
    # in unit order (packed on the actors, the tail on the driver); one shard a unit plus the tail shard.
    expect, dropped, units = _expected_wrap(opts, 64)
    assert units >= 3 and len(m.shards) == units + 1
    np.testing.assert_array_equal(ids[:, 1:-1], expect)
    # As many rows and as few dropped tokens as one stream over the whole split gives.
    kept = [d for d in docs if d.strip()]
    stream = np.concatenate([np.array(x + [50256], np.int32) for x in tok.encode(kept)])
    body = ids[:, 1:-1].reshape(-1)
    assert len(stream) - len(body) == m.dropped_tail_tokens == dropped < 62
    assert len(ids) == len(stream) // 62
    # Manifest: counts and ids.
    assert (m.vocab_size, m.mask_id, m.bos_id, m.eos_id, m.length, m.mode) == (50257, 50257, 50256, 50256, 64, "wrap")
    assert m.documents == 60 and m.documents_used == 58 and m.skipped == {"empty": 2}
    assert m.tokens == m.rows * 64 == sum(m.token_frequency.values())
    assert m.token_frequency["50256"] == 2 * m.rows + int((body == 50256).sum())
    assert m.tokenizer["name"] == "gpt2" and m.tokenizer["hash"] == tok.content_hash
    assert m.options["engine"] == "tiktoken"  # GPT-2's BPE: the faster engine, checked above against tokenizers' ids
    import adlm_model

    assert m.project_version == adlm_model.__version__
    m.check_fits({"kind": "mdlm", "vocab_size": 50257, "mask_id": 50257, "seq_len": 64})
    with pytest.raises(DataMismatchError, match="length 64 .* seq_len=128"):
        m.check_fits({"kind": "mdlm", "vocab_size": 50257, "mask_id": 50257, "seq_len": 128})


def test_keep_empty_gives_every_empty_document_its_eos(ray_session, tmp_path: Path, corpus: Path,
                                                      docs: list[str]) -> None:
    """The zero-shot convention of the references (their loader appends EOS to every row, empty rows
    included): with keep_empty the two empty documents become two extra EOS tokens in the stream."""
    out = tmp_path / "keep"
    opts = dict(source=[str(corpus)], out=str(out), tokenizer="gpt2", length=64, keep_empty=True)
    m = prepare(PrepareConfig.from_dict(opts))["train"]
    tok = load_tokenizer("gpt2")
    ids, _, _ = _rows(out / "train")
    stream = np.concatenate([np.array(x + [50256], np.int32) for x in tok.encode(docs)])  # every document
    empty, blank = tok.encode([docs[5], docs[17]])
    assert empty == [] and len(blank) >= 1  # "" is no token; "   " is some
    np.testing.assert_array_equal(ids[:, 1:-1], _expected_wrap(opts, 64, keep_empty=True)[0])
    assert len(ids) * 62 + m.dropped_tail_tokens == len(stream)
    assert m.documents == m.documents_used == 60 and not m.skipped and m.options["keep_empty"] is True
    # The default drops them (test_wrap_rows_decode_to_the_documents): two EOS fewer in the same text.
    dropped = np.concatenate([np.array(x + [50256], np.int32) for x in tok.encode([d for d in docs if d.strip()])])
    assert len(stream) - len(dropped) == 2 + len(blank)  # two EOS and the tokens of "   "


def test_row_indices_read_the_same_rows_as_a_range(ray_session, tmp_path: Path, corpus: Path) -> None:
    """Training validates on rows spread over the split (read_row_indices); they are the rows a full read
    holds at those positions, across shard boundaries, and bad indices fail in one line."""
    from pipelines.data.reader import read_row_indices, read_rows

    out = tmp_path / "rows"
    prepare(PrepareConfig(source=[str(corpus)], out=str(out), tokenizer="gpt2", length=32))
    every, _ = read_rows(str(out / "train"))
    assert len(read_manifest(out / "train").shards) >= 3
    idx = np.linspace(0, len(every) - 1, 9).round().astype(np.int64)
    got, mask = read_row_indices(str(out / "train"), idx)
    np.testing.assert_array_equal(got, every[idx])
    assert mask is None
    with pytest.raises(ValueError, match="sorted, distinct"):
        read_row_indices(str(out / "train"), [3, 3])


def test_pad_rows_are_exact(ray_session, tmp_path: Path, corpus: Path, docs: list[str]) -> None:
    out = tmp_path / "pad"
    ms = prepare(PrepareConfig(source=[str(corpus)], out=str(out), tokenizer="bert-base-uncased", mode="pad", length=48,
                      max_truncated=1.0))
    m = ms["train"]
    tok = load_tokenizer("bert-base-uncased")
    ids, mask, tabs = _rows(out / "train")
    assert str(tabs[0].schema.field("attention_mask").type) == "fixed_size_list<element: int8>[48]"
    kept = [d for d in docs if d.strip()]
    enc = tok.encode(kept)
    assert len(ids) == len(kept) == m.rows
    for row, msk, x in zip(ids, mask, enc, strict=True):
        n = min(len(x), 46)
        expect = [101] + x[:n] + [102] + [0] * (46 - n)
        assert row.tolist() == expect
        assert msk.tolist() == [1] * (n + 2) + [0] * (46 - n)
    assert m.truncated == sum(len(x) > 46 for x in enc) > 0
    assert (m.pad_id, m.mask_id, m.bos_id, m.eos_id) == (0, 103, 101, 102)
    assert m.tokens == int(mask.sum())


def test_pad_length_too_short_fails_before_any_work(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "short"
    with pytest.raises(PrepareError, match=r"--length 16 truncates .* use --length \d+"):
        prepare(PrepareConfig(source=[str(corpus)], out=str(out), tokenizer="bert-base-uncased", mode="pad", length=16))
    assert not out.exists()


def test_killed_run_resumes_to_identical_shards(ray_session, tmp_path: Path, corpus: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that dies before its manifest resumes at unit granularity: the units whose shard matches its record
    are kept (not even rewritten), a lost shard's unit is done again, and every shard equals an undisturbed run's
    byte for byte."""
    opts = dict(source=[str(corpus)], tokenizer="gpt2", length=32)
    ref = prepare(PrepareConfig.from_dict({**opts, "out": str(tmp_path / "ref")}))["train"]
    assert len(ref.shards) >= 4
    out = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, "prepare.fail_after_shards=2")
    with pytest.raises(RuntimeError, match="simulated crash"):
        # On the other engine: the shards are the same, so the rerun below (auto: tiktoken) continues them.
        prepare(PrepareConfig.from_dict({**opts, "out": str(out), "engine": "tokenizers"}))
    monkeypatch.delenv(FAULT_ENV)
    split = out / "train"
    assert not (split / "manifest.json").exists()
    done = sorted(split.glob("part-*.parquet"))
    assert len(done) >= 2 and len(list((split / "_units").glob("*.json"))) >= 2
    # Damage it further: a lost shard (its record stays) and a stale temporary file.
    done[0].unlink()
    (split / "part-00099.parquet.tmp").write_bytes(b"half")
    kept = {p.name: p.stat().st_mtime_ns for p in done[1:]}
    resumed = prepare(PrepareConfig.from_dict({**opts, "out": str(out)}))["train"]
    assert _shas(out) == _shas(tmp_path / "ref") and resumed.content_hash() == ref.content_hash()
    assert resumed.token_frequency == ref.token_frequency and resumed.tokens == ref.tokens
    assert not list(split.glob("*.tmp"))
    for s in ref.shards:
        assert (split / s.name).read_bytes() == (tmp_path / "ref" / "train" / s.name).read_bytes()
    assert {n: (split / n).stat().st_mtime_ns for n in kept} == kept  # kept units were not done again
    # Complete: a rerun only verifies; other options on the same output are refused before any work.
    assert prepare(PrepareConfig.from_dict({**opts, "out": str(out)}))["train"].content_hash() == ref.content_hash()
    with pytest.raises(PrepareError, match="--overwrite"):
        prepare(PrepareConfig.from_dict({**opts, "out": str(out), "length": 48}))


def test_splits_trained_tokenizer_and_uri_output(ray_session, tmp_path: Path, docs: list[str]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes("\n".join(docs[:30]).encode() + b"\nbad \xff\xfe byte\n\n")
    pq.write_table(__import__("pyarrow").table({"body": docs[30:50]}), src / "b.parquet")
    (tmp_path / "val.txt").write_text("\n".join(docs[50:]), encoding="utf-8")
    out_uri = (tmp_path / "out").as_uri()  # file:// goes through the pyarrow filesystem path, as s3:// does
    ms = prepare(PrepareConfig(source=[f"train={src}", f"validation={tmp_path / 'val.txt'}"], out=out_uri,
                      train_tokenizer=400, text_field="body", length=40))
    tok_file = tmp_path / "out" / "tokenizer.json"
    assert tok_file.is_file()
    tok = load_tokenizer(str(tok_file))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (400, 0, 0, 1, 2)
    for split, m in ms.items():
        assert m.tokenizer["hash"] == tok.content_hash and m.vocab_size == 400 and m.mask_id == 2
        ids, _, _ = _rows(tmp_path / "out" / split)
        assert ids.max() < 400 and (ids[:, 0] == 0).all()
    train = ms["train"]
    assert train.invalid_utf8_replaced == 1 and train.skipped.get("empty", 0) >= 1
    # Byte-level BPE is lossless: the rows decode to the documents (text lines, then the Parquet column).
    body = _rows(tmp_path / "out" / "train")[0][:, 1:-1].reshape(-1).tolist()
    text = tok.decode(body, skip_special_tokens=False)
    lines = [x for x in "\n".join(docs[:30]).splitlines() if x.strip()]  # .txt: one document a line
    assert text.startswith("<|endoftext|>".join(lines[:10]))  # the first unit's rows (16 KB of text: 13 lines)
    assert read_manifest(f"{out_uri}/validation").shard_uris()[0].startswith("file://")


def test_bad_input_fails_before_ray(tmp_path: Path, corpus: Path) -> None:
    import ray

    was = ray.is_initialized()
    with pytest.raises(SourceError, match="unknown dataset 'openwebtxt'; known: embedded, openwebtext, lm1b"):
        prepare(PrepareConfig(source=["openwebtxt"], out=str(tmp_path / "x")))
    with pytest.raises(SourceError, match="no input files"):
        prepare(PrepareConfig(source=[str(tmp_path / "missing.jsonl")], out=str(tmp_path / "x"), tokenizer="gpt2"))
    with pytest.raises(PrepareError, match="below 4"):
        prepare(PrepareConfig(source=[str(corpus)], out=str(tmp_path / "x"), tokenizer="gpt2", length=3))
    with pytest.raises(SourceError, match="no field 'body'.*--text-field"):
        prepare(PrepareConfig(source=[str(corpus)], out=str(tmp_path / "x"), tokenizer="gpt2", text_field="body"))
    with pytest.raises(TokenizerError, match="does not exist"):
        prepare(PrepareConfig(source=[str(corpus)], out=str(tmp_path / "x"), tokenizer=str(tmp_path / "nope.json")))
    with pytest.raises(PrepareError, match="GPT-2's own BPE only"):
        prepare(PrepareConfig(source=[str(corpus)], out=str(tmp_path / "x"), tokenizer="bert-base-uncased", engine="tiktoken"))
    # A tokenizer without any special token cannot frame rows.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.train_from_iterator(["plain text only"] * 10, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    t.save(str(tmp_path / "plain.json"))
    with pytest.raises(TokenizerError, match="has no BOS/EOS token"):
        prepare(PrepareConfig(source=[str(corpus)], out=str(tmp_path / "x"), tokenizer=str(tmp_path / "plain.json")))
    assert not (tmp_path / "x").exists()
    assert ray.is_initialized() == was


def test_cli_help_and_error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from pipelines.prepare_data import main

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    for flag in ("--source", "--out", "--tokenizer", "--train-tokenizer", "--length", "--mode", "--text-field",
                 "--unit-mb", "--hub-mirror", "--actors", "--actor-cpus", "--overwrite", "--max-truncated",
                 "--engine"):
        assert flag in help_text
    assert main(["--source", "nosuchset", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown dataset 'nosuchset'" in err[0]


@pytest.mark.slow
def test_embedded_default_fits_the_tiny_model(ray_session, tmp_path: Path) -> None:
    from adlm_model import preset

    ms = prepare(PrepareConfig(source=["embedded"], out=str(tmp_path / "emb")))
    assert set(ms) == {"train", "validation", "test"}
    m = ms["train"]
    assert m.vocab_size == 8192 and m.length == 128 and m.rows > 10_000 and m.source == "embedded"
    m.check_fits(preset("tiny", **m.model_overrides()))
    assert (tmp_path / "emb" / "tokenizer.json").is_file()
    # Rerun: verified and reused, not recomputed.
    again = prepare(PrepareConfig(source=["embedded"], out=str(tmp_path / "emb")))
    assert {s: x.content_hash() for s, x in again.items()} == {s: x.content_hash() for s, x in ms.items()}


def test_the_cli_flags_are_the_config_fields_with_their_docstrings() -> None:
    """``prepare_data``'s flags are generated from ``PrepareConfig``: one a field, its docstring the help, its
    type and default the field's; a parse gives the typed config (no hand-written copy to drift)."""
    import dataclasses

    from pipelines.core.configlib import descriptions
    from pipelines.prepare_data import build_parser, config_of

    p = build_parser()
    flags = {a.dest: a for a in p._actions}
    docs = descriptions(PrepareConfig)
    for f in dataclasses.fields(PrepareConfig):
        action = flags[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert action.help.startswith(docs[f.name].replace("``", "")[:40]), f.name
    args = p.parse_args(["--source", "train=a.txt", "--source", "validation=b.txt", "--no-keep-empty", "--unit-mb",
                         "3", "--length", "64", "--testbed", "seed=1"])
    cfg = config_of(args)
    assert cfg.source == ["train=a.txt", "validation=b.txt"] and cfg.keep_empty is False and cfg.unit_mb == 3.0
    assert cfg.length == 64 and cfg.testbed == ["seed=1"] and cfg.engine == PrepareConfig().engine
    assert config_of(p.parse_args([])) == PrepareConfig()
