"""Export a registered model version as a Hugging Face-style folder, with its model card.

    python -m pipelines.export models:/adlm@champion --out exported/adlm
    huggingface-cli upload <user>/<repo> exported/adlm .      # then, with network and a token

The folder holds ``config.json``, ``model.safetensors`` (the EMA weights the version serves),
``tokenizer.json`` and ``README.md`` (the evaluation figures of the version's tags, with their definitions);
``adlm_model.load_pretrained(folder)`` loads it back bit for bit, and
``transformers.AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)`` loads the same weights with
the network code shipped beside them (same logits). The machinery is ``pipelines/serving/export.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pipelines.core.cli import run_command
from pipelines.core.logs import add_logging_flags
from pipelines.data.tokenizer import TokenizerError
from pipelines.tracking.registry import RegistryError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.export", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a registered version (or a checkpoint folder) as a Hugging Face-style folder: "
                    "config.json, model.safetensors, tokenizer.json, a model card README.md and the network code "
                    "transformers loads (AutoModelForMaskedLM, trust_remote_code=True).",
        epilog="example:\n  python -m pipelines.export models:/adlm@champion --out exported/adlm\n"
               "  huggingface-cli upload <user>/<repo> exported/adlm .   (needs network and a Hub token)")
    p.add_argument("model", help="models:/NAME@ALIAS, models:/NAME/VERSION or a checkpoint folder")
    p.add_argument("--out", required=True, help="folder to write (new or empty; --force replaces an earlier export)")
    p.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    p.add_argument("--workdir", help="work directory (default: $ADLM_WORKDIR or ./work): tracking store and cache")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the workdir's)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    add_logging_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # lazy: keeps torch out of this module's import
    from adlm_model.config import ConfigError
    from adlm_model.interop.checkpoint import CheckpointError

    # lazy: keeps torch out of this module's import
    from pipelines.serving.export import ExportError

    return run_command(build_parser(), _run, argv,
                       bad_input=(ExportError, RegistryError, CheckpointError, ConfigError, TokenizerError))


def _run(args: argparse.Namespace) -> int:
    # lazy: keeps torch out of this module's import
    from pipelines.serving.export import export_model

    res = export_model(args.model, args.out, tracking_uri=args.tracking_uri, workdir=args.workdir, force=args.force)
    if args.json:
        print(json.dumps({"out": str(res.out), "parameters": res.parameters, "figures": res.figures}, indent=2))
    else:
        print(f"exported {args.model} to {res.out} ({res.parameters:,} parameters; "
              f"{len(res.figures)} evaluation figure(s) in the model card)")
        print(f"upload: huggingface-cli upload <user>/<repo> {res.out} .")
    return 0

if __name__ == "__main__":
    sys.exit(main())
