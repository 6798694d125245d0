"""Staged evaluation and gated promotion on a real sqlite MLflow registry (pipelines/promotion.py)."""

from __future__ import annotations

import math

import pytest
import torch

from adlm_model import build_model
from pipelines.evaluate import EvalConfig, main
from pipelines.promotion import PromotionConfig, stage_all
from tests.eval_fixtures import make_data, register, save_ckpt, tiny_config, tiny_gpt2, train_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _snapshot(client, name: str) -> dict:
    versions = client.search_model_versions(f"name='{name}'")
    runs = [r.info.run_id for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return {"versions": {str(v.version): (dict(v.tags), sorted(v.aliases)) for v in versions},
            "aliases": dict(client.get_registered_model(name).aliases), "runs": sorted(runs)}


def _runs_of(client, version: str) -> list:
    exp = client.get_experiment_by_name("adlm-eval")
    return client.search_runs([exp.experiment_id], f"tags.model_version = '{version}'")


def test_stages_gate_and_promotion_are_recorded_and_idempotent(workdir, tmp_path, capsys):
    import mlflow

    tracking = f"sqlite:///{workdir / 'mlflow.db'}"
    data, tok, tok_path = make_data(tmp_path)
    from pipelines.evaluate import read_rows

    rows, _ = read_rows(str(data / "train"))
    cfg = tiny_config(tok, "mdlm")
    weak_model, weak_ema = train_tiny(cfg, rows, 15)
    good_model, good_ema = train_tiny(cfg, rows, 80)
    torch.manual_seed(1)
    untrained = build_model(cfg)
    bad_vocab = tiny_config(tok, "mdlm", vocab_size=500)
    ckpts = {
        "1-weak": save_ckpt(tmp_path / "v1", weak_model, cfg, weak_ema, tok_path, data),
        "2-good": save_ckpt(tmp_path / "v2", good_model, cfg, good_ema, tok_path, data),
        "3-untrained": save_ckpt(tmp_path / "v3", untrained, cfg, None, tok_path, data),
        "4-copy-of-good": save_ckpt(tmp_path / "v4", good_model, cfg, good_ema, tok_path, data),
        "5-other-vocab": save_ckpt(tmp_path / "v5", build_model(bad_vocab), bad_vocab, None, tok_path, data),
    }
    for ck in ckpts.values():
        register(ck, tracking)
    client = mlflow.MlflowClient(tracking)
    assert client.get_model_version_by_alias("adlm", "candidate").version == 5

    ecfg = EvalConfig(eval_lm=str(tiny_gpt2(tmp_path)), mauve_featurizer="minilm", num_samples=50,
                      sample_batch_size=25, steps=4, sampler="mdlm", max_rows=96, batch_size=16)
    promo = PromotionConfig(stage1_rows=48, stage1_max_ppl=200.0, stage1_tolerance=0.05, margin=0.01,
                            gen_ppl_max=1e9, entropy_min=1.0, mauve_min=0.0)
    outcomes = {o.version: o for o in stage_all(promo, ecfg, workdir=workdir, in_process=True)}
    assert sorted(outcomes) == ["1", "2", "3", "4", "5"]
    tags = {v: client.get_model_version("adlm", v).tags for v in outcomes}

    # v1: no champion yet; passes the threshold and the bounds -> champion, later replaced by v2.
    assert outcomes["1"].status == "promoted" and tags["1"]["eval.stage3"] == "passed"
    assert tags["1"]["eval.replaced_by"] == "2" and "eval.replaced_at" in tags["1"]
    # v2: better than v1 on the same rows -> the champion now.
    assert outcomes["2"].status == "promoted" and outcomes["2"].replaced == "1"
    assert client.get_model_version_by_alias("adlm", "champion").version == 2
    assert tags["2"]["eval.previous_champion"] == "1"
    assert float(tags["2"]["val_ppl"]) < float(tags["1"]["val_ppl"]) * 0.99
    for k in ("gen_ppl", "entropy", "mauve", "gen.settings", "mauve.featurizer", "eval.stage1.run_id", "eval.stage2.run_id"):
        assert k in tags["2"], k
    # v3: an untrained model fails the fast stage (threshold and champion) and never runs the full stage.
    assert outcomes["3"].status == "rejected" and outcomes["3"].stage == 1
    assert tags["3"]["eval.stage1"] == "failed" and "eval.stage2" not in tags["3"] and "gen_ppl" not in tags["3"]
    assert "above the threshold 200" in tags["3"]["eval.reasons"]
    assert "above champion v2's" in tags["3"]["eval.reasons"]
    assert [r.data.tags.get("eval.stage") for r in _runs_of(client, "3")] == ["1"]
    # v4: the same weights as the champion pass the fast stage (within tolerance) but not the gate's margin.
    assert outcomes["4"].status == "rejected" and outcomes["4"].stage == 3
    assert tags["4"]["eval.stage1"] == "passed" and tags["4"]["eval.stage2"] == "passed"
    assert float(tags["4"]["eval.stage1.val_ppl"]) == pytest.approx(float(tags["4"]["eval.stage1.champion_val_ppl"]))
    assert "does not beat champion v2's" in tags["4"]["eval.reasons"]
    assert sorted(r.data.tags.get("eval.stage") for r in _runs_of(client, "4")) == ["1", "2"]
    # v5: does not fit the data -> rejected at stage 1 with the mismatch named.
    assert outcomes["5"].status == "rejected" and "does not fit the model" in tags["5"]["eval.reasons"]
    # Decided versions keep no candidate alias; only v2 holds an alias.
    aliases = client.get_registered_model("adlm").aliases
    assert aliases == {"champion": 2} or dict(aliases) == {"champion": "2"}
    assert all(math.isfinite(float(tags[v]["eval.stage1.val_ppl"])) for v in ("1", "2", "3", "4"))

    # A second run (through the CLI) changes nothing.
    before = _snapshot(client, "adlm")
    assert main(["--stage-all", "--in-process", "--set", f"eval_lm={ecfg.eval_lm}", "--set", "mauve_featurizer=minilm",
                 "--set", "num_samples=50"]) == 0
    assert "No registry version is waiting" in capsys.readouterr().out
    assert _snapshot(client, "adlm") == before
