"""Where a command's CPU goes, process by process: runs COMMAND, reads every process's CPU time from /proc every
``--interval`` seconds while it runs, and prints the CPU-seconds by kind of process (Ray actors by class, Ray's node
processes, MLflow servers, the pytest workers, ...). Made for the test suite's time: the suite is CPU-bound on two
cores, and what costs is processes starting more than work.

    python benchmarks/suite_cpu.py -- .venv/bin/python -m pytest -q -n 2 --dist loadfile tests
    python benchmarks/suite_cpu.py --top 20 -- .venv/bin/python -m pytest -q tests/e2e/test_cluster.py -k autoscaler

Processes shorter than an interval are missed, and a process's CPU is counted up to its last sample: a lower
bound. The machine's own CPU (every process, from /proc/stat) is the reference the ratio is taken against.

This host's speed moves by half between runs of the same code (727 s and 1,100 s the same day are in
``benchmarks/results/suite_timings.csv``), so each run also times a fixed reference, measured around the command in
the same run: the CPU it takes to import the pipeline's heavy packages (``--proxy``, median of ``--proxy-runs``
before and as many after). ``wall_per_proxy_cpu_s`` then compares runs on hosts of different speed, in part only
(145-182 across the recorded runs); ``wall_over_limit`` is the wall time against the suite's goal (``--limit-s``,
10 minutes).

``--record`` writes the dated record of the run (``_record``) and appends one row to ``suite_timings.csv`` in the
same folder (``TIMINGS_COLUMNS``): the suite's timings as one table, one row a run, with pytest's counts of passed,
failed, skipped and errored tests read from the command's output.
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime as dt
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, commit, machine_slug, recording

PROXY = "import ray, torch, mlflow, pandas, matplotlib"
"""The host reference: the pipeline's heavy imports, what most of the suite's processes spend their CPU on."""

KINDS = ("gcs_server", "raylet", "dashboard/dashboard.py", "dashboard/agent.py", "runtime_env/agent", "log_monitor",
         "autoscaler/_private/monitor.py", "mlflow models serve", "mlflow server", "pipelines.", "xdist", "pytest")


def _read(pid: str) -> tuple[float, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
        fields = st[st.rfind(")") + 2:].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), cmd or st[st.find("(") + 1:st.rfind(")")]
    except (OSError, IndexError, ValueError):
        return None


def kind(cmd: str) -> str:
    """Ray workers by the title they last had (``ray::TrainController``); other processes by what they run."""
    if cmd.startswith("ray::"):
        return cmd.split()[0].split(".")[0][:48]
    if "default_worker.py" in cmd:
        return "ray worker (untitled)"
    return next((k for k in KINDS if k in cmd), cmd.split()[0].rsplit("/", 1)[-1][:32] if cmd else "?")


def machine_cpu() -> float:
    with open("/proc/stat") as f:
        user, nice, system = (int(x) for x in f.readline().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def proxy_cpu_s(code: str, runs: int) -> float:
    """Median user + system CPU-seconds of ``runs`` fresh interpreters (this one) running ``code``, bytecode cached
    as the suite runs (``make test`` empties PYTHONDONTWRITEBYTECODE)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}
    used = []
    for _ in range(runs):
        before = os.times()
        r = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
        if r.returncode:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise ValueError(f"the host reference (--proxy) failed: {last}; fix it or pass --proxy-runs 0")
        after = os.times()
        used.append(after.children_user + after.children_system - before.children_user - before.children_system)
    return statistics.median(used)


TIMINGS_FILE = "suite_timings.csv"
TIMINGS_COLUMNS = ("date", "commit", "machine", "wall_s", "cpu_s", "proxy_cpu_s_before", "proxy_cpu_s_after",
                   "wall_per_proxy_cpu_s", "wall_over_limit", "passed", "failed", "skipped", "errors", "exit_code",
                   "command", "source", "note")
"""One row a run: ``cpu_s`` is the machine's CPU-seconds during the command; the counts are pytest's (empty when its
summary line was not seen); ``source`` is ``suite_cpu.py`` for a measured row (``README table`` for the runs noted
by hand before the table existed, whose ``note`` keeps what was written then)."""
PYTEST_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")


def pytest_counts(output: str) -> dict[str, int]:
    """pytest's counts from its last summary line (``599 passed, 1 failed, 13 skipped in 951.20s``); {} if none."""
    for line in reversed(output.splitlines()):
        if re.search(r"\bin [\d.]+s\b", line) and (found := PYTEST_SUMMARY.findall(line)):
            counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
            for n, what in found:
                key = "errors" if what.startswith("error") else what
                if key in counts:
                    counts[key] += int(n)
            return counts
    return {}


