"""Staged evaluation and gated promotion on a real sqlite MLflow registry (pipelines/evaluation/promotion.py)."""

from __future__ import annotations

import math

import pytest
import torch

from adlm_model import build_model
from pipelines.evaluate import main
from pipelines.evaluation.config import EvalConfig
from pipelines.evaluation.promotion import PromotionConfig, stage_all
from tests.support.eval import make_data, register, save_ckpt, tiny_config, tiny_gpt2, train_tiny


def _snapshot(client, name: str) -> dict:
    versions = client.search_model_versions(f"name='{name}'")
    runs = [r.info.run_id for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return {"versions": {str(v.version): (dict(v.tags), sorted(v.aliases)) for v in versions},
            "aliases": dict(client.get_registered_model(name).aliases), "runs": sorted(runs)}


def _runs_of(client, version: str) -> list:
    exp = client.get_experiment_by_name("adlm-eval")
    return client.search_runs([exp.experiment_id], f"tags.model_version = '{version}'")


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Five registered versions staged once: weak, good, untrained, a copy of good, another vocabulary."""
    import mlflow

    tmp_path = tmp_path_factory.mktemp("promotion")
    workdir = tmp_path / "work"
    workdir.mkdir()
    tracking = f"sqlite:///{workdir / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADLM_WORKDIR", str(workdir))
        mp.setenv("MLFLOW_TRACKING_URI", tracking)
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            data, tok, tok_path = make_data(tmp_path)
            from pipelines.data.reader import read_rows

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
            candidate_before = client.get_model_version_by_alias("adlm", "candidate").version
            ecfg = EvalConfig(eval_lm=str(tiny_gpt2(tmp_path)), mauve_featurizer="minilm", num_samples=50,
                              sample_batch_size=25, steps=4, sampler="mdlm", max_rows=96, batch_size=16)
            promo = PromotionConfig(stage1_rows=48, stage1_max_ppl=200.0, stage1_tolerance=0.05, margin=0.01,
                                    gen_ppl_max=1e9, entropy_min=1.0, mauve_min=0.0)
            outcomes = {o.version: o for o in stage_all(promo, ecfg, workdir=workdir, in_process=True)}
        finally:
            torch.set_num_threads(n)
        tags = {v: client.get_model_version("adlm", v).tags for v in outcomes}
        yield {"client": client, "outcomes": outcomes, "tags": tags, "ecfg": ecfg, "workdir": workdir,
               "tracking": tracking, "candidate_before": candidate_before}


def test_every_version_is_decided_and_only_the_champion_keeps_an_alias(staged: dict) -> None:
    client, outcomes, tags = staged["client"], staged["outcomes"], staged["tags"]
    assert staged["candidate_before"] == 5
    assert sorted(outcomes) == ["1", "2", "3", "4", "5"]
    aliases = client.get_registered_model("adlm").aliases
    assert aliases == {"champion": 2} or dict(aliases) == {"champion": "2"}
    assert all(math.isfinite(float(tags[v]["eval.stage1.val_ppl"])) for v in ("1", "2", "3", "4"))


def test_a_better_version_replaces_the_champion(staged: dict) -> None:
    client, outcomes, tags = staged["client"], staged["outcomes"], staged["tags"]
    # v1: no champion yet; passes the threshold and the bounds -> champion, later replaced by v2.
    assert outcomes["1"].status == "promoted" and tags["1"]["eval.stage3"] == "passed"
    assert tags["1"]["eval.replaced_by"] == "2" and "eval.replaced_at" in tags["1"]
    # v2: better than v1 on the same rows -> the champion now, with every figure of the full stage.
    assert outcomes["2"].status == "promoted" and outcomes["2"].replaced == "1"
    assert client.get_model_version_by_alias("adlm", "champion").version == 2
    assert tags["2"]["eval.previous_champion"] == "1"
    assert float(tags["2"]["val_ppl"]) < float(tags["1"]["val_ppl"]) * 0.99
    for k in ("gen_ppl", "entropy", "mauve", "gen.settings", "mauve.featurizer", "eval.stage1.run_id", "eval.stage2.run_id"):
        assert k in tags["2"], k


def test_an_untrained_version_fails_the_fast_stage_and_never_runs_the_full_one(staged: dict) -> None:
    client, outcomes, tags = staged["client"], staged["outcomes"], staged["tags"]
    assert outcomes["3"].status == "rejected" and outcomes["3"].stage == 1
    assert tags["3"]["eval.stage1"] == "failed" and "eval.stage2" not in tags["3"] and "gen_ppl" not in tags["3"]
    assert "above the threshold 200" in tags["3"]["eval.reasons"]
    assert "above champion v2's" in tags["3"]["eval.reasons"]
    assert [r.data.tags.get("eval.stage") for r in _runs_of(client, "3")] == ["1"]


def test_a_copy_of_the_champion_passes_the_fast_stage_but_not_the_margin(staged: dict) -> None:
    client, outcomes, tags = staged["client"], staged["outcomes"], staged["tags"]
    assert outcomes["4"].status == "rejected" and outcomes["4"].stage == 3
    assert tags["4"]["eval.stage1"] == "passed" and tags["4"]["eval.stage2"] == "passed"
    assert float(tags["4"]["eval.stage1.val_ppl"]) == pytest.approx(float(tags["4"]["eval.stage1.champion_val_ppl"]))
    assert "does not beat champion v2's" in tags["4"]["eval.reasons"]
    assert sorted(r.data.tags.get("eval.stage") for r in _runs_of(client, "4")) == ["1", "2"]


def test_a_version_that_does_not_fit_the_data_is_rejected_naming_the_mismatch(staged: dict) -> None:
    outcomes, tags = staged["outcomes"], staged["tags"]
    assert outcomes["5"].status == "rejected" and "does not fit the model" in tags["5"]["eval.reasons"]


def test_a_second_run_changes_nothing(staged: dict, capsys: pytest.CaptureFixture[str]) -> None:
    client, ecfg = staged["client"], staged["ecfg"]
    before = _snapshot(client, "adlm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADLM_WORKDIR", str(staged["workdir"]))
        mp.setenv("MLFLOW_TRACKING_URI", staged["tracking"])
        assert main(["--stage-all", "--in-process", "--set", f"eval_lm={ecfg.eval_lm}", "--set",
                     "mauve_featurizer=minilm", "--set", "num_samples=50"]) == 0
    assert "No registry version is waiting" in capsys.readouterr().out
    assert _snapshot(client, "adlm") == before
