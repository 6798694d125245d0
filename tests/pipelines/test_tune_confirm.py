"""``pipelines.tune --confirm``: the search's winner and a baseline tuned with the same budget retrained at fresh
seeds, compared seed by seed. The space's rules fail in one line before Ray; a real sweep of two tiny arms on local
Ray + sqlite MLflow confirms at two seeds, and the interval comes from the confirmation's runs only."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import yaml

from adlm_model import ConfigError
from pipelines.tune import main as tune_main
from pipelines.tuning.space import load_space, parse_space
from tests.support.data import TINY_MODEL, data_overrides, set_args

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"

# Every trial and run: 8 steps of 8 rows in its Tune trial's own process (no Ray Train worker group).
TINY_RUN = {"run.max_steps": 8, "run.val_every": 4, "run.ckpt_every": 4, "run.log_every": 4, "run.val_batches": 2,
            "scaling.num_workers": 0, "scaling.threads": 1, "batch.global_batch": 8, "batch.micro_batch": 8,
            "optim.warmup_steps": 2, "model.dropout": 0.0}


def _space(**extra) -> dict:
    return {"name": "t-confirm",
            "params": {"gamma": {"distribution": "grid", "values": [1e-3, 3e-2]},
                       "tau": {"distribution": "choice", "values": [5]}},
            "scheduler": {"type": "fifo"}, "num_samples": 1, "max_concurrent": 2,
            "resources": {"trial_cpu": 0.5}, "overrides": dict(TINY_RUN),
            "baseline": {"name": "mdlm", "set": {"model.kind": "mdlm"},
                         "params": {"optim.lr": {"distribution": "grid", "values": [3e-3, 1e-6]}}},
            **extra}


@pytest.mark.parametrize("confirm, message", [
    ({"seeds": 1}, "at least 2"),
    ({"seeds": 2, "against": "sedd"}, r"against 'sedd' is neither an arm \(recipe, mdlm\) nor a recipe file"),
    ({"seeds": 2, "steps": [4, 8], "primary": "steps:6"}, r"primary must name one of its readings"),
    ({"seeds": 2, "steps": [4, 4]}, "distinct positive step counts"),
    ({"seeds": 2, "ablations": [{"name": "mdlm", "set": {"model.dropout": 0.1}}]}, "not another arm's"),
    ({"seeds": 2, "ablations": [{"name": "x", "set": {"dropout": 0.1}}]}, "section.key"),
    ({"seeds": 2, "ablations": [{"name": "x", "set": {"model.n_blocks": 3}, "of": "sedd"}]},
     r"of must be the winner or the baseline arm it is confirmed against \(tuned, mdlm\), got 'sedd'"),
    ({"seeds": 2, "against": "recipe", "ablations": [{"name": "x", "set": {"model.n_blocks": 3}, "of": "mdlm"}]},
     r"against \(tuned\), got 'mdlm'"),
])
def test_bad_confirmations_fail_with_one_line(confirm: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        parse_space(_space(confirm=confirm), "bad.yaml")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("changes, message", [
    ({}, None),  # the control: valid
    ({"optim.schedule": "cosine"}, r"read part-way \(steps \[4, 8\]\), which needs optim.schedule: constant"),
    ({"run.val_every": 8, "run.ckpt_every": 8}, r"read at step 4, not a multiple of its run.val_every \(8\)"),
])
def test_the_recipe_checks_of_a_confirmation_come_before_ray(tiny_data: Path, workdir: Path, tmp_path: Path,
                                                             changes: dict, message: str | None,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``--check`` sizes the confirmation (arms, fresh seeds, readings) and refuses readings a run cannot give."""
    f = tmp_path / "space.yaml"
    space = _space(confirm={"steps": [4, 8]})
    space["overrides"].update(changes)
    f.write_text(yaml.safe_dump(space))
    args = ["--space", str(f), "--config", str(DEMO), "--workdir", str(workdir), "--check", "--confirm", "2",
            *set_args([*data_overrides(tiny_data), *TINY_MODEL])]
    rc = tune_main(args)
    out = capsys.readouterr()
    if message is None:
        assert rc == 0, out.err
        lines = out.out.splitlines()
        assert lines[0].startswith("ok: sweep t-confirm: 2 trials")
        assert any(ln.startswith("baseline mdlm t-confirm-mdlm: 2 trials over optim.lr") for ln in lines), lines
        assert "confirm: 2 arms x fresh seeds [1, 2] = 4 runs; readings steps:4, steps:8; primary steps:8" in out.out
        assert re.search(r"tuned +winner +ADLM \(tuned\): .* 2 runs to 8 steps; [0-9.]+ s/step here", out.out)
        assert "estimate: about" in out.out and "at most 16 steps" in out.out
    else:
        err = [ln for ln in out.err.strip().splitlines() if "(pid=" not in ln[:40]]
        assert rc == 2 and len(err) == 1 and re.search(message, err[0]), err
    assert not (workdir / "ray_results").exists()