def append_timings(path: Path, row: dict[str, object]) -> None:
    """Append ``row`` to the timings CSV at ``path`` (its header first when the file is new)."""
    new = not path.exists()
    with open(path, "a", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=TIMINGS_COLUMNS)
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in TIMINGS_COLUMNS})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples (default 0.5)")
    p.add_argument("--top", type=int, default=30, help="kinds of process printed (default 30)")
    p.add_argument("--proxy", default=PROXY, help=f"the host reference's Python code (default: {PROXY!r})")
    p.add_argument("--proxy-runs", type=int, default=3,
                   help="runs of the reference before the command and as many after (default 3; 0: none)")
    p.add_argument("--limit-s", type=float, default=600.0, help="the goal the wall time is read against (default 600)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    add_argument(p)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("error: no command given: put it after --, e.g. -- python -m pytest -q tests", file=sys.stderr)
        return 2
    if args.proxy_runs < 0 or args.limit_s <= 0:
        print("error: --proxy-runs must be 0 or more and --limit-s above 0", file=sys.stderr)
        return 2
    try:
        proxy = [proxy_cpu_s(args.proxy, args.proxy_runs)] if args.proxy_runs else []
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = sys.stdout  # the command's own output goes here, not through the record's collection of RESULT lines
    with recording("suite_cpu", args.record) as rec:
        row = measure(args, command, proxy, out)
        if args.record is not None:
            rec.add_raw(Path(args.record) / TIMINGS_FILE)
    if args.record is not None:
        append_timings(Path(args.record) / TIMINGS_FILE, row)
    return int(row["exit_code"])


def measure(args: argparse.Namespace, command: list[str], proxy: list[float], out) -> dict[str, object]:
    """Run ``command`` while sampling every process's CPU, print the table and the RESULT lines; returns the run's
    row of the timings CSV. The command's output passes through to ``out`` (and is read for pytest's counts)."""
    started = dt.datetime.now(dt.UTC)
    before = {pid: r for pid in os.listdir("/proc") if pid.isdigit() and (r := _read(pid))}
    seen: dict[str, list] = {}  # pid -> [cpu now, title]
    m0, t0 = machine_cpu(), time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            bufsize=1)
    tail: collections.deque[str] = collections.deque(maxlen=200)

    def relay() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            tail.append(line)
            out.write(line)
            out.flush()

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    while proc.poll() is None:
        for pid in os.listdir("/proc"):
            if pid.isdigit() and (r := _read(pid)):
                seen[pid] = [max(r[0], seen.get(pid, [0.0])[0]), r[1]]
        time.sleep(args.interval)
    reader.join(timeout=10)
    wall, machine = time.time() - t0, machine_cpu() - m0
    if proxy:
        proxy.append(proxy_cpu_s(args.proxy, args.proxy_runs))
    by_kind: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for pid, (cpu, cmd) in seen.items():
        used = cpu - (before[pid][0] if pid in before else 0.0)
        if used > 0:
            k = kind(cmd)
            by_kind[k] += used
            count[k] += 1
    counted = sum(by_kind.values())
    print(f"\n{command[0]} ... exited {proc.returncode} after {wall:.1f} s; the machine used {machine:.1f} CPU-seconds, "
          f"{counted:.1f} of them counted in {len(seen)} processes")
    print(f"{'CPU-s':>8} {'procs':>6}  kind")
    for k, v in by_kind.most_common(args.top):
        print(f"{v:8.1f} {count[k]:6d}  {k}")
    print(f"RESULT wall_s={wall:.1f}")
    print(f"RESULT machine_cpu_s={machine:.1f}")
    print(f"RESULT counted_share={counted / max(machine, 1e-9):.3f}")
    print(f"RESULT cores_busy={machine / max(wall, 1e-9):.2f}")
    print(f"RESULT wall_over_limit={wall / args.limit_s:.3f}")
    row: dict[str, object] = {
        "date": f"{started:%Y-%m-%d %H:%M}", "commit": commit(), "machine": machine_slug(), "wall_s": f"{wall:.1f}",
        "cpu_s": f"{machine:.1f}", "wall_over_limit": f"{wall / args.limit_s:.3f}", "exit_code": proc.returncode,
        "command": shlex.join(command), "source": "suite_cpu.py", **pytest_counts("".join(tail))}
    if proxy:
        print(f"RESULT proxy_cpu_s_before={proxy[0]:.2f}")
        print(f"RESULT proxy_cpu_s_after={proxy[1]:.2f}")
        print(f"RESULT wall_per_proxy_cpu_s={wall / max(statistics.mean(proxy), 1e-9):.1f}")
        row.update(proxy_cpu_s_before=f"{proxy[0]:.2f}", proxy_cpu_s_after=f"{proxy[1]:.2f}",
                   wall_per_proxy_cpu_s=f"{wall / max(statistics.mean(proxy), 1e-9):.1f}")
    return row


if __name__ == "__main__":
    sys.exit(main())
