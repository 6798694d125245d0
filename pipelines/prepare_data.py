"""Tokenize and pack a corpus into Parquet shards with Ray Data (METHOD.md section 5).

    python -m pipelines.prepare_data --source embedded --out work/data/embedded
    python -m pipelines.prepare_data --source openwebtext --out s3://bucket/owt       # online
    python -m pipelines.prepare_data --source train=corpus/*.jsonl --source validation=val.jsonl \\
        --tokenizer gpt2 --length 1024 --out work/data/mine

What it does and why the output is deterministic and resumable: ``pipelines/data/prepare.py``.
"""

from __future__ import annotations

import argparse
import sys

from pipelines.data.detokenizers import DETOKENIZERS
from pipelines.data.encoder import ENGINES
from pipelines.data.plan import PrepareConfig, PrepareError
from pipelines.data.sources import EMBEDDED_TOKENIZER_VOCAB, KNOWN_SOURCES
from pipelines.logs import add_logging_flags, setup_logging


def build_parser() -> argparse.ArgumentParser:
    d = PrepareConfig()
    p = argparse.ArgumentParser(
        prog="python -m pipelines.prepare_data",
        description="Tokenize and pack a corpus into Parquet shards + manifest.json with Ray Data "
                    "(deterministic, resumable). Named sources: " + ", ".join(KNOWN_SOURCES) + ".",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--source", action="append", default=None, metavar="NAME|PATH|SPLIT=PATH",
                   help="named source (" + ", ".join(KNOWN_SOURCES) + "; default embedded) or local/object-store "
                   "text (.txt: one document a line), JSONL or Parquet files, globs or directories; SPLIT=PATH puts "
                   "a path into a split; repeatable")
    p.add_argument("--split", action="append", default=None,
                   help="split(s) to prepare (named sources: their reference splits; a bare local path: train); "
                   "repeatable")
    p.add_argument("--out", default=None, help="output directory or URI (s3://...; file://); default "
                   "<workdir>/data/<source> for named sources")
    p.add_argument("--workdir", default=None, help="work directory (> $ADLM_WORKDIR > ./work)")
    p.add_argument("--tokenizer", default=None, help="gpt2, bert-base-uncased, a tokenizer.json or directory, or a hub "
                   "name; default: the source's (offline, gpt2/bert come from pip packages)")
    p.add_argument("--train-tokenizer", type=int, default=None, metavar="VOCAB_SIZE",
                   help="train a byte-level BPE of this size on the train split and save it as OUT/tokenizer.json "
                   f"(embedded default: {EMBEDDED_TOKENIZER_VOCAB})")
    p.add_argument("--length", type=int, default=None, help="row length L (default: the source's: 1024; lm1b 128; "
                   "embedded 128)")
    p.add_argument("--mode", choices=("wrap", "pad"), default=None,
                   help="wrap: EOS after each document, rows of L-2 framed BOS...EOS, tail dropped; pad: one "
                   "document a row, BOS ... EOS PAD..., attention_mask (default: the source's)")
    p.add_argument("--text-field", default=None, help="text field of JSONL/Parquet input (default text)")
    p.add_argument("--text-unit", choices=("line", "file"), default=d.text_unit,
                   help="plain-text files: one document a line or a file")
    p.add_argument("--keep-empty", action=argparse.BooleanOptionalAction, default=None,
                   help="keep empty documents (a lone EOS each in wrap mode); default: the source's convention "
                   "(the zero-shot sets keep them, as the reference's loader appends EOS to every row)")
    p.add_argument("--detokenizer", default=None, choices=["none", *sorted(DETOKENIZERS)],
                   help="detokenizer applied first (default: the named source's; local: none)")
    p.add_argument("--unit-mb", type=float, default=d.unit_mb, help="largest unit of work (MB of input text); each "
                   "unit becomes one shard, written by the actor that tokenised it")
    p.add_argument("--unit-docs", type=int, default=d.unit_docs,
                   help="documents per unit (Hugging Face datasets loaded with datasets: a local --out)")
    p.add_argument("--hub-mirror", default=None, metavar="DIR|URI",
                   help="named sources: read the dataset's Parquet files from this folder or object-store prefix "
                   "laid out as the hub (<mirror>/<dataset id>/<path>) instead of hf:// (default $ADLM_HUB_MIRROR; "
                   "an object-store --out reads the hub's Parquet files on the workers either way)")
    p.add_argument("--actors", type=int, default=None,
                   help="most tokenizer actors of the autoscaling pool (default: one a unit of work, at most 64)")
    p.add_argument("--min-actors", type=int, default=d.min_actors, help="tokenizer actors the pool starts with")
    p.add_argument("--actor-cpus", type=float, default=d.actor_cpus,
                   help="CPUs per actor (fractional: whole-CPU actors can starve Ray Data on small machines)")
    p.add_argument("--engine", choices=ENGINES, default=d.engine,
                   help="tokenizer engine: auto = tiktoken for GPT-2's BPE (same ids, several times faster), "
                   "tokenizers for the rest; the shards are identical either way")
    p.add_argument("--max-truncated", type=float, default=d.max_truncated,
                   help="pad mode: largest fraction of the first 2,000 documents allowed to be truncated")
    p.add_argument("--overwrite", action="store_true", help="discard existing shards of these splits and restart")
    p.add_argument("--ray-address", default=None, help="Ray address (default $RAY_ADDRESS or a new local Ray)")
    p.add_argument("--progress-interval", type=float, default=d.progress_interval, help="seconds between progress lines")
    p.add_argument("--testbed", action="append", default=None, metavar="KEY=VALUE",
                   help="--source testbed only: a field of the synthetic language (adlm_model.testbed.TestbedConfig: "
                   "seed, length, n_classes, ...; preset=natural: the language with natural text's confidence) or rows of "
                   "a split (train_rows, validation_rows, test_rows); repeatable")
    add_logging_flags(p)  # -q: no progress lines (the summary still prints)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose - args.quiet)
    args.quiet = args.quiet > 0
    del args.verbose
    if args.source is None:
        args.source = ["embedded"]
    from pipelines.data.prepare import prepare
    from pipelines.data.sources import SourceError
    from pipelines.data.tokenizer import TokenizerError

    try:
        prepare(args, shutdown_ray=True)
    except (PrepareError, SourceError, TokenizerError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
