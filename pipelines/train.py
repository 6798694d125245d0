"""Train ADLM / MDLM / AR / BD3-LM with Ray Train from prepared shards; track and register in MLflow.

    python -m pipelines.train --config configs/demo.yaml [--set run.max_steps=200 --set model.kind=mdlm ...]

Rerunning the same run name resumes it from its latest checkpoint. The driver is
``pipelines/training/trainer.py``; the worker loop ``pipelines/training/loop.py``.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from adlm_model.config import ConfigError
from pipelines.core.cli import run_command
from pipelines.core.configlib import keys_help
from pipelines.core.logs import add_logging_flags
from pipelines.training.acot_run import finetune
from pipelines.training.config import load_config, recipe_keys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.train",
        description="Train ADLM / MDLM / AR / BD3-LM with Ray Train from prepared Parquet shards; track and "
                    "register in MLflow. Rerunning the same run name resumes it from its latest checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Recipe sections: model (a preset plus ModelConfig fields), data, optim, batch, run, scaling, "
               "failure, ema, ema_warmup, mlflow, distill (self-distillation of a version; python -m "
               "pipelines.distill), acot (anchored chain-of-thought fine-tuning of one arm on reasoning rows: "
               "configs/acot_prosqa_cpu.yaml). --help-config lists every key with its type, default and description.\n\n"
               "Example:\n  python -m pipelines.train --config "
               "configs/demo.yaml --set run.max_steps=50 --set model.kind=mdlm --set run.name=demo-mdlm\n\nExit codes: 0 trained "
               "(and registered when mlflow.register); 1 training failed; 2 bad input, or credentials refused (the "
               "tracking server, the store, the Ray cluster), before any work; 3 trained but not registered (the "
               "tracking server was down or refused the registration): rerun the same command to register it.")
    p.add_argument("--config", required=True, help="YAML recipe (configs/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. run.max_steps=100 or model.gamma=0.01 (repeatable)")
    p.add_argument("--init", metavar="MODEL", help="start a fresh run from the EMA weights of a registered or "
                   "imported version (models:/NAME/VERSION or @ALIAS) or a checkpoint folder: run.init; recorded as "
                   "the lineage init_from on the run and its registered version; a resumed run ignores it")
    p.add_argument("--workdir", default=None, help="work directory (default: $ADLM_WORKDIR or ./work); holds "
                   "data, ray_results, checkpoints and the default sqlite MLflow store")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--help-config", action="store_true", help="list every recipe key (section.key) with its type, "
                   "default and description, and exit")
    add_logging_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    if "--help-config" in (sys.argv[1:] if argv is None else argv):  # before --config is required
        print(keys_help(recipe_keys(), "Recipe keys (a YAML section's key, or --set SECTION.KEY=VALUE)"))
        return 0
    # ValueError: bad input (ConfigError and the checks before any work); RuntimeError: TrainError, training
    # failed after it started.
    return run_command(build_parser(), _run, argv, bad_input=(ConfigError, ValueError), failed=(RuntimeError,))


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.init:
        cfg.run.init = args.init
    if args.print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    if cfg.acot.arm:  # anchored chain-of-thought fine-tuning on reasoning rows: its own staged loop
        res = finetune(cfg, workdir=args.workdir)
        print(json.dumps(res.summary()))
    else:
        # lazy: keeps torch.distributed out of this module's import
        from pipelines.training.trainer import train

        res = train(cfg, workdir=args.workdir)
        print(json.dumps({"run_id": res.run_id, "step": res.step, "val_ppl": res.val_ppl,
                          "checkpoint_dir": str(res.checkpoint_dir), "registered_version": res.registered_version}))
    if res.unregistered:  # trained, not registered: not a success a script may take for one
        print(f"error: {res.unregistered}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
