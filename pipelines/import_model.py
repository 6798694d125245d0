"""Import a released checkpoint (MDLM, its AR baseline, BD3-LM, ADLM, or this project's own export) as a registry
version, like a trained one (docs/usage/released-models.md).

    python -m pipelines.import_model kuleshov-group/mdlm-owt                 # a Hub id (downloads: needs network)
    python -m pipelines.import_model kuleshov-group/bd3lm-owt-block_size4 --revision main
    python -m pipelines.import_model checkpoints/mdlm.ckpt --tokenizer gpt2   # a Lightning .ckpt of the references
    python -m pipelines.import_model s3://bucket/adlm-medium.ckpt             # an object store
    python -m pipelines.import_model exported/adlm                           # our own export folder
    python -m pipelines.import_model checkpoints/mdlm.ckpt --inspect          # key tree, shapes, hyper-parameters

Nothing of the checkpoint runs: config.json and safetensors are read directly (never the Hub's remote code), a
pickle goes through ``adlm_model.interop.safe_pickle``. The layout is mapped by ``adlm_model.interop.reference_layouts`` (one
family per table entry) onto our network, completely or not at all; the version holds the checkpoint folder in
our layout plus the tokenizer the model was trained with (GPT-2 with the mask appended for OWT,
bert-base-uncased for LM1B, or ``--tokenizer``), tagged with the source, revision, the sha256 of the files read,
the license and the reference repository and commit whose layout it follows.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pipelines.core.cli import run_command
from pipelines.core.logs import add_logging_flags
from pipelines.core.storage import resolve_workdir
from pipelines.serving.importing import ImportInputError, import_model
from pipelines.tracking.registry import RegistryError
from pipelines.tracking.runs import require_server, resolve_tracking_uri


def build_parser() -> argparse.ArgumentParser:
    # lazy: keeps torch out of this module's import
    from adlm_model.interop.reference_layouts import FAMILIES

    p = argparse.ArgumentParser(
        prog="python -m pipelines.import_model", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Register a released checkpoint (Hub id, Hub-layout folder, Lightning .ckpt, object-store URI, "
                    "or this project's export folder) as a version of the registered model, mapped exactly onto "
                    "this code's network (or refused, listing the keys that do not map).",
        epilog="example:\n  python -m pipelines.import_model kuleshov-group/mdlm-owt\n"
               "  python -m pipelines.evaluate --model models:/adlm/N --profile paper --suite ppl")
    p.add_argument("source", help="Hub id (owner/name), local folder, .ckpt/.bin/.pt/.pth file, a SEDD run folder, "
                                  "or s3:// / gs:// URI")
    p.add_argument("--name", default=None, help="registered model name (default: adlm)")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of a Hub id")
    p.add_argument("--family", choices=sorted(FAMILIES), help="the layout (default: recognised from the file)")
    p.add_argument("--tokenizer", help="tokenizer the model was trained with (gpt2, bert-base-uncased, a "
                                       "tokenizer.json); default: by the embedding width (50258: gpt2, 30522: bert)")
    p.add_argument("--inspect", action="store_true", help="print the key tree, shapes and saved hyper-parameters; "
                                                          "register nothing")
    p.add_argument("--alias", action="append", default=None, help="alias(es) to set (default: candidate)")
    p.add_argument("--workdir", help="work directory (default: $ADLM_WORKDIR or ./work): tracking store and cache")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the workdir's)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_logging_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # lazy: keeps torch out of this module's import
    from adlm_model.config import ConfigError
    from adlm_model.interop.checkpoint import CheckpointError
    from adlm_model.interop.safe_pickle import UnsafePickleError
    return run_command(build_parser(), _run, argv,
                       bad_input=(ImportInputError, CheckpointError, UnsafePickleError, ConfigError, RegistryError))


def _run(args: argparse.Namespace) -> int:
    if not args.inspect:  # an import registers: a tracking server that does not answer is said before any work
        require_server(args.tracking_uri or resolve_tracking_uri(resolve_workdir(args.workdir)), "an import")
    res = import_model(args.source, name=args.name, revision=args.revision, family=args.family,
                       tokenizer=args.tokenizer, inspect=args.inspect, aliases=args.alias,
                       workdir=args.workdir, tracking_uri=args.tracking_uri)
    if args.inspect:
        print("\n".join(res["lines"]))
        return 0
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        what = "imported" if res["new"] else "already imported (nothing new registered):"
        print(f"{what} {args.source} ({res['family']} -> {res['kind']}, {res['parameters']:,} parameters) as "
              f"{res['uri']}")
        # lazy: keeps torch out of this module's import
        from adlm_model.kinds import model_kind

        suite = "gen_ppl" if model_kind(res["kind"]).sample_only else "ppl"  # a sample-only kind has no likelihood
        print(f"evaluate: python -m pipelines.evaluate --model {res['uri']} --profile paper --suite {suite}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
