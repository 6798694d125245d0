"""A grid of training runs, one Ray Tune trial each: what a study trains and what a sweep's confirmation retrains.

Every run is a ``pipelines.train`` run named after its arm and seed, nested in MLflow under its arm's run, trained
in its trial's process (``scaling.num_workers: 0``) or by a Ray Train worker group the trial starts. A run already
trained to its steps is skipped; an interrupted one resumes from its checkpoint: rerun the same command. Its
validation curve is read back from MLflow by its run name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pipelines.core.logs import verbosity
from pipelines.core.runtime import cpu_placement
from pipelines.core.storage import join
from pipelines.tracking.runs import RUN_NAME_TAG, client
from pipelines.training.checkpoints import latest_checkpoint
from pipelines.training.config import TrainConfig

METRIC = "val/ppl"
"""The validation bound's MLflow key: what a grid's readings are."""


@dataclass
class RunPlan:
    """One (arm, seed) training run."""

    arm: str
    seed: int
    run_name: str
    max_steps: int
    raw: dict[str, Any]
    """The full recipe of this run (validated)."""


@dataclass
class TrialContext:
    """What each trial's driver function needs (pickled into its Tune actor)."""

    runs: dict[str, RunPlan]
    workdir: str
    tracking_uri: str
    arm_runs: dict[str, str | None]
    """The MLflow run each arm's runs nest under (None: MLflow was down; the runs spool)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags of every run; ``<prefix>.arm`` and ``<prefix>.seed`` are added per run."""
    prefix: str = "study"


def run_one(config: dict[str, Any], *, ctx: TrialContext) -> None:
    """One (arm, seed), in its Tune actor: a ``pipelines.train`` run nested under its arm's run."""
    # lazy: keeps ray out of this module's import
    from ray import tune

    # lazy: keeps torch.distributed out of this module's import
    from pipelines.training.trainer import train

    rp = ctx.runs[config["run"]]
    cfg = TrainConfig.from_dict(rp.raw)
    tags = {**ctx.tags, f"{ctx.prefix}.arm": rp.arm, f"{ctx.prefix}.seed": str(rp.seed)}
    res = train(cfg, workdir=ctx.workdir, tracking_uri=ctx.tracking_uri, parent_run_id=ctx.arm_runs.get(rp.arm),
                extra_tags=tags, register=False)
    tune.report({"step": res.step, "val_ppl": res.val_ppl, "mlflow_run_id": res.run_id})


def trained(workdir: str, rp: RunPlan) -> bool:
    """Whether the run's latest checkpoint is at its last step."""
    # lazy: keeps torch.distributed out of this module's import
    from pipelines.training.trainer import storage_root

    last = latest_checkpoint(join(storage_root(TrainConfig.from_dict(rp.raw), workdir), rp.run_name))
    return last is not None and last[0] >= rp.max_steps


def history(tracking_uri: str, rp: RunPlan) -> dict[int, float]:
    """The run's validation bound by step, from its MLflow run (found by its run name); empty if none."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(TrainConfig.from_dict(rp.raw).mlflow.experiment)
    found = c.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{rp.run_name}'",
                          max_results=1, order_by=["attributes.start_time DESC"]) if exp else []
    if not found:
        return {}
    return {m.step: m.value for m in c.get_metric_history(found[0].info.run_id, METRIC)}


def fit_grid(name: str, todo: list[RunPlan], ctx: TrialContext, *, max_concurrent: int, resources: dict[str, float],
             cost: dict[str, float], what: str) -> None:
    """Train ``todo`` as the trials of the Tune grid ``name`` (``<workdir>/ray_results/tune/<name>``), longest first
    (``cost``: an arm's cost of one step) so that the slots finish together; a failed run raises RuntimeError naming
    the runs (``what``: the grid's owner, for the message), after the others have run."""
    # lazy: keeps ray out of this module's import
    from ray import tune
    from ray.tune import RunConfig, TuneConfig, Tuner

    order = sorted(todo, key=lambda rp: -rp.max_steps * cost.get(rp.arm, 1.0))
    trainable = tune.with_resources(partial(run_one, ctx=ctx), cpu_placement(resources))
    tuner = Tuner(trainable, param_space={"run": tune.grid_search([rp.run_name for rp in order])},
                  tune_config=TuneConfig(max_concurrent_trials=max_concurrent),
                  run_config=RunConfig(name=name, storage_path=join(ctx.workdir, "ray_results", "tune"),
                                       verbose=0 if verbosity() < 0 else 2 if verbosity() > 0 else 1))  # -q/-v
    grid = tuner.fit()
    failed = [r for r in grid if r.error is not None]
    if failed:
        names = ", ".join(str(r.config.get("run")) for r in failed)
        raise RuntimeError(f"{what}: {len(failed)} run(s) failed ({names}); first error: "
                           f"{str(failed[0].error).splitlines()[0][:300]}; rerun the same command to resume them")
