"""What the tracking server costs under a sweep's logging, on PostgreSQL and on sqlite: throughput and latency of
metric batches from N = 1, 4 and 16 concurrent clients, run by hand (about 5 minutes).

Two servers of the recipe (``mlflow/server.sh``, basic authentication on, the users in the same database) run at once
on loopback: one on a throwaway PostgreSQL (tests/support/postgres.py), one on sqlite. ``--clients`` processes (one per
concurrent trial: a trial is a process of its own) each import MLflow once; then, for every N and repeat, N of them log
to one server for ``--seconds``, then to the other (the order alternates between repeats), each into a run of its own:
one ``log_batch`` of a training window's nine metrics after another, as fast as the server answers (MLflow's client,
its default retries). A cell counts the metrics the server took (checked against the store afterwards), every call's
latency, the calls that failed after their retries, and the CPU the server and its database used.

RESULT lines, for STORE in postgres, sqlite and N in 1, 4, 16 (medians over ``--repeats``):
``tracking_load_STORE_nN_metrics_per_s``, ``..._p50_ms``, ``..._p99_ms`` (a call's latency), ``..._failed_calls`` and
``..._server_cpu_ms_per_1k`` (server plus database CPU per 1,000 metrics: less sensitive to what else runs than the
rest); and ``tracking_load_postgres_over_sqlite_nN``: the throughput ratio, the median of each repeat's pair measured
back to back. On a machine that others share, read the ratios first; the record notes the load average.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, recording  # noqa: E402

KEYS = ("train/loss", "train/nll", "train/grad_norm", "train/lr", "train/tokens_per_s", "train/epoch",
        "train/anchor_loss", "train/anchor_frac", "train/gamma_k")
"""A training window's metrics (an ADLM run's ``log_window``): one ``log_batch`` of these per call."""


def client_loop(conn) -> None:
    """A client process: imports MLflow once, then runs each cell it is sent: ``(url, user, password, experiment,
    run name, start at, seconds)`` -> ``(metrics sent, latencies in s, failed calls, run id)``."""
    import mlflow
    from mlflow.entities import Metric

    while (job := conn.recv()) is not None:
        url, user, password, experiment, name, start_at, seconds = job
        os.environ.update(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password)
        c = mlflow.MlflowClient(url)
        exp = c.get_experiment_by_name(experiment)
        run_id = c.create_run(exp.experiment_id, run_name=name).info.run_id
        time.sleep(max(0.0, start_at - time.time()))
        sent, lat, failed, step = 0, [], 0, 0
        end = start_at + seconds
        while time.time() < end:
            step += 1
            ts = int(time.time() * 1000)
            t0 = time.perf_counter()
            try:
                c.log_batch(run_id, metrics=[Metric(k, float(step), ts, step) for k in KEYS])
                sent += len(KEYS)
            except Exception:  # noqa: BLE001 - counted: a call that failed after MLflow's retries
                failed += 1
            lat.append(time.perf_counter() - t0)
        conn.send((sent, lat, failed, run_id))


def _cpu_s(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
            fields = st[st.rfind(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a server's uvicorn workers; a postmaster's backends)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", default="1,4,16", help="concurrent clients, comma-separated (default 1,4,16)")
    p.add_argument("--seconds", type=float, default=8.0, help="how long each cell logs (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every (N, store) cell (default 3)")
    add_argument(p)
    args = p.parse_args()
    ns = sorted({int(n) for n in args.clients.split(",")})
    if not ns or ns[0] < 1 or args.seconds <= 0 or args.repeats < 1:
        raise SystemExit("error: --clients must be positive integers, --seconds above 0, --repeats 1 or more")
    from tests.support.postgres import missing

    if why := missing():
        raise SystemExit(f"error: {why}")
    with recording("tracking_load", args.record) as rec:
        measure(args, ns, rec)


def measure(args: argparse.Namespace, ns: list[int], rec) -> None:
    import secrets

    import psutil
    import requests

    from tests.support.postgres import RecipeServer, postgres

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    base = Path(tempfile.mkdtemp(prefix="adlm-bench-tracking-"))
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(max(ns)):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=client_loop, args=(there,), daemon=True)
        proc.start()
        pipes.append(here)
        procs.append(proc)
    servers: dict[str, tuple[RecipeServer, str, list[int]]] = {}
    with postgres() as pg:
        try:
            admin = secrets.token_hex(12)
            (base / "admin").write_text(admin)
            pw = secrets.token_hex(12)
            stores = {"postgres": (pg.create_database("bench", "bench", pw), pg.create_database("bench_auth", "bench", pw)),
                      "sqlite": (f"sqlite:///{base / 'sqlite' / 'mlflow.db'}", f"sqlite:///{base / 'sqlite' / 'auth.db'}")}
            for store, (uri, auth) in stores.items():
                (base / store).mkdir(exist_ok=True)
                srv = RecipeServer(base / store, {"MLFLOW_BACKEND_STORE_URI": uri, "MLFLOW_AUTH": "basic",
                                                  "MLFLOW_AUTH_ADMIN_PASSWORD_FILE": str(base / "admin"),
                                                  "MLFLOW_AUTH_DB_URI": auth,
                                                  "MLFLOW_ARTIFACTS_DESTINATION": str(base / store / "artifacts")})
                srv.start()
                r = requests.post(f"{srv.url}/api/2.0/mlflow/experiments/create", json={"name": "load"},
                                  auth=("admin", admin), timeout=60)
                r.raise_for_status()
                servers[store] = (srv, uri, [])
            postmaster = int((pg.data / "postmaster.pid").read_text().split()[0])
            cells: dict[tuple[str, int], list[dict]] = {}
            runs: dict[str, list[tuple[str, int]]] = {s: [] for s in servers}
            order = list(servers)
            table = ["| store | N | repeat | metrics/s | p50 ms | p99 ms | failed calls | server+db CPU-s per 1k metrics "
                     "| load (1 min) |", "|---|---|---|---|---|---|---|---|---|"]
            for n in ns:
                for rep in range(args.repeats):
                    for store in (order if rep % 2 == 0 else order[::-1]):
                        srv = servers[store][0]
                        watched = _tree(srv.proc.pid) + (_tree(postmaster) if store == "postgres" else [])
                        cpu0, load0 = _cpu_s(watched), os.getloadavg()[0]
                        start_at = time.time() + 2.0 + 0.2 * n
                        for i in range(n):
                            pipes[i].send((srv.url, "admin", admin, "load", f"n{n}-r{rep}-c{i}", start_at, args.seconds))
                        got = [pipes[i].recv() for i in range(n)]
                        watched = sorted(set(watched) | set(_tree(srv.proc.pid))
                                         | set(_tree(postmaster) if store == "postgres" else []))
                        cpu = _cpu_s(watched) - cpu0
                        sent = sum(g[0] for g in got)
                        lat = sorted(x for g in got for x in g[1])
                        runs[store] += [(g[3], g[0]) for g in got]
                        cells.setdefault((store, n), []).append({
                            "rate": sent / args.seconds, "p50": lat[len(lat) // 2] * 1000 if lat else float("nan"),
                            "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000 if lat else float("nan"),
                            "failed": sum(g[2] for g in got), "cpu_per_1k": cpu / max(sent, 1) * 1000,
                            "load": (load0 + os.getloadavg()[0]) / 2})
                        c = cells[(store, n)][-1]
                        line = (f"| {store} | {n} | {rep} | {c['rate']:.0f} | {c['p50']:.1f} | {c['p99']:.1f} | "
                                f"{c['failed']} | {c['cpu_per_1k']:.2f} | {c['load']:.1f} |")
                        table.append(line)
                        print(line, flush=True)
            # What the clients counted is what the stores hold.
            import mlflow

            os.environ.update(MLFLOW_TRACKING_USERNAME="admin", MLFLOW_TRACKING_PASSWORD=admin)
            for store, (srv, _, _) in servers.items():
                c = mlflow.MlflowClient(srv.url)
                for run_id, sent in runs[store]:
                    held = sum(len(c.get_metric_history(run_id, k)) for k in KEYS)
                    if held != sent:
                        raise SystemExit(f"{store}: run {run_id} holds {held} metrics, its client sent {sent}")
        finally:
            for pipe in pipes:
                pipe.send(None)
            for proc in procs:
                proc.join(timeout=30)
            for srv, _, _ in servers.values():
                srv.stop()
            shutil.rmtree(base, ignore_errors=True)
    loads = [c["load"] for cs in cells.values() for c in cs]
    rec.note(f"Load average (1 min) during the cells: median {statistics.median(loads):.1f}, range "
             f"{min(loads):.1f}-{max(loads):.1f}, on {psutil.cpu_count()} cores; every metric the clients counted was "
             "read back from its store. Every cell, in the order measured:")
    rec.note("\n".join(["", *table]))
    for (store, n), cs in sorted(cells.items()):
        for key, name in (("rate", "metrics_per_s"), ("p50", "p50_ms"), ("p99", "p99_ms"), ("failed", "failed_calls"),
                          ("cpu_per_1k", "server_cpu_ms_per_1k")):
            value = statistics.median(c[key] for c in cs) * (1000 if key == "cpu_per_1k" else 1)
            print(f"RESULT tracking_load_{store}_n{n}_{name}={value:.4g}")
    for n in ns:
        ratios = [a["rate"] / b["rate"] for a, b in zip(cells[("postgres", n)], cells[("sqlite", n)], strict=True)
                  if b["rate"] > 0]
        if ratios:
            print(f"RESULT tracking_load_postgres_over_sqlite_n{n}={statistics.median(ratios):.4g}")


if __name__ == "__main__":
    main()
