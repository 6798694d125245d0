"""Generate text with a registered model version, a checkpoint or an exported model.

    python -m pipelines.generate --model models:/adlm@champion --prompt "In the beginning" --length 32
    python -m pipelines.generate --model models:/adlm@champion --prompt "In the beginning" \\
        --suffix " and the earth." --length 24 --steps 256 --seed 7 --num-samples 2 --json

Fast sampling (docs/usage/fast-sampling.md): ``--sampler confidence`` unmasks every position whose top probability
exceeds ``--threshold`` at each step (at least one), in ``--block``-token blocks, with the approximate KV
cache refreshed every ``--refresh`` steps (``--kv-cache prefix|dual``; refresh 1 is exact):

    python -m pipelines.generate --model models:/adlm@champion --prompt "In the beginning" --length 64 \\
        --sampler confidence --threshold 0.9 --block 16 --refresh 4

The text stops at the first EOS the model generated (``--keep-going``: it does not) and shows no special token.

Infilling (``--suffix``) works with the diffusion kinds (MDLM, ADLM: both sides seen at every step) and
block-wise with BD3-LM (which also generates beyond the training length); an AR model continues a prompt.
The machinery is ``pipelines/serving/generate.py``; generation itself is ``adlm_model.inference.textgen``, the code
the served MLflow model runs, so the same settings and seed give the same text.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from adlm_model.config import ConfigError
from adlm_model.inference.limits import LimitError
from adlm_model.inference.textgen import (
    DEFAULT_LENGTH,
    DEFAULT_NUCLEUS_P,
    DEFAULT_STEPS,
    GenerationError,
    GenerationRequest,
    resolve_device,
    validate_request,
)
from adlm_model.interop.checkpoint import CheckpointError
from pipelines.core.cli import CommandError, run_command
from pipelines.core.logs import add_logging_flags
from pipelines.data.tokenizer import TokenizerError
from pipelines.serving.generate import as_json_rows, open_generator, run_generation
from pipelines.tracking.registry import RegistryError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.generate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate text: continue a prompt, or fill in between a prompt and a suffix.",
        epilog="examples:\n  python -m pipelines.generate --model models:/adlm@champion --prompt 'In the beginning'\n"
               "  python -m pipelines.generate --model models:/adlm@champion --prompt 'In the beginning' "
               "--suffix ' the earth.' --length 24 --seed 7 --json")
    p.add_argument("--model", required=True,
                   help="models:/NAME@ALIAS, models:/NAME/VERSION, a checkpoint folder or an exported folder")
    p.add_argument("--prompt", default="", help="text the output starts with (default: empty)")
    p.add_argument("--suffix", default="", help="text the output ends with: infilling (diffusion kinds; "
                                                "block-wise for BD3-LM; not for AR)")
    p.add_argument("--length", type=int, default=DEFAULT_LENGTH,
                   help=f"tokens to generate between prompt and suffix (default {DEFAULT_LENGTH}); prompt, length "
                        "and suffix must fit the model's context unless the sampler is bd3lm")
    p.add_argument("--steps", type=int, default=None,
                   help="diffusion steps T (per block for bd3lm; ignored by ar; default: the version's sampler_steps "
                        f"when it is a distilled student, else {DEFAULT_STEPS})")
    p.add_argument("--sampler", default=None,
                   help="mdlm, remdm-loop, confidence, ar, ar-window, bd3lm, sedd-euler, sedd-analytic or ssdlm (default: the "
                        "model kind's own: remdm-loop for MDLM/ADLM, ar, bd3lm, sedd-analytic for SEDD, ssdlm)")
    p.add_argument("--threshold", type=float, default=None,
                   help="confidence sampler: unmask every position whose top probability exceeds it, at least one "
                        "a step; in [0, 1] (default 0.9; 1 = one token a step, 0 = all at once)")
    p.add_argument("--block", type=int, default=None,
                   help="confidence sampler: semi-autoregressive block size, dividing --length (default: one block); "
                        "ssdlm / bd3lm: their block size (default: SSD-LM's 25, BD3-LM's trained one)")
    p.add_argument("--refresh", type=int, default=None,
                   help="confidence sampler: approximate KV cache, a full pass every N steps and at each new block "
                        "(1 = exact; default: no cache)")
    p.add_argument("--kv-cache", choices=("off", "prefix", "dual"), default=None,
                   help="confidence sampler: which keys/values are reused: prefix (before the block) or dual (both "
                        "sides; default with --refresh)")
    p.add_argument("--keep-going", action="store_true",
                   help="keep the tokens after the first EOS the model generated (default: the text stops there)")
    p.add_argument("--nucleus-p", type=float, default=DEFAULT_NUCLEUS_P,
                   help=f"top-p at every draw, 1 = off (default {DEFAULT_NUCLEUS_P})")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random, reported with --json)")
    p.add_argument("--num-samples", type=int, default=1, help="samples drawn together (default 1)")
    p.add_argument("--no-limits", action="store_true",
                   help="lift the served model's limits on one request's cost, which apply here too: ADLM_MAX_STEPS "
                        "(default 4096), ADLM_MAX_LENGTH (the model's context), ADLM_MAX_ROWS (samples, default 16), "
                        "ADLM_MAX_WORK (estimated FLOPs, default 1e12: tens of seconds of a CPU core)")
    p.add_argument("--device", default="auto", help="auto (GPU when there is one), cpu, cuda, cuda:1, ...")
    p.add_argument("--workdir", help="work directory (default: $ADLM_WORKDIR or ./work): tracking store and cache")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the workdir's)")
    p.add_argument("--json", action="store_true", help="print one JSON object per sample (a JSON list)")
    add_logging_flags(p)  # -q: no progress bar
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), _run, argv,
                       bad_input=(GenerationError, RegistryError, CheckpointError, ConfigError, TokenizerError))


def _run(args: argparse.Namespace) -> int:
    request = GenerationRequest(prompt=args.prompt, suffix=args.suffix, length=args.length, steps=args.steps,
                                sampler=args.sampler, nucleus_p=args.nucleus_p, seed=args.seed,
                                num_samples=args.num_samples, threshold=args.threshold, block=args.block,
                                refresh=args.refresh, kv_cache=args.kv_cache, stop_at_eos=not args.keep_going)
    validate_request(request)  # what needs no model fails before one is downloaded or loaded
    resolve_device(args.device)  # likewise a device this machine does not have
    loaded = open_generator(args.model, tracking_uri=args.tracking_uri, workdir=args.workdir, device=args.device)
    try:
        out = run_generation(loaded, request, progress=not args.quiet, limits=not args.no_limits)
    except LimitError as e:
        raise CommandError(f"{e} (or raise the setting, or pass --no-limits)") from None
    if args.json:
        print(json.dumps(as_json_rows(loaded, out), indent=2, ensure_ascii=False))
    else:
        for i, g in enumerate(out):
            if len(out) > 1:
                print(f"--- sample {i + 1} of {len(out)} ---")
            print(g.text)
    return 0

if __name__ == "__main__":
    sys.exit(main())
