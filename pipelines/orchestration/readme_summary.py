"""The demo's summary in README.md, written from a run, never typed: replaces what lies between
``<!-- demo-summary:begin -->`` and ``<!-- demo-summary:end -->`` with the summary exactly as ``make demo`` prints
it (the table as Markdown, the lines after it in a text block; the checkout's own path left out, so that
``sqlite:////home/.../work/mlflow.db`` reads ``sqlite:///work/mlflow.db``, which works from any checkout's root),
under a line saying when and where it ran.

    python -m pipelines.orchestration.readme_summary              # from the last run's work/summary.md
    python -m pipelines.orchestration.readme_summary --run        # run `make demo`'s command first
    python -m pipelines.orchestration.readme_summary --workdir DIR --readme PATH

The demo writes the same text to ``<workdir>/summary.md`` that it prints under its ``summary`` banner.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

from pipelines.runtime import PROJECT_ROOT

BEGIN = "<!-- demo-summary:begin -->"
END = "<!-- demo-summary:end -->"
DEMO_COMMAND = [sys.executable, "-m", "pipelines.run_all"]
"""What ``make demo`` runs (the Makefile's ``demo`` target), with ``--workdir`` added when one is given."""


class SummaryError(ValueError):
    """No summary to write, or no place for it in the README."""


def _git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def _machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{os.cpu_count()} CPU cores" + (f" ({model})" if model else "")


def block(summary_md: str, provenance: str) -> str:
    """The README's block for ``summary_md`` (the demo's printed summary): its table, then its other lines in a text
    block, one a line as printed."""
    lines = summary_md.replace(f"{PROJECT_ROOT}/", "").rstrip("\n").splitlines()
    end = next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))
    table, rest = lines[:end], [line for line in lines[end:] if line.strip()]
    if not table:
        raise SummaryError("the summary has no table: is it a `make demo` summary.md?")
    out = [BEGIN, f"<!-- written by `python -m pipelines.orchestration.readme_summary`; {provenance} -->", "",
           *table, ""]
    if rest:
        out += ["```text", *rest, "```", ""]
    return "\n".join([*out, END])


def replace_block(readme: str, new_block: str) -> str:
    """``readme`` with its one demo-summary block replaced by ``new_block``."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise SummaryError(f"the README needs exactly one {BEGIN} ... {END} block")
    head, rest = readme.split(BEGIN, 1)
    return head + new_block + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.orchestration.readme_summary",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=None, help="the demo's work directory (default: $ADLM_WORKDIR or ./work)")
    p.add_argument("--readme", default=str(PROJECT_ROOT / "README.md"), help="the README to update")
    p.add_argument("--run", action="store_true", help="run the demo first (`make demo`'s command)")
    args = p.parse_args(argv)
    from pipelines.storage import exists, join, read_text, resolve_workdir

    readme = Path(args.readme)
    try:
        text = readme.read_text(encoding="utf-8")
        replace_block(text, "")  # the markers are there before anything runs
        wd = resolve_workdir(args.workdir)
        if args.run:
            cmd = [*DEMO_COMMAND, *(["--workdir", args.workdir] if args.workdir else [])]
            if subprocess.run(cmd, cwd=PROJECT_ROOT).returncode != 0:
                raise SummaryError("the demo failed (its error is above): the README is left as it was")
        if not exists(join(wd, "summary.md")):
            raise SummaryError(f"no {join(wd, 'summary.md')}: run `make demo` first, or pass --run")
        md = read_text(join(wd, "summary.md"))
        when = dt.datetime.fromtimestamp(Path(join(wd, "summary.md")).stat().st_mtime, dt.UTC) \
            if not str(wd).startswith(("s3://", "gs://")) else dt.datetime.now(dt.UTC)
        commit = _git("rev-parse", "--short=12", "HEAD") if args.run else ""
        dirty = "+dirty" if args.run and _git("status", "--porcelain", "--untracked-files=no") else ""
        provenance = (f"`make demo` of {when:%Y-%m-%d %H:%M} UTC" + (f" at commit {commit}{dirty}" if commit else "")
                      + f" on {_machine()}")
        readme.write_text(replace_block(text, block(md, provenance)), encoding="utf-8")
    except (OSError, SummaryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{readme}: the demo summary block rewritten ({provenance})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
