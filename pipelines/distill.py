"""Distil a registered MDLM or ADLM version with self-distillation through time (SDTT): a thin front of
``pipelines.train``'s ``distill:`` recipe mode (``pipelines/training/distill.py``).

    python -m pipelines.distill --teacher models:/adlm/3 --config configs/demo.yaml --rounds 3 \\
        --steps-per-round 1000 --teacher-steps 1024 [--set batch.global_batch=64 ...]

``--config`` is the teacher's recipe (its model section must describe the teacher's network: the start from the
version checks it); the run is named ``distill-<model>-<version>`` unless ``--set run.name=...`` says otherwise.
Rerunning the same command resumes it. Exit codes as ``pipelines.train``.
"""

from __future__ import annotations

import argparse
import re
import sys

from pipelines.core.logs import add_logging_flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.distill", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, metavar="MODEL",
                   help="the version to distil: models:/NAME/VERSION, models:/NAME@ALIAS (pinned) or a checkpoint folder")
    p.add_argument("--config", required=True, help="the teacher's training recipe (configs/*.yaml)")
    p.add_argument("--rounds", type=int, help="distill.rounds (default 3)")
    p.add_argument("--steps-per-round", type=int, help="distill.steps_per_round (default 1000)")
    p.add_argument("--teacher-steps", type=int, help="distill.teacher_steps, T0 of the first teacher (default 1024)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one recipe value (repeatable), as pipelines.train")
    p.add_argument("--workdir", default=None, help="work directory (default: $ADLM_WORKDIR or ./work)")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe as YAML and exit")
    add_logging_flags(p)
    return p


def train_argv(args: argparse.Namespace) -> list[str]:
    """The ``pipelines.train`` command line this distillation is."""
    name = "distill-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", args.teacher.removeprefix("models:/")).strip("-")
    sets = [f"run.name={name}", f"distill.teacher={args.teacher}"]
    for flag, key in (("rounds", "rounds"), ("steps_per_round", "steps_per_round"), ("teacher_steps", "teacher_steps")):
        if getattr(args, flag) is not None:
            sets.append(f"distill.{key}={getattr(args, flag)}")
    argv = ["--config", args.config, *(a for s in [*sets, *args.overrides] for a in ("--set", s))]
    if args.workdir:
        argv += ["--workdir", args.workdir]
    if args.print_config:
        argv.append("--print-config")
    return argv + ["-v"] * args.verbose + ["-q"] * args.quiet


def main(argv: list[str] | None = None) -> int:
    # lazy: keeps pydantic, torch, yaml out of this module's import
    from pipelines.train import main as train_main

    return train_main(train_argv(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