def test_an_ablation_of_the_baseline_is_a_second_comparator_at_its_tuned_settings(tmp_path: Path) -> None:
    """``of: <baseline>``: the baseline's winner with one change (a larger MDLM at the learning rate its search
    chose), read against the winner with the primary's sign; a plain ablation is the winner's, against the winner."""
    from pipelines.tuning.confirm import plan_confirmation

    space = parse_space(_space(confirm={"seeds": 2, "steps": [4, 8], "ablations": [
        {"name": "mdlm-big", "of": "mdlm", "set": {"model.n_blocks": 2}, "steps": 4},
        {"name": "gamma0", "set": {"model.gamma": 0.0}}]}), "s.yaml")
    assert parse_space(space.to_raw(), "s.yaml") == space
    plan = plan_confirmation(space, str(DEMO), TINY_MODEL, workdir=str(tmp_path), tracking_uri="",
                             winner={"gamma": 1e-3, "tau": 5}, baseline={"optim.lr": 3e-3})
    big, gamma0 = plan.arm("mdlm-big"), plan.arm("gamma0")
    assert big.role == gamma0.role == "ablation"
    assert big.raw["model"]["kind"] == "mdlm" and big.raw["model"]["n_blocks"] == 2 and big.raw["optim"]["lr"] == 3e-3
    assert big.label.startswith("MDLM (lr=0.003) with") and big.params > plan.arm("mdlm").params and big.steps == 4
    assert gamma0.raw["model"]["kind"] == "adlm" and gamma0.raw["model"]["gamma"] == 0.0 and gamma0.steps == 8
    pairs = {(c.arm, c.against, c.reading) for c in plan.contrasts}
    assert {("tuned", "mdlm-big", "steps:4"), ("gamma0", "tuned", "steps:8")} <= pairs


def _histories(uri: str, experiment: str = "adlm-demo") -> dict[str, dict[int, float]]:
    """Every training run's validation bounds by step, by run name."""
    import mlflow

    c = mlflow.MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    return {r.info.run_name: {m.step: m.value for m in c.get_metric_history(r.info.run_id, "val/ppl")}
            for r in c.search_runs([exp.experiment_id], max_results=1000)}


