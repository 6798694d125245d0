"""The ``testbed`` source of prepare_data (pipelines/data/synthetic.py): shards that are the language's own rows
(deterministic from the seed), a tokenizer like any corpus's, the exact entropy and floors in every manifest, reuse
on a rerun, and one-line refusals."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from adlm_model import ModelConfig
from adlm_model.testbed.language import Testbed, TestbedConfig
from pipelines.core.seeds import derive_seed
from pipelines.data.manifest import read_manifest
from pipelines.data.plan import PrepareError
from pipelines.data.prepare import PrepareConfig, prepare
from pipelines.data.tokenizer import load_tokenizer

OPTS = {"length": 16, "entropy_rows": 400, "train_rows": 300, "validation_rows": 64, "test_rows": 32, "seed": 5}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("testbed") / "data"
    ms = prepare(PrepareConfig.from_dict({"source": "testbed", "out": str(out), "testbed": {**OPTS, "shard_rows": 128}}))
    return out, ms


def test_shards_are_the_languages_rows_and_the_manifest_carries_the_truth(prepared):
    out, ms = prepared
    assert set(ms) == {"train", "validation", "test"}
    tb = Testbed(TestbedConfig(**{k: v for k, v in OPTS.items() if not k.endswith("_rows") or k == "entropy_rows"}))
    m = read_manifest(out / "train")
    assert (m.rows, m.length, m.vocab_size, m.mask_id, m.bos_id, m.eos_id) == (300, 16, tb.vocab_size, 3, 1, 2)
    assert [s.rows for s in m.shards] == [128, 128, 44]
    first = pq.read_table(out / "train" / "part-00001.parquet").column("input_ids").to_pylist()
    assert torch.equal(torch.tensor(first), tb.sample(128, derive_seed(5, 1, 1)))
    truth = m.truth
    assert truth["config"]["seed"] == 5 and truth["entropy_per_token"] == pytest.approx(tb.entropy_per_token().mean)
    assert truth["entropy_per_token"] < truth["floors"]["unigram_position"] < truth["floors"]["unigram"] + 1e-9
    assert read_manifest(out / "validation").truth == truth
    m.check_fits(ModelConfig(kind="mdlm", vocab_size=tb.vocab_size, mask_id=3, seq_len=16, hidden=8, heads=2))
    tok = load_tokenizer(str(out / "tokenizer.json"))
    assert tok.content_hash == m.tokenizer["hash"] and (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (1, 2, 0, 3)
    row = first[0]
    assert tok.encode([tok.decode(row, skip_special_tokens=True)])[0] == row[1:-1]  # symbols round-trip


def test_rerun_reuses_and_other_options_are_refused(prepared, tmp_path):
    out, ms = prepared
    before = (out / "train" / "part-00000.parquet").stat().st_mtime_ns
    again = prepare(PrepareConfig.from_dict({"source": "testbed", "out": str(out), "testbed": {**OPTS, "shard_rows": 128}}))
    assert (out / "train" / "part-00000.parquet").stat().st_mtime_ns == before
    assert again["train"].content_hash() == ms["train"].content_hash()
    with pytest.raises(PrepareError, match="made with other options; pass --overwrite"):
        prepare(PrepareConfig.from_dict({"source": "testbed", "out": str(out), "testbed": {**OPTS, "seed": 6, "shard_rows": 128}}))
    with pytest.raises(PrepareError, match="unknown testbed config key"):
        prepare(PrepareConfig.from_dict({"source": "testbed", "out": str(tmp_path), "testbed": ["n_clases=3"]}))
    with pytest.raises(PrepareError, match="brings its own tokenizer"):
        prepare(PrepareConfig.from_dict({"source": "testbed", "out": str(tmp_path), "tokenizer": "gpt2"}))


def test_same_options_same_bytes(prepared, tmp_path):
    out, ms = prepared
    other = prepare(PrepareConfig.from_dict({"source": "testbed", "out": str(tmp_path / "d"), "testbed": [f"{k}={v}" for k, v in {**OPTS, "shard_rows": 128}.items()],
                     "split": ["validation"]}))
    assert other["validation"].content_hash() == ms["validation"].content_hash()
    freq = ms["validation"].token_frequency
    assert sum(freq.values()) == 64 * 16 and np.isclose(freq["1"], 64)
