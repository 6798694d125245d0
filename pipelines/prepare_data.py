"""Tokenize and pack a corpus into Parquet shards with Ray Data (docs/design/method.md, section 5).

    python -m pipelines.prepare_data --source embedded --out work/data/embedded
    python -m pipelines.prepare_data --source openwebtext --out s3://bucket/owt       # online
    python -m pipelines.prepare_data --source train=corpus/*.jsonl --source validation=val.jsonl \\
        --tokenizer gpt2 --length 1024 --out work/data/mine

What it does and why the output is deterministic and resumable: ``pipelines/data/prepare.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any

from pipelines.core.cli import run_command
from pipelines.core.configlib import descriptions
from pipelines.core.logs import add_logging_flags
from pipelines.data.detokenizers import DETOKENIZERS
from pipelines.data.encoder import ENGINES
from pipelines.data.plan import PrepareConfig, PrepareError
from pipelines.data.prepare import prepare
from pipelines.data.sources import KNOWN_SOURCES, SourceError
from pipelines.data.tokenizer import TokenizerError

FLAG_EXTRAS: dict[str, dict[str, Any]] = {
    "source": {"metavar": "NAME|PATH|SPLIT=PATH"},
    "train_tokenizer": {"metavar": "VOCAB_SIZE"},
    "mode": {"choices": ("wrap", "pad")},
    "text_unit": {"choices": ("line", "file")},
    "detokenizer": {"choices": ["none", *sorted(DETOKENIZERS)]},
    "engine": {"choices": ENGINES},
    "hub_mirror": {"metavar": "DIR|URI"},
    "testbed": {"metavar": "KEY=VALUE"},
    "reasoning": {"metavar": "KEY=VALUE"},
}
"""What a flag needs beyond its field's name, type, default and docstring (``PrepareConfig``, the one place each
option is documented): the choices and placeholders of the help."""


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One ``--flag`` a field of ``PrepareConfig`` (``text_field``: ``--text-field``), typed by its annotation, with
    its default and its docstring as the help. Lists, ``testbed`` and ``reasoning`` repeat (``--source a --source b``); a
    ``bool | None`` is ``--x/--no-x``."""
    docs = descriptions(PrepareConfig)
    hints = typing.get_type_hints(PrepareConfig)
    for f in dataclasses.fields(PrepareConfig):
        ann, flag = hints[f.name], "--" + f.name.replace("_", "-")
        args = set(typing.get_args(ann))
        doc = docs[f.name].replace("``", "")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if default not in (None, False) and "default" not in doc:
            doc += f" (default: {','.join(default) if isinstance(default, list) else default})"
        kw: dict[str, Any] = {"help": doc.replace("%", "%%"), **FLAG_EXTRAS.get(f.name, {})}
        if ann is bool:
            kw.update(action="store_true")
        elif args == {bool, type(None)}:
            kw.update(action=argparse.BooleanOptionalAction, default=None)
        elif ann is Any or typing.get_origin(ann) is list or any(typing.get_origin(a) is list for a in args):
            kw.update(action="append", default=None)  # None: the field's own default (a list is not extended)
        else:
            kw.update(type=next(a for a in (int, float, str) if a is ann or a in args), default=f.default)
        p.add_argument(flag, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.prepare_data",
        description="Tokenize and pack a corpus into Parquet shards + manifest.json with Ray Data "
                    "(deterministic, resumable). Named sources: " + ", ".join(KNOWN_SOURCES) + ".")
    add_config_flags(p)
    add_logging_flags(p)  # -q: no progress lines (the result still prints)
    return p


def config_of(args: argparse.Namespace) -> PrepareConfig:
    """The typed config of the parsed flags (a flag not given: the field's default)."""
    return PrepareConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PrepareConfig)
                            if getattr(args, f.name) is not None})


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), _run, argv, bad_input=(PrepareError, SourceError, TokenizerError),
                       label="prepare_data: error")


def _run(args: argparse.Namespace) -> int:
    for split, m in prepare(config_of(args), shutdown_ray=True).items():  # the result; progress went to the log
        print(f"{split}: {m.rows:,} rows x {m.length} tokens in {len(m.shards)} shards ({m.tokens:,} tokens)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
