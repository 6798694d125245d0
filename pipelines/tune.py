"""Search ADLM's anchor-loss knobs, gamma and tau (or any train-config key), with Ray Tune and ASHA.

    python -m pipelines.tune --space tune_spaces/gamma_tau.yaml --config configs/owt_adlm_small.yaml
    python -m pipelines.tune --space tune_spaces/demo.yaml --config configs/demo.yaml   # the CPU demo

The space schema: ``pipelines/tuning/space.py``; what a sweep does: ``pipelines/tuning/sweep.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from adlm_model.config import ConfigError
from pipelines.core.cli import run_command
from pipelines.core.logs import add_logging_flags
from pipelines.tuning.report import table_markdown
from pipelines.tuning.space import load_space, parse_space


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.tune",
        description="Search ADLM's gamma and tau (or any train-config key) with Ray Tune and ASHA on the "
                    "validation NELBO perplexity; one MLflow parent run with a child run per trial; the best "
                    "trial is registered @candidate. Rerun the same command to resume an interrupted sweep.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Search-space YAML keys: name, params (gamma/tau/<section.key>: {distribution: loguniform|uniform|"
               "choice|randint|grid, low, high | values}), search {algorithm: random|optuna, seed}, scheduler "
               "{type: asha|fifo, grace_period, reduction_factor, max_t}, num_samples, max_concurrent, metric "
               "(val_ppl), resources {trial_cpu}, overrides {section.key: value}.\n\nExample:\n  python -m "
               "pipelines.tune --space tune_spaces/demo.yaml --config configs/demo.yaml")
    p.epilog += ("\n\nExit codes: 0 done (the best trial registered when mlflow.register); 1 the sweep failed; 2 bad "
                 "input; 3 done but the best trial not registered (the tracking server was down or refused): rerun "
                 "the same command to register it; 130 interrupted: rerun to resume.")
    p.add_argument("--space", required=True, help="search-space YAML (tune_spaces/*.yaml)")
    p.add_argument("--config", default=None, help="training recipe YAML (configs/*.yaml); default: the space's "
                                                  "'config'")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one training-config value for every trial (repeatable), e.g. run.max_steps=60")
    p.add_argument("--name", default=None, help="sweep name (default: the space's 'name'); rerun a name to resume it")
    p.add_argument("--num-samples", type=int, default=None, help="override the space's num_samples")
    p.add_argument("--workdir", default=None, help="work directory (default: $ADLM_WORKDIR or ./work)")
    p.add_argument("--confirm", type=int, default=None, metavar="N",
                   help="after the search, retrain the winner at N fresh seeds against the space's comparator "
                        "(confirm.against: the baseline arm, the recipe as it is, or a recipe file) and report the "
                        "paired difference with its 95%% interval; 0: no confirmation (default: the space's "
                        "confirm.seeds)")
    p.add_argument("--check", action="store_true", help="validate the space against the recipe and the data, size "
                                                        "the searches and the confirmation (timed here for a CPU "
                                                        "recipe), then exit")
    add_logging_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    # ValueError: bad input; RuntimeError: TuneError, the sweep failed while running.
    return run_command(build_parser(), _run, argv, bad_input=(ConfigError, ValueError), failed=(RuntimeError,))


def _run(args: argparse.Namespace) -> int:
    space = load_space(args.space)
    if args.name:
        space = dataclasses.replace(space, name=args.name)
        parse_space(space.to_raw(), space.source)
    if args.num_samples is not None:
        space = dataclasses.replace(space, num_samples=args.num_samples)
        parse_space(space.to_raw(), space.source)
    # lazy: keeps ray, torch.utils.flop_counter out of this module's import
    from pipelines.tuning.experiment import check_lines, plan_tune, run_tune, with_confirm

    if args.confirm is not None:
        space = with_confirm(space, args.confirm)
    if args.check:
        tp = plan_tune(space, args.config, args.overrides, workdir=args.workdir)
        print(f"ok: sweep {space.name}: {space.total_trials} trials over {', '.join(p.name for p in space.params)}"
              f"; max_t {tp.main.max_t} steps")
        for line in check_lines(tp):
            print(line)
        return 0
    out = run_tune(space, args.config, args.overrides, workdir=args.workdir)
    res = out.main
    print(table_markdown(res.trials, res.best), flush=True)
    if out.baseline is not None:
        print(table_markdown(out.baseline.trials, out.baseline.best), flush=True)
    if out.confirm is not None:
        print(out.confirm.markdown, flush=True)
    print(json.dumps({"sweep": res.name, "parent_run_id": res.parent_run_id, "interrupted": res.interrupted,
                      "best_trial": res.best.trial_id if res.best else None,
                      "best_val_ppl": res.best.selection_ppl if res.best else None,
                      "registered_version": res.registered_version,
                      **({"baseline_best": out.baseline.best.params if out.baseline.best else None}
                         if out.baseline is not None else {}),
                      **({"confirmed": out.confirm.summary, "verdict": out.confirm.plan.primary.verdict,
                          "confirmed_versions": out.confirm.versions} if out.confirm is not None else {})}))
    if out.confirm is not None:
        print(out.confirm.summary, flush=True)
    if res.unregistered:  # swept, best trial not registered: not a success a script may take for one
        print(f"error: {res.unregistered}", file=sys.stderr)
        return 3
    interrupted = res.interrupted or (out.baseline is not None and out.baseline.interrupted)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())

