"""Serve a registered version over HTTP: MLflow's scoring server behind the request guard
(``pipelines/serving/server.py``: a body limit, short refusals that never echo the request).

    python -m pipelines.serve --model models:/adlm@champion --port 5001
    curl -s http://127.0.0.1:5001/invocations -H 'Content-Type: application/json' \\
        -d '{"dataframe_records": [{"prompt": "In the beginning", "length": 16}]}'

The endpoints are ``mlflow models serve``'s (``/invocations``, ``/ping``, ``/health``, ``/version``) and so is the
JSON; the version is downloaded from the registry and served by uvicorn in this process's environment (the
virtual environment's ``bin`` is put first on ``PATH`` for anything it starts). The served model's own limits
(``ADLM_MAX_STEPS``, ``ADLM_MAX_LENGTH``, ``ADLM_MAX_ROWS``, ``ADLM_MAX_WORK``, ``ADLM_MAX_CHARS``) and the
body limit (``--max-body-bytes`` / ``ADLM_MAX_BODY_BYTES``) are read from the environment.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pipelines.core.cli import run_command
from pipelines.core.logs import add_logging_flags
from pipelines.core.storage import resolve_workdir
from pipelines.serving.server import BODY_ENV, DEFAULT_MAX_BODY_BYTES, MODEL_PATH_ENV, max_body_bytes
from pipelines.tracking.registry import RegistryError, download_version
from pipelines.tracking.runs import resolve_tracking_uri


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a registered version over HTTP (MLflow's scoring server: POST /invocations) with a "
                    "limit on the request body and one-line refusals that never echo the request.",
        epilog="example:\n  python -m pipelines.serve --model models:/adlm@champion --port 5001")
    p.add_argument("--model", required=True, help="models:/NAME@ALIAS, models:/NAME/VERSION or a downloaded MLflow "
                                                   "Model folder (it holds MLmodel)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every "
                                                       "interface)")
    p.add_argument("--port", type=int, default=5001, help="port (default 5001)")
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes, each with its own copy of the "
                                                          "weights (default 1)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help=f"largest request body accepted (default ${BODY_ENV} or {DEFAULT_MAX_BODY_BYTES:,}); a larger "
                        "one is refused with HTTP 413")
    p.add_argument("--workdir", help="work directory (default: $ADLM_WORKDIR or ./work): tracking store")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the workdir's)")
    add_logging_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), _run, argv, bad_input=(RegistryError, ValueError))


def _check(args: argparse.Namespace) -> None:
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1-65535, got {args.port}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.max_body_bytes is not None:
        if args.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
        os.environ[BODY_ENV] = str(args.max_body_bytes)
    max_body_bytes()  # a bad ADLM_MAX_BODY_BYTES: one line now, not in each worker


def model_folder(model: str, tracking_uri: str | None, workdir: str | None, dst: Path) -> Path:
    """The MLflow Model folder to serve: a ``models:/`` version downloaded into ``dst``, or a local folder."""
    if model.startswith("models:/"):
        local = download_version(model, tracking_uri or resolve_tracking_uri(resolve_workdir(workdir)), dst)
    else:
        local = Path(model).expanduser()
    if not (local / "MLmodel").is_file():
        raise RegistryError(f"{model} is not an MLflow Model (no MLmodel file): serve a models:/ version registered "
                            "by training or import, or its downloaded folder")
    return local


def _run(args: argparse.Namespace) -> int:
    # lazy: keeps uvicorn out of this module's import
    import uvicorn

    _check(args)
    # uvicorn and anything the served model starts come from this environment, whatever PATH the shell had.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    with tempfile.TemporaryDirectory(prefix="adlm-serve-") as tmp:
        os.environ[MODEL_PATH_ENV] = str(model_folder(args.model, args.tracking_uri, args.workdir, Path(tmp)))
        print(f"serving {args.model} on http://{args.host}:{args.port}/invocations", file=sys.stderr, flush=True)
        uvicorn.run("pipelines.serving.server:create_app", factory=True, host=args.host, port=args.port,
                    workers=args.workers, log_level="warning" if args.quiet else "info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
