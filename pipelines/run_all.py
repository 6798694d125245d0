"""The whole pipeline, top to bottom: what ``make demo`` runs and what a cluster job submits.

    python -m pipelines.run_all                      # the embedded demo (CPU, offline, a few minutes)
    python -m pipelines.run_all --profile smoke      # a 1-2 minute end-to-end check (tests, job submit)
    ray job submit --working-dir . --runtime-env runtime_env.yaml -- python -m pipelines.run_all

Stages (each one is also its own CLI; this script only chains them):

1. ``prepare``: Ray Data tokenises and packs the embedded corpus (gensim's Wikipedia sample and the
   King James Bible, shipped by pip packages) into Parquet shards with manifests.
2. ``train``: ADLM (``configs/demo.yaml``), the AR baseline (``configs/demo_ar.yaml``) and MDLM
   (``configs/demo_mdlm.yaml``) with Ray Train on 2 CPU workers; each run's best EMA checkpoint by
   validation bound is registered ``@candidate``.
3. ``tune``: a small gamma/tau search (``tune_spaces/demo.yaml``) with ASHA; the best trial is
   registered ``@candidate``.
4. ``evaluate``: staged evaluation of every waiting version (fast validation bound, then validation
   PPL, samples, gen-PPL under SmolLM2-135M, unigram entropy and MAUVE on MiniLM features, all
   offline), and the gate promotes the best to ``@champion``.
5. A summary table (ADLM vs AR vs MDLM vs the sweep's best), two samples of the champion and the command
   that opens the MLflow UI.

Everything lives under the work directory (``--workdir`` > ``$ADLM_WORKDIR`` > ``./work``) and the
MLflow store (``$MLFLOW_TRACKING_URI`` > ``sqlite:///<workdir>/mlflow.db``). Every stage resumes:
rerunning the script reuses the prepared shards, continues finished training runs (nothing to do),
resumes the sweep and only evaluates versions that are still waiting.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from adlm_model.config import ConfigError
from pipelines.core.cli import run_command
from pipelines.core.logs import add_logging_flags
from pipelines.core.runtime import PROJECT_ROOT, init_ray, quiet_environment
from pipelines.core.storage import join, resolve_workdir
from pipelines.data.prepare import prepare
from pipelines.evaluation.config import EvalConfig
from pipelines.evaluation.promotion import PromotionConfig, outcomes_markdown, stage_all
from pipelines.orchestration.profiles import PROFILES, prepare_options, profile, validate_profile
from pipelines.orchestration.summary import write_summary
from pipelines.tracking.runs import require_server, resolve_tracking_uri


class Unregistered(RuntimeError):
    """A stage's result that was to be registered is not: the pipeline stops (evaluation would miss it); the
    message is the one line that finishes it (rerun the same command)."""

    exit_code = 3
    """Trained, not registered: every stage resumes, so the rerun finishes it (``pipelines.core.cli``)."""


def _banner(msg: str) -> None:
    """A stage's title: a blank line, then the title in a rule (what a reader scans the console for)."""
    print(f"\n== {msg} {'=' * max(3, 96 - len(msg))}", flush=True)


def run(profile_name: str = "demo", *, workdir: str | os.PathLike | None = None, skip_sweep: bool = False) -> dict:
    """Run every stage; returns the summary (also written to ``<workdir>/summary.json`` and ``.md``)."""
    quiet_environment()
    if not os.environ.get("RAY_ADDRESS"):
        # A local Ray of short runs: Ray Train's controller polls its workers every 2 s by default, and every
        # worker-group start, report and finish waits for a poll (about 10 s of each run here).
        os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
        # No node of a local Ray is ever drained: Ray Train's preemption watcher (an actor a fit) has nothing to
        # watch.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    prof = profile(profile_name)
    wd = resolve_workdir(workdir)
    # Resolved once, here: every stage below (and every Ray task or Tune trial they start) gets ``wd`` as an
    # argument, none reads $ADLM_WORKDIR again.
    uri = resolve_tracking_uri(wd)
    # Its evaluation and promotion need the store: a server that does not answer is said now, not after the training.
    require_server(uri, "the pipeline (its evaluation and promotion read and write the registry)")
    t0 = time.time()
    timings: dict[str, float] = {}

    cfgs, space = validate_profile(prof, PROJECT_ROOT, wd, skip_sweep)  # one-line errors before any work

    init_ray()

    # 1. Data.
    _banner(f"1/4 prepare data ({prof.name}) -> {join(wd, 'data')}")
    t = time.time()
    prepare(prepare_options(prof, wd))
    timings["prepare"] = time.time() - t

    # 2. Training runs.
    # lazy: keeps torch.distributed out of this module's import
    from pipelines.training.trainer import train

    results = {}
    for label, cfg in cfgs:
        _banner(f"2/4 train {label} ({cfg.model.kind}, run {cfg.run.name}, {cfg.run.max_steps} steps)")
        t = time.time()
        results[label] = train(cfg, workdir=wd, tracking_uri=uri)
        if results[label].unregistered:
            raise Unregistered(results[label].unregistered)
        timings[f"train {label}"] = time.time() - t

    # 3. The sweep.
    sweep_res = None
    if space is not None:
        _banner(f"3/4 gamma/tau sweep {space.name} ({space.total_trials} trials, ASHA)")
        t = time.time()
        # lazy: keeps ray out of this module's import
        from pipelines.tuning.sweep import sweep

        sweep_res = sweep(space, PROJECT_ROOT / "configs" / "demo.yaml", prof.sweep_overrides, workdir=wd,
                          tracking_uri=uri)
        if sweep_res.unregistered:
            raise Unregistered(sweep_res.unregistered)
        timings["sweep"] = time.time() - t

    # 4. Staged evaluation and promotion.
    _banner("4/4 staged evaluation of every @candidate and promotion to @champion")
    t = time.time()
    model_name = cfgs[0][1].mlflow.registered_model
    outcomes = stage_all(PromotionConfig(model_name=model_name, **prof.promotion), EvalConfig(**prof.eval_settings),
                         workdir=wd, tracking_uri=uri)
    print(outcomes_markdown(outcomes), flush=True)
    timings["evaluate"] = time.time() - t
    timings["total"] = time.time() - t0

    # 5. The summary.
    summary, md = write_summary(prof, wd, uri, model_name, cfgs[0][1].model.vocab_size, results, sweep_res, timings)
    _banner("summary")
    print(md, flush=True)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.run_all",
        description="Run the whole ADLM pipeline: prepare -> train ADLM, AR and MDLM -> gamma/tau sweep -> staged "
                    "evaluation and promotion -> summary. Offline on the embedded corpus; rerun to resume.")
    p.add_argument("--profile", choices=PROFILES, default="demo",
                   help="demo: the `make demo` pipeline (a few minutes on 2 CPU cores); smoke: the same stages on a toy")
    p.add_argument("--workdir", default=None, help="work directory (default: $ADLM_WORKDIR or ./work)")
    p.add_argument("--skip-sweep", action="store_true", help="leave out the gamma/tau sweep")
    add_logging_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    # RuntimeError: TrainError, TuneError, a stage failed after it started (Unregistered carries its own 3).
    return run_command(build_parser(), _run, argv, bad_input=(ConfigError, ValueError), failed=(RuntimeError,))


def _run(args: argparse.Namespace) -> int:
    run(args.profile, workdir=args.workdir, skip_sweep=args.skip_sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