@pytest.mark.slow
def test_confirm_retrains_the_winner_and_a_tuned_baseline_at_fresh_seeds(tiny_data: Path, workdir: Path,
                                                                         tmp_path: Path, ray_session) -> None:
    import mlflow

    from pipelines.studies.stats import summarise
    from pipelines.tuning.experiment import run_tune

    f = tmp_path / "space.yaml"
    f.write_text(yaml.safe_dump(_space(confirm={
        "seeds": 2, "steps": [4, 8], "flops": [4],
        "ablations": [{"name": "init-normal", "set": {"model.anchor_init_std": 0.02}, "steps": 4}]})))
    sets = [*data_overrides(tiny_data), *TINY_MODEL]
    out = run_tune(load_space(f), str(DEMO), sets)
    uri = os.environ["MLFLOW_TRACKING_URI"]
    main, base, conf = out.main, out.baseline, out.confirm
    assert main.best is not None and base is not None and base.best is not None and conf is not None
    assert len(main.trials) == 2 and len(base.trials) == 2
    assert base.best.params["optim.lr"] == 3e-3  # a 1e-6 rate learns nothing in 8 steps
    plan = conf.plan
    assert plan.seeds == [1, 2]  # fresh: every trial trained with the recipe's seed 0
    assert [a.name for a in plan.arms] == ["tuned", "mdlm", "init-normal"]
    assert plan.arm("mdlm").raw["optim"]["lr"] == 3e-3 and plan.arm("mdlm").raw["model"]["kind"] == "mdlm"
    assert plan.arm("tuned").raw["model"]["gamma"] == main.best.params["gamma"]
    # The baseline is cheaper per step: at the winner's FLOPs of 4 steps it is read at a later validation.
    flops = next(r for r in plan.readings if r.key == "flops:4")
    assert flops.step["tuned"] == 4 and flops.step["mdlm"] > 4 and flops.step["mdlm"] % 4 == 0
    assert plan.arm("mdlm").steps == flops.step["mdlm"]  # it trains on to its FLOPs reading

    # Every reading is the confirmation run's own validation bound at that step, never a search trial's.
    hist = _histories(uri)
    for r in plan.readings:
        for arm, step in r.step.items():
            got = conf.bounds[r.key][arm]
            assert sorted(got) == [1, 2], (r.key, arm)
            for seed, v in got.items():
                assert v == hist[f"t-confirm-confirm-{arm}-s{seed}"][step], (r.key, arm, seed)
    trial_run = f"t-confirm-{main.best.trial_id}"
    for seed, v in conf.bounds["steps:8"]["tuned"].items():
        assert v != hist[trial_run][8] and v != main.best.selection_ppl, seed
    # The interval is the paired t interval of those runs' differences, recomputed here.
    primary = conf.plan.primary
    assert (primary.arm, primary.against, primary.reading) == ("tuned", "mdlm", "steps:8")
    d = [math.log(conf.bounds["steps:8"]["mdlm"][s]) - math.log(conf.bounds["steps:8"]["tuned"][s]) for s in (1, 2)]
    want = summarise(d)
    assert (primary.difference.mean, primary.difference.lo, primary.difference.hi) == pytest.approx(
        (want.mean, want.lo, want.hi))
    verdict = "beats" if want.lo > 0 else "trails" if want.hi < 0 else "ties"
    number = r"[+-]?[0-9]+\.[0-9]{3}"
    said = (rf"by {number} nats/token \[{number}, {number}\]" if verdict != "ties" else
            rf": difference {number} nats/token \[{number}, {number}\] \(> 0: ADLM's bound lower\)")
    assert re.fullmatch(rf"ADLM \(gamma=[0-9.e+-]+, tau=5\) {verdict} MDLM \(lr=0\.003\) ?{said} at 2 fresh seeds "
                        r"\(equal steps, 8\)", conf.summary), conf.summary
    ablation = next(c for c in conf.contrasts if c.arm == "init-normal")
    assert ablation.against == "tuned" and ablation.reading == "steps:4" and ablation.difference.n == 2
    assert "| tuned | winner |" in conf.markdown and "2 trials (0 stopped by ASHA), 16 steps trained" in conf.markdown

    # MLflow: the parent holds the interval and the pictures; the confirmed runs are versions tagged with it.
    c = mlflow.MlflowClient(uri)
    parent = c.get_run(main.parent_run_id)
    key = "confirm/tuned_vs_mdlm/steps_8"
    assert parent.data.metrics[f"{key}/d_lo"] == pytest.approx(primary.difference.lo)
    assert parent.data.tags["confirm.summary"] == conf.summary and parent.data.tags["confirm.seeds"] == "[1, 2]"
    arts = {a.path for a in c.list_artifacts(main.parent_run_id, "sweep")}
    assert {"sweep/confirm.png", "sweep/confirm.md", "sweep/confirm.csv", "sweep/search.png"} <= arts
    for name in ("confirm.png", "search.png"):
        assert Path(conf.artifacts[name]).stat().st_size > 10_000
    versions = [v for v in c.search_model_versions("name='adlm'") if "confirm.arm" in (v.tags or {})]
    assert sorted((v.tags["confirm.arm"], v.tags["confirm.seed"]) for v in versions) == [
        ("mdlm", "1"), ("mdlm", "2"), ("tuned", "1"), ("tuned", "2")]
    assert all(float(v.tags["confirm.d_lo"]) == pytest.approx(primary.difference.lo) for v in versions)
    assert c.get_model_version_by_alias("adlm", "candidate").run_id == main.best.mlflow_run_id  # no alias moved
    json.loads(Path(conf.artifacts["confirm.json"]).read_text())

    # A rerun trains nothing (finished runs are skipped) and registers nothing new.
    runs_before = len(hist)
    again = run_tune(load_space(f), str(DEMO), sets)
    assert again.confirm.summary == conf.summary and sorted(again.confirm.versions) == sorted(conf.versions)
    assert len(_histories(uri)) == runs_before
    assert len(c.search_model_versions("name='adlm'")) == len(versions) + 1
