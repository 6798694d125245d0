"""The harness's own command line with the project's model registered: ``adlm-lm-eval`` (or
``python -m pipelines.evaluation.lm_eval_cli``) takes exactly ``lm_eval``'s arguments.

    adlm-lm-eval --model adlm --model_args pretrained=models:/adlm@champion,mc_samples=32 --tasks adlm_offline
    adlm-lm-eval --model adlm --model_args pretrained=work/runs/r1/checkpoints/best --tasks lambada_openai,piqa

lm-eval 0.4.13 finds external models only in its registry (no entry-point discovery): this wrapper imports
``lm_eval_model`` (which registers ``adlm``), passes the offline tasks' folder as ``--include_path`` (unless
one is given: the harness takes one folder), checks the
adapter's settings and the task names in one line each before any model loads, then hands over to
``lm_eval``'s ``cli_evaluate``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipelines.core.logs import setup_logging
from pipelines.core.settings import SettingError, check_environment
from pipelines.core.storage import resolve_workdir
from pipelines.tracking.registry import RegistryError, get_version
from pipelines.tracking.runs import resolve_tracking_uri


def _precheck(argv: list[str]) -> str | None:
    """One line saying what is wrong with an ``adlm`` run's settings or tasks, or None."""
    # lazy: keeps lm_eval out of this module's import
    from lm_eval.utils import simple_parse_args_string

    # lazy: keeps lm_eval, pydantic, torch, tqdm, yaml out of this module's import
    from pipelines.evaluation.config import EvalConfig, EvalError
    from pipelines.evaluation.lm_eval_model import MODEL_NAME, AdapterSettings
    from pipelines.evaluation.lm_eval_suite import check_lm_eval
    p = argparse.ArgumentParser(add_help=False)
    for flag in ("--model", "--model_args", "--tasks", "--include_path"):
        p.add_argument(flag, default=None)
    known, _ = p.parse_known_args(argv)
    try:
        if known.model == MODEL_NAME:
            args = simple_parse_args_string(known.model_args or "")
            pretrained, tracking = str(args.get("pretrained") or ""), args.get("tracking_uri")
            if not pretrained:
                raise EvalError("--model_args needs pretrained=MODEL (models:/adlm@champion, a checkpoint folder, "
                                "an export)")
            for k in ("pretrained", "tracking_uri", "max_batch_size"):
                args.pop(k, None)
            if str(args.get("batch_size", "")).startswith("auto"):
                args.pop("batch_size")
            AdapterSettings.from_kwargs(args).validate()
            if pretrained.startswith("models:/"):  # a missing version: one line before the harness starts
                get_version(pretrained, tracking or resolve_tracking_uri(resolve_workdir(None)))
        if known.tasks:
            check_lm_eval(EvalConfig(lm_eval_tasks=tuple(t for t in known.tasks.split(",") if t),
                                     lm_eval_include_path=known.include_path or ""), None)
    except (EvalError, RegistryError) as e:
        return str(e)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        check_environment()  # a bad ADLM_* setting: one line, as every command says it (pipelines.core.cli)
    except SettingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The harness parses every flag itself (its own --verbosity): our handler and levels at their defaults.
    setup_logging(0)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" not in argv and "--help" not in argv:
        error = _precheck(argv)
        if error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    # lazy: keeps lm_eval out of this module's import
    from lm_eval.__main__ import cli_evaluate

    # lazy: keeps lm_eval, pydantic, torch, tqdm, yaml out of this module's import
    from pipelines.evaluation.lm_eval_model import AdapterSettings  # importing it registers the adlm model
    from pipelines.evaluation.lm_eval_suite import TASK_DIR, single_process_harness

    if argv and argv[0] not in ("ls", "validate"):
        if "--include_path" not in argv:
            argv += ["--include_path", str(TASK_DIR)]  # the harness takes one folder: a user's own replaces ours
        if "--device" not in argv:
            argv += ["--device", "auto"]  # the harness defaults to cuda:0; ours: CUDA when present, else CPU
        if "--batch_size" not in argv:  # the harness's default of 1 would mean one row a forward pass
            argv += ["--batch_size", str(AdapterSettings.batch_size)]
    sys.argv = ["lm-eval", *argv]
    try:
        with single_process_harness():  # no fork of this multi-threaded process (torch's threads) either
            cli_evaluate()
    except ValueError as e:  # ours (a missing version, a bad checkpoint, bad settings) are ValueErrors
        if type(e).__module__.split(".")[0] not in ("pipelines", "adlm_model"):
            raise  # the harness's own keep their traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
