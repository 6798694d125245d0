"""The study runner (pipelines/study.py): statistics on known inputs, the study file's one-line errors, and a
real 2 arms x 2 seeds study on tiny data through Ray Tune and MLflow (parent, a child per arm, a training
run per seed under it), whose table reads the runs' own curves at the two budgets."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from adlm_model.config import ConfigError, ModelConfig
from pipelines.studies.spec import load_study, parse_study
from pipelines.studies.stats import relative_gain, summarise
from tests.support.data import TINY_MODEL, data_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_summary_statistics_on_known_values() -> None:
    s = summarise([1.0, 2.0, 3.0])
    assert (s.n, s.mean, s.sd) == (3, 2.0, 1.0)
    half = 4.302652729911275 / math.sqrt(3)  # t_{0.975, 2} sd / sqrt(n)
    assert s.lo == pytest.approx(2.0 - half) and s.hi == pytest.approx(2.0 + half)
    one = summarise([5.0])
    assert one.mean == 5.0 and math.isnan(one.sd) and math.isnan(one.lo) and one.text() == "5.0"
    # Paired by seed: seed 2 is not shared and is left out; gains are percent of the reference.
    g = relative_gain({0: 90.0, 1: 80.0, 2: 1.0}, {0: 100.0, 1: 100.0, 3: 50.0})
    assert g.n == 2 and g.mean == pytest.approx(15.0) and g.sd == pytest.approx(math.sqrt(50.0))
    assert relative_gain({0: 1.0}, {1: 1.0}) is None
    with pytest.raises(ValueError):
        summarise([])


def test_flops_count_follows_the_networks() -> None:
    """Counted FLOPs grow with the blocks; ADLM's anchor + denoiser cost more than MDLM's N blocks and
    BD3-LM's x_t (+) x_0 sequence roughly doubles the block work."""
    from adlm_model.train.flops import training_flops_per_row

    base = dict(vocab_size=256, mask_id=2, seq_len=32, hidden=64, heads=2, n_blocks=2, denoiser_blocks=1,
                cond_dim=32, dropout=0.0)
    f = {name: training_flops_per_row(ModelConfig(kind=kind, **{**base, **extra}))
         for name, kind, extra in [("mdlm", "mdlm", {}), ("mdlm3", "mdlm", {"n_blocks": 3}), ("adlm", "adlm", {}),
                                   ("bd3lm", "bd3lm", {"block_size": 4})]}
    assert f["mdlm"] < f["mdlm3"] < f["adlm"]
    assert 1.5 * f["mdlm"] < f["bd3lm"] < 2.5 * f["mdlm"]
    # Linear in the rows counted: the per-row figure does not depend on them.
    assert training_flops_per_row(ModelConfig(kind="mdlm", **base), rows=3) == f["mdlm"]


BASE = {"name": "t", "config": "configs/demo.yaml", "steps": 4, "arms": [{"name": "a"}]}


