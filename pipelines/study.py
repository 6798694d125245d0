"""Run a reproduction study (``studies/*.yaml``): arms x seeds, compared at equal steps and equal FLOPs.

    python -m pipelines.study studies/laptop.yaml            # docs/studies.md (under an hour on 2 cores)
    python -m pipelines.study studies/laptop.yaml --check    # validate and size it, train nothing

Rerun the same command to resume: finished runs are skipped, interrupted ones continue from their
checkpoints. The machinery is in ``pipelines/studies/`` (runner, statistics, report).
"""

from __future__ import annotations

import argparse
import sys

from adlm_model.config import ConfigError
from pipelines.core.cli import run_command
from pipelines.core.logs import add_logging_flags
from pipelines.tracking.runs import TrackingAuthError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.study", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("study", help="the study file (studies/*.yaml)")
    p.add_argument("--workdir", default=None, help="work directory (> $ADLM_WORKDIR > ./work)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (> $MLFLOW_TRACKING_URI > "
                                                        "sqlite:///<workdir>/mlflow.db)")
    p.add_argument("--check", action="store_true", help="validate the study, count FLOPs and print the plan; "
                                                        "train nothing")
    add_logging_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), _run, argv, bad_input=(ConfigError, TrackingAuthError), failed=(RuntimeError,))


def _run(args: argparse.Namespace) -> int:
    # lazy: keeps pydantic, torch.utils.flop_counter, yaml out of this module's import
    from pipelines.studies.runner import plan_study, run_study
    from pipelines.studies.spec import load_study

    spec = load_study(args.study)
    if args.check:
        plan = plan_study(spec, workdir=args.workdir, tracking_uri=args.tracking_uri)
        for arm in spec.arms:
            runs = [r for r in plan.runs if r.arm == arm.name]
            print(f"{arm.name:<22} {plan.params[arm.name] / 1e6:6.2f} M params "
                  f"{plan.flops_per_step[arm.name] / 1e9:7.2f} GFLOP/step  {len(runs)} runs to "
                  f"{runs[0].max_steps} steps" + (f"  (equal FLOPs at step {plan.flops_step[arm.name]})"
                                                  if arm.name in plan.flops_step else ""))
        print(f"OK: {len(plan.runs)} runs")
        return 0
    print(run_study(spec, workdir=args.workdir, tracking_uri=args.tracking_uri).markdown, flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
