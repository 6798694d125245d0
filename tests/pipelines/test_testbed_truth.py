"""Evaluation against the truth on testbed data (pipelines/evaluation/truth.py): the excess over the exact entropy
on the positions each kind scores, samples scored by the language itself, and both reported by evaluate_model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adlm_model import ModelConfig
from adlm_model.testbed.language import BOS_ID, Testbed, TestbedConfig
from pipelines.data.prepare import PrepareConfig, prepare
from pipelines.data.reader import read_rows
from pipelines.evaluation.config import EvalConfig
from pipelines.evaluation.run import evaluate_model
from pipelines.evaluation.truth import bound_vs_truth, samples_vs_truth, skips_first, truth_of
from tests.support.eval import save_ckpt, tiny_config, train_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")
OPTS = {"length": 16, "entropy_rows": 1500, "train_rows": 512, "validation_rows": 64, "test_rows": 16}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("truth") / "testbed"
    prepare(PrepareConfig.from_dict({"source": "testbed", "out": str(out), "testbed": OPTS, "split": ["train", "validation"]}))
    return out


def test_excess_reads_the_entropy_of_the_positions_the_kind_scores(data):
    truth = truth_of(str(data / "validation"))
    h, h1 = truth["entropy_per_token"], truth["entropy_per_token_skip_first"]
    assert h1 == pytest.approx(h * 16 / 15)  # BOS carries 0 nats: the same row entropy over fewer positions
    r = bound_vs_truth(h + 0.5, truth)
    assert r["excess_nats"] == pytest.approx(0.5) and r["excess_ratio"] == pytest.approx((h + 0.5) / h)
    assert bound_vs_truth(h1, truth, skip_first=True)["excess_nats"] == pytest.approx(0.0)
    assert r["below_floor_nats"] == pytest.approx(truth["floors"]["unigram_position"] - h - 0.5)
    kinds = {k: skips_first(ModelConfig(kind=k, vocab_size=84, mask_id=3, seq_len=16, hidden=8, heads=2))
             for k in ("mdlm", "adlm", "ar", "bd3lm")}
    assert kinds == {"mdlm": False, "adlm": False, "ar": True, "bd3lm": True}
    assert truth_of(str(data / "nowhere")) is None


def test_true_rows_score_the_entropy_and_broken_rows_are_counted(data):
    truth = truth_of(str(data / "validation"))
    tb = Testbed(TestbedConfig.from_dict(truth["config"]))
    rows = tb.sample(1500, seed=123).numpy()
    r = samples_vs_truth(rows, truth)
    se = math.hypot(truth["entropy_per_token_se"], float((-tb.log_prob(tb.sample(1500, seed=123))).std()) / 16 / math.sqrt(1500))
    assert abs(r["true_nll_excess"]) < 4 * se and r["impossible_fraction"] == 0.0
    assert r["sample_unigram_entropy"] == pytest.approx(r["data_unigram_entropy"], rel=0.02)
    broken = rows[:100].copy()
    broken[:10, 0] = broken[:10, 1]  # no BOS: a row the language cannot emit
    assert BOS_ID not in broken[:10, 0]
    assert samples_vs_truth(broken, truth)["impossible_fraction"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="generate with length=16"):
        samples_vs_truth(rows[:, :8], truth)


def test_evaluate_reports_the_truth_beside_the_bound_and_the_samples(data, tmp_path):
    from pipelines.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(data / "tokenizer.json"))
    rows, _ = read_rows(str(data / "train"))
    cfg = tiny_config(tok, "mdlm", seq_len=16)
    model, ema = train_tiny(cfg, rows, 30)
    ck = save_ckpt(tmp_path / "ck", model, cfg, ema, data / "tokenizer.json", data, step=30)
    r = evaluate_model(str(ck), "ppl,generate", EvalConfig(num_samples=8, sample_batch_size=8, steps=8,
                                                             sampler="mdlm"), in_process=True, log=False,
                       workdir=str(tmp_path))
    truth = truth_of(str(data / "validation"))
    m = r.metrics
    assert m["val_excess_nats"] == pytest.approx(m["val_nll"] - truth["entropy_per_token"])
    assert m["val_excess_ratio"] == pytest.approx(m["val_nll"] / truth["entropy_per_token"])
    assert np.isfinite(m["true_nll"]) or m["impossible_fraction"] == 1.0
    assert 0.0 <= m["impossible_fraction"] <= 1.0
    quantities = [row["quantity"] for row in r.table]
    assert "validation excess over the exact entropy (nats/token)" in quantities
    assert "samples' true NLL (nats/token)" in quantities