@pytest.mark.parametrize(("change", "message"), [
    ({"colour": 1}, "unknown key(s) colour"),
    ({"steps": 0}, "steps must be a positive integer"),
    ({"seeds": [1, 1]}, "distinct non-negative integers"),
    ({"arms": [{"name": "a"}, {"name": "a"}]}, "appear more than once"),
    ({"flops_reference": "b"}, "flops_reference 'b' is not an arm"),
    ({"arms": [{"name": "a", "set": {"kind": "mdlm"}}]}, "section.key"),
    ({"grid": {"name": "g{model.gamma}{x}", "params": {"model.gamma": [0.1]}}}, "may use only"),
])
def test_bad_study_files_fail_in_one_line(change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_study({**BASE, **change}, "s.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_shipped_study_validates_and_puts_the_flops_in_the_blocks() -> None:
    from pipelines.studies.runner import plan_study

    spec = load_study(ROOT / "studies" / "laptop.yaml")
    plan = plan_study(spec, workdir=str(ROOT / "work"), tracking_uri="sqlite:///:memory:")
    names = [a.name for a in spec.arms]
    main_arms = {"adlm", "mdlm", "mdlm-1.5n", "mdlm-2n", "ar", "bd3lm-b4", "adlm-gamma0"}
    assert main_arms <= set(names) and len(names) == 11
    assert all(len(a.seeds) >= 3 for a in spec.arms if a.name in main_arms)
    # The two larger MDLM arms bracket ADLM's parameter count (N + N/2 blocks below it, 2N above).
    from adlm_model.kinds import parameter_count

    params = {a: parameter_count(plan.configs[a].model) for a in ("adlm", "mdlm-1.5n", "mdlm-2n")}
    assert params["mdlm-1.5n"] < params["adlm"] < params["mdlm-2n"]
    # Equal FLOPs: a cheaper arm trains on to ADLM's budget (MDLM about 1.7x the steps).
    assert plan.flops_step["adlm"] == spec.steps and 1.6 * spec.steps <= plan.flops_step["mdlm"] <= 1.8 * spec.steps
    # The blocks carry most of MDLM's FLOPs: remove them and most of the count goes.
    cfg = plan.configs["mdlm"].model
    from adlm_model.train.flops import training_flops_per_row

    no_blocks = training_flops_per_row(ModelConfig(**{**cfg.__dict__, "n_blocks": 1})) * 2 - \
        training_flops_per_row(cfg)  # the vocabulary-projection part: f(1) - (f(2) - f(1))
    assert no_blocks / training_flops_per_row(cfg) < 0.35


@pytest.mark.slow
def test_a_study_of_two_arms_and_two_seeds(tiny_data: Path, workdir: Path, one_torch_thread) -> None:
    import mlflow

    from pipelines.studies.runner import run_study
    from pipelines.training.config import TrainConfig
    from pipelines.training.trainer import train

    sets = {}
    for a in [*data_overrides(tiny_data), *TINY_MODEL, "model.dropout=0.0", "batch.global_batch=4",
              "batch.micro_batch=4", "run.val_every=2", "run.val_batches=1", "run.ckpt_every=2", "run.log_every=2",
              "optim.warmup_steps=1", "optim.lr=0.003", "ema=0.9", "mlflow.experiment=test-study"]:
        k, v = a.split("=", 1)
        sets[k] = yaml.safe_load(v)
    study = {"name": "tiny", "config": "configs/demo.yaml", "seeds": [0, 1], "steps": 2, "flops_reference": "adlm",
             "baseline": "mdlm", "max_concurrent": 2, "trial_cpu": 0.5, "overrides": sets,
             "arms": [{"name": "adlm"}, {"name": "mdlm", "set": {"model.kind": "mdlm"}}]}
    path = workdir / "tiny.yaml"
    path.write_text(yaml.safe_dump(study))
    spec = load_study(path)
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    res = run_study(spec, workdir=str(workdir), tracking_uri=uri, root=ROOT)

    arms = {a.name: a for a in res.arms}
    # MDLM is cheaper per step: it trains on to ADLM's FLOPs at 2 steps (rounded to a validation).
    assert arms["adlm"].flops_step == 2 and arms["mdlm"].flops_step >= 2
    c = mlflow.MlflowClient(uri)
    exp = c.get_experiment_by_name("test-study")
    parent = c.get_run(res.parent_run_id)
    assert parent.data.tags["study"] == "tiny" and parent.info.status == "FINISHED"
    children = c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{res.parent_run_id}'")
    assert sorted(r.data.tags["study.arm"] for r in children) == ["adlm", "mdlm"]
    for child in children:
        arm = arms[child.data.tags["study.arm"]]
        runs = c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{child.info.run_id}'")
        assert sorted(int(r.data.tags["study.seed"]) for r in runs) == [0, 1]
        for r in runs:
            seed = int(r.data.tags["study.seed"])
            hist = {m.step: m.value for m in c.get_metric_history(r.info.run_id, "val/ppl")}
            # The table reads each run's own curve at the two budgets.
            assert arm.at_steps[seed] == hist[2] and arm.at_flops[seed] == hist[arm.flops_step]
        # The arm's statistics are those of its seeds, logged to its run.
        s = summarise([arm.at_steps[0], arm.at_steps[1]])
        assert child.data.metrics["equal_steps/val_ppl_mean"] == pytest.approx(s.mean)
        assert child.data.metrics["equal_steps/val_ppl_lo"] == pytest.approx(s.lo)
    gain = arms["adlm"].gain_steps
    want = [100 * (arms["mdlm"].at_steps[s] - arms["adlm"].at_steps[s]) / arms["mdlm"].at_steps[s] for s in (0, 1)]
    assert gain.mean == pytest.approx(sum(want) / 2)
    table = Path(res.artifacts["table.md"]).read_text()
    assert "| adlm | adlm |" in table and arms["adlm"].steps_summary.text(1) in table
    assert Path(res.artifacts["curves.png"]).stat().st_size > 10_000
    assert {"study/table.md", "study/curves.png"} <= {f.path for f in c.list_artifacts(res.parent_run_id, "study")}

    # A run's first steps are a run of that many steps (constant learning rate, fixed gamma horizon): the
    # equal-steps reading of MDLM's longer run equals a separate run stopped at 2 steps.
    assert arms["mdlm"].flops_step > 2
    rp = next(r for r in res_plan_runs(spec, workdir, uri) if r.arm == "mdlm" and r.seed == 0)
    raw = dict(rp.raw)
    raw["run"] = {**raw["run"], "name": "prefix-check", "max_steps": 2}
    short = train(TrainConfig.from_dict(raw), workdir=str(workdir), tracking_uri=uri, register=False)
    assert short.val_ppl == pytest.approx(arms["mdlm"].at_steps[0], rel=1e-6)

    # A rerun trains nothing new and gives the same table.
    again = run_study(spec, workdir=str(workdir), tracking_uri=uri, root=ROOT)
    assert {a.name: a.at_steps for a in again.arms} == {a.name: a.at_steps for a in res.arms}


def res_plan_runs(spec, workdir: Path, uri: str):
    from pipelines.studies.runner import plan_study

    return plan_study(spec, workdir=str(workdir), tracking_uri=uri, root=ROOT).runs
