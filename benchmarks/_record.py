"""Dated benchmark records: ``--record`` makes a benchmark write what it measured as a Markdown file.

Every benchmark takes ``--record [DIR]`` (``add_argument``) and runs its body inside ``recording(...)``: the RESULT
lines it prints are collected as they go to stdout, and at the end a record is written to
``DIR/<date>_<machine>_<topic>.md`` (``benchmarks/results/`` by default) with the date, the commit, the machine and
its load, the Python/torch/CUDA versions, the exact command, the RESULT lines and links to the raw files the run
wrote. A record is never typed by hand; documentation links the latest one (``latest``).

Standard library only (torch is read if it is already imported): the GPU machine runs this without the project's
other dependencies.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULT_LINE = re.compile(r"^RESULT \S+=\S+")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--record", nargs="?", const=str(RESULTS_DIR), default=None, metavar="DIR",
        help=f"write a dated record of this run (command, commit, machine, RESULT lines) under DIR "
             f"(default {RESULTS_DIR.relative_to(ROOT)})")


def _git(*args: str) -> str:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it; ``unknown`` outside a git checkout."""
    head = _git("rev-parse", "--short=12", "HEAD")
    if not head:
        return "unknown"
    return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def _torch_info() -> tuple[str | None, str | None, str | None]:
    """(torch version, CUDA version, GPU name), read only when torch is already imported by the benchmark."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, None, None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return torch.__version__, torch.version.cuda, gpu


def machine_slug() -> str:
    """A short name for the kind of machine: the GPU's model (``h200``), else ``cpu<cores>``."""
    _, _, gpu = _torch_info()
    if gpu:
        m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?|RTX ?\d{4}|\w+\d{3})\b", gpu.upper())
        return re.sub(r"[^a-z0-9]+", "", (m.group(1) if m else gpu).lower()) or "gpu"
    return f"cpu{os.cpu_count() or 0}"


def _free_path(directory: Path, stem: str) -> Path:
    path = directory / f"{stem}.md"
    n = 2
    while path.exists():
        path = directory / f"{stem}-{n}.md"
        n += 1
    return path


class _Tee(io.TextIOBase):
    """Writes through to the real stream and keeps the RESULT lines that pass."""

    def __init__(self, stream: io.TextIOBase, lines: list[str]) -> None:
        self._stream, self._lines, self._buf = stream, lines, ""

    def write(self, s: str) -> int:
        self._stream.write(s)
        self._buf += s
        *done, self._buf = self._buf.split("\n")
        self._lines.extend(line.strip() for line in done if RESULT_LINE.match(line.strip()))
        return len(s)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()


@dataclass
class Recording:
    """What a ``recording`` block collects; benchmarks add the raw files they wrote and free-form notes."""

    topic: str
    raw: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    path: Path | None = None

    def add_raw(self, path: str | os.PathLike[str]) -> None:
        self.raw.append(Path(path))

    def note(self, text: str) -> None:
        self.notes.append(text)


def render(rec: Recording, *, command: Sequence[str], started: dt.datetime, wall_s: float,
           load_before: tuple[float, ...], load_after: tuple[float, ...], status: str, directory: Path) -> str:
    torch_v, cuda_v, gpu = _torch_info()
    mem = _memory_gib()
    machine = f"{os.cpu_count()} x {_cpu_model()}" + (f", {mem:.0f} GiB" if mem else "")
    lines = [
        f"# {rec.topic}: {started:%Y-%m-%d}, {machine_slug()}",
        "",
        "Written by the benchmark itself (`--record`); not edited by hand.",
        "",
        "| | |",
        "|---|---|",
        f"| date (UTC) | {started:%Y-%m-%d %H:%M:%S} |",
        f"| commit | `{commit()}` |",
        f"| machine | {machine}{f'; GPU {gpu}' if gpu else ''} |",
        f"| load (1/5/15 min) | before {', '.join(f'{x:.2f}' for x in load_before)}; "
        f"after {', '.join(f'{x:.2f}' for x in load_after)} |",
        f"| software | Python {platform.python_version()}"
        + (f", torch {torch_v}" if torch_v else "") + (f", CUDA {cuda_v}" if cuda_v else "") + " |",
        f"| wall time | {wall_s:.1f} s |",
        f"| status | {status} |",
        "",
        "## Command",
        "",
        "```",
        shlex.join(command),
        "```",
        "",
        "## Results",
        "",
        "```",
        *(rec.results or ["(no RESULT line was printed)"]),
        "```",
    ]
    if rec.raw:
        lines += ["", "## Raw files", ""]
        for p in rec.raw:
            target = Path(os.path.relpath(Path(p).resolve(), directory.resolve()))
            lines.append(f"- [{Path(p).name}]({target.as_posix()})")
    if rec.notes:
        lines += ["", "## Notes", "", *rec.notes]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def recording(topic: str, directory: str | os.PathLike[str] | None, *,
              command: Sequence[str] | None = None) -> Iterator[Recording]:
    """Collect the RESULT lines printed inside the block; write the record at its end when ``directory`` is set.

    A run that raises still gets its record (status ``failed: <error>``), so a miss is kept as well as a hit.
    """
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", topic):
        raise ValueError(f"record topic {topic!r}: lower-case letters, digits, '_' and '-' only")
    rec = Recording(topic=topic)
    if directory is None:
        yield rec
        return
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    load_before, t0 = os.getloadavg(), time.perf_counter()
    real = sys.stdout
    sys.stdout = _Tee(real, rec.results)
    status = "completed"
    try:
        yield rec
    except BaseException as e:
        status = f"failed: {type(e).__name__}: {e}"[:300]
        raise
    finally:
        sys.stdout.flush()
        sys.stdout = real
        cmd = list(command) if command is not None else ["python", *sys.argv]
        rec.path = _free_path(out_dir, f"{started:%Y-%m-%d}_{machine_slug()}_{topic}")
        rec.path.write_text(render(rec, command=cmd, started=started, wall_s=time.perf_counter() - t0,
                                   load_before=load_before, load_after=os.getloadavg(), status=status,
                                   directory=out_dir))
        print(f"record written: {rec.path}", flush=True)


def latest(topic: str, directory: str | os.PathLike[str] = RESULTS_DIR) -> Path | None:
    """The newest record of ``topic`` (by its file name's date, then its counter)."""
    name = re.compile(rf"^(\d{{4}}-\d{{2}}-\d{{2}})_[a-z0-9]+_{re.escape(topic)}(?:-(\d+))?\.md$")
    found = [(m.group(1), int(m.group(2) or 1), p) for p in Path(directory).glob("*.md")
             if (m := name.match(p.name))]
    return max(found)[2] if found else None
