"""The fast tests on the newest versions pyproject.toml allows, without the lock: drift found before a user finds it.

    python benchmarks/newest_versions.py --record        # what `make test-newest` runs
    python benchmarks/newest_versions.py --venv DIR --keep -- -k registry   # another folder, kept; pytest's arguments
    python benchmarks/newest_versions.py --with 'mlflow[auth]==3.17.2' --record   # an older release in a range

Builds a throwaway venv (``work/newest-venv`` by default, removed afterwards unless ``--keep``) the way
``make install`` does but without ``-c requirements.lock``: pip then takes the newest release inside each range.
Runs the tests that are not marked slow there, on two workers, and prints what resolved differently from the lock
and pytest's counts. ``--record`` writes the dated record (``_record``) with the versions beside the lock's and
the failures, and keeps the venv's full ``pip freeze`` as a raw file beside it.

RESULT lines: ``differs_from_lock`` (packages at another version than the lock's), ``passed``, ``failed``,
``errors``, ``skipped``, and ``mlflow``/``ray``/``torch``/``transformers`` (the versions that resolved).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from _record import RESULTS_DIR, add_argument, machine_slug, recording
from _util import result
from lock import NO_DEPS, read_lock
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
WATCHED = ("mlflow", "ray", "torch", "transformers", "datasets", "pyarrow", "lm-eval")
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped)")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, cwd=ROOT, **kw)


def build(venv: Path, pins: list[str]) -> Path:
    """A fresh venv with the newest versions pyproject.toml allows (the steps of ``make install``, no lock), but for
    ``pins`` (requirements such as ``mlflow[auth]==3.17.2``: an older release still inside a range)."""
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q"]
    _run([*pip, "--upgrade", "pip"])
    _run([*pip, "torch==2.13.0"])
    _run([*pip, "-e", ".[dev]", *pins])
    _run([*pip, "--no-deps", *NO_DEPS])
    return py


def freeze(py: Path) -> dict[str, str]:
    out = subprocess.run([str(py), "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout
    pins = {}
    for line in out.splitlines():
        name, sep, version = line.partition("==")
        if sep:
            pins[canonicalize_name(name)] = version.split("+")[0]
    return pins


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=str(ROOT / "work" / "newest-venv"), help="the throwaway venv's folder")
    ap.add_argument("--keep", action="store_true", help="keep the venv afterwards")
    ap.add_argument("--with", dest="pins", action="append", default=[], metavar="REQ",
                    help="also require REQ (e.g. 'mlflow[auth]==3.17.2': the oldest release a range allows)")
    ap.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the not-slow tests)")
    add_argument(ap)
    args = ap.parse_args(argv)
    venv = Path(args.venv)
    with recording("newest-versions", args.record) as rec:
        py = build(venv, args.pins)
        if args.pins:
            rec.note("Required beside pyproject.toml: " + ", ".join(f"`{p}`" for p in args.pins))
        newest, locked = freeze(py), read_lock()
        differ = sorted((n, locked.get(n, "-"), v) for n, v in newest.items() if locked.get(n) != v)
        table = ["| package | lock | newest |", "|---|---|---|", *(f"| {n} | {a} | {b} |" for n, a, b in differ)]
        print("\n".join(table))
        env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "ADLM_NEWEST_VERSIONS": "1",
               "PYTHONDONTWRITEBYTECODE": ""}
        tests = args.pytest_args or ["-m", "not slow", "tests/model", "tests/pipelines", "tests/repo"]
        r = subprocess.run([str(py), "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
                            *tests], cwd=ROOT, env=env, capture_output=True, text=True)
        out = r.stdout + r.stderr
        print(out[-4000:])
        failures = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in COUNTS.findall(out.splitlines()[-1]
                                                                                             if out.strip() else "")}
        result("differs_from_lock", len(differ))
        for k in ("passed", "failed", "error", "skipped"):
            result("errors" if k == "error" else k, counts.get(k, 0))
        for name in WATCHED:
            print(f"RESULT {name.replace('-', '_')}={newest.get(name, 'absent')}", flush=True)
        rec.note("Versions that resolved differently from `requirements.lock` (`-`: not in the lock):\n\n"
                 + "\n".join(table))
        rec.note("Failures:\n\n" + ("\n".join(f"- `{f}`" for f in failures) if failures else "none"))
        rec.note(f"pytest exit code {r.returncode}; its last line: `{out.strip().splitlines()[-1] if out.strip() else ''}`")
        if args.record:
            pinned = "".join(f"-{re.sub(r'[^a-z0-9.]+', '-', p.lower()).strip('-')}" for p in args.pins)
            stem = Path(args.record) / f"{dt.date.today()}_{machine_slug()}_{rec.topic}{pinned}"
            frozen, log = stem.with_name(stem.name + "-freeze.txt"), stem.with_name(stem.name + "-pytest.txt")
            frozen.write_text("".join(f"{n}=={v}\n" for n, v in sorted(newest.items())))
            log.write_text("\n".join(out.splitlines()[-300:]) + "\n")  # the failures' summary and the counts
            rec.add_raw(frozen)
            rec.add_raw(log)
    if not args.keep:
        shutil.rmtree(venv, ignore_errors=True)
    return 0 if r.returncode == 0 else 1


if __name__ == "__main__":
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    sys.exit(main())
