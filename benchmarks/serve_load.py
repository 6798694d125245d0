"""A bounded load test of the served model on loopback, run by hand or by the slow test.

Starts ``mlflow models serve`` (one worker) on an MLflow Model folder, warms it up (the weights load on the first
request), records the server's memory (RSS of its process tree), then sends ``--requests`` requests,
``--concurrency`` at a time: mostly valid small generations, and a share (``--bad-share``) of bad ones: over a
limit (``steps: 100000000``, a length beyond the context, too many rows, too much work) or with an unknown field
(``lenght``). It checks that every valid request is answered (200), every bad one refused (400) in under a
second, and that the server's memory after the load (after a few seconds' rest) is back where it started
(within ``--memory-slack`` MiB). Prints requests, errors, p50/p95 latencies and ``RESULT`` lines.

    python benchmarks/serve_load.py [--model MLFLOW_MODEL_DIR_OR_URI] [--requests 300] [--concurrency 4]

Without ``--model`` it builds a tiny untrained MDLM (context 32) on the test suite's 384-entry BPE and saves it
as the MLflow Model every registered version is (``pipelines.tracking.mlflow_model``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, recording
from _util import result


def tiny_model(root: Path) -> Path:
    """An MLflow Model folder of a tiny untrained MDLM (module docstring)."""
    import mlflow

    import adlm_model
    from adlm_model import build_model
    from pipelines.tracking.mlflow_model import CODE_FILE, REQUEST_FIELDS, signature, stage_checkpoint
    from tests.support.eval import make_data, save_ckpt, tiny_config

    data, tok, tok_path = make_data(root)
    cfg = tiny_config(tok, "mdlm")
    ck = save_ckpt(root / "ck", build_model(cfg), cfg, None, tok_path, data)
    staged = stage_checkpoint(ck, root / "staged")
    out = root / "model"
    mlflow.pyfunc.save_model(str(out), python_model=str(CODE_FILE), artifacts={"checkpoint": str(staged)},
                             code_paths=[str(Path(adlm_model.__file__).parent)], signature=signature(),
                             metadata={"request_fields": REQUEST_FIELDS})
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, payload: dict, timeout: float = 120) -> tuple[int, float, dict]:
    req = urllib.request.Request(f"{url}/invocations", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, time.perf_counter() - t0, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, time.perf_counter() - t0, json.loads(e.read() or b"{}")


def _rss_mib(pid: int) -> float:
    import psutil

    p = psutil.Process(pid)
    procs = [p, *p.children(recursive=True)]
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


VALID = {"default sampler": {}, "confidence": {"sampler": "confidence", "threshold": 0.5, "block": 4, "refresh": 2}}
"""The valid requests' sampler settings (each row: prompt "In the beginning", length 8, steps 8)."""


class LoadSetupError(RuntimeError):
    """The served model refuses the load's valid request: the load would measure nothing but refusals."""


def _valid_row(seed: int, variant: str) -> dict:
    return {"prompt": "In the beginning", "length": 8, "steps": 8, "seed": seed, **VALID[variant]}


def _check_valid(url: str) -> tuple[list[str], list[str]]:
    """The valid variants this model answers, and notes on those it cannot run (a sampler that does not fit its
    kind: the confidence sampler on an AR model); LoadSetupError when it refuses a valid request for another
    reason (over ``--max-work``: a model bigger than the tiny default)."""
    kept, notes = [], []
    for variant in VALID:
        status, _, body = _post(url, {"dataframe_records": [_valid_row(0, variant)]})
        reason = _reason(body.get("message", "")) if status != 200 else ""
        if status == 200:
            kept.append(variant)
        elif status == 400 and "does not run on" in reason:
            notes.append(f"left out the {variant} requests: {reason}")
        else:
            work = re.search(r"work ([0-9.e+]+) FLOPs", reason)
            hint = (f": raise --max-work (the server's ADLM_MAX_WORK) to at least {float(work.group(1)):.2g}"
                    if work else "")
            raise LoadSetupError(f"the model refuses the load's valid {variant} request (HTTP {status}: "
                                 f"{reason or body}){hint}")
    if not kept:
        raise LoadSetupError("the model runs none of the load's valid requests: " + "; ".join(notes))
    return kept, notes


def _requests(n: int, bad_share: float, seed: int, variants: list[str] | None = None) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    variants = variants or list(VALID)
    bad = [("over max_steps", {"prompt": "In the", "length": 8, "steps": 100_000_000}),
           ("over max_length", {"prompt": "In the", "length": 100_000}),
           ("over max_rows", None),
           ("over max_work", {"prompt": "In the", "length": 24, "steps": 4000}),
           ("unknown field", {"prompt": "In the", "lenght": 8}),
           ("bad threshold", {"prompt": "In the", "length": 8, "sampler": "confidence", "threshold": 2})]
    out = []
    for i in range(n):
        if rng.random() < bad_share:
            name, row = bad[i % len(bad)]
            rows = [{"prompt": "x", "length": 4}] * 1000 if row is None else [row]
            out.append((name, {"dataframe_records": rows}))
        else:
            out.append(("valid", {"dataframe_records": [_valid_row(i, rng.choice(variants))]}))
    return out


def _reason(message: str) -> str:
    """The model's one-line reason (a version registered before the served errors kept their own line has it
    prefixed with the request's data: "Failed to predict data '...'. Error: <reason>")."""
    return message.rsplit("Error: ", 1)[-1].strip()


def run_load(model: str, *, requests: int = 300, concurrency: int = 4, bad_share: float = 0.3,
             memory_slack: float = 64.0, seed: int = 0, env: dict | None = None,
             max_work: str = "1e9") -> dict:
    """Serve ``model``, send the load, return the figures (module docstring)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **(env or {}), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "NO_PROXY": "127.0.0.1,localhost", "ADLM_MAX_WORK": max_work}
    log = tempfile.NamedTemporaryFile("wb", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", model, "--env-manager", "local",
                             "-h", "127.0.0.1", "-p", str(port), "--workers", "1"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow models serve did not come up; log: {log.name}") from None
                time.sleep(0.5)
        # Warm-up (the weights load on the first request), which also checks that the model answers the load's
        # valid requests: otherwise every one would count as an error.
        variants, notes = _check_valid(url)
        _post(url, {"dataframe_records": [_valid_row(1, variants[0])]})
        time.sleep(1.0)
        mem_before = _rss_mib(proc.pid)
        load = _requests(requests, bad_share, seed, variants)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(lambda item: (item[0], *_post(url, item[1])), load))
        wall = time.perf_counter() - t0
        time.sleep(3.0)
        mem_after = _rss_mib(proc.pid)
        up = proc.poll() is None
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
    valid = [a for a in answers if a[0] == "valid"]
    bad = [a for a in answers if a[0] != "valid"]
    valid_ok = sum(1 for a in valid if a[1] == 200)
    bad_refused = sum(1 for a in bad if a[1] == 400 and a[2] < 1.0)

    def pct(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))

    return {"requests": len(answers), "valid": len(valid), "valid_answered": valid_ok, "bad": len(bad),
            "bad_refused_under_1s": bad_refused, "bad_refused": sum(1 for a in bad if a[1] == 400),
            "errors": len(answers) - valid_ok - bad_refused,
            "p50_valid_s": pct([a[2] for a in valid], 50), "p95_valid_s": pct([a[2] for a in valid], 95),
            "p50_bad_s": pct([a[2] for a in bad], 50), "p95_bad_s": pct([a[2] for a in bad], 95),
            "max_bad_s": max((a[2] for a in bad), default=float("nan")), "wall_s": wall,
            "memory_before_mib": mem_before, "memory_after_mib": mem_after,
            "memory_back": mem_after <= mem_before + memory_slack, "server_up": up,
            "bad_kinds": sorted({a[0] for a in bad}), "notes": notes,
            "refusals": sorted({(a[0], _reason(a[3].get("message", ""))[:90]) for a in bad if a[1] == 400})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="The valid requests are length 8, T = 8, half with the confidence sampler (left "
                                       "out, with a note, for a model whose kind does not run it: AR). --max-work "
                                       "defaults to 1e9 FLOPs, sized for the tiny built-in model: a real model's "
                                       "valid requests cost more (2 x parameters x row length x network calls), so "
                                       "with --model raise it (the check before the load says to what) or every "
                                       "request is refused.")
    p.add_argument("--model", help="an MLflow Model folder or models:/ URI (default: a tiny untrained MDLM); "
                                   "needs --max-work raised for any model bigger than that (see below)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--bad-share", type=float, default=0.3, help="share of bad requests (default 0.3)")
    p.add_argument("--memory-slack", type=float, default=64.0, help="MiB the server may keep after the load")
    p.add_argument("--max-work", default="1e9", help="ADLM_MAX_WORK of the served model (FLOPs a request)")
    add_argument(p)
    args = p.parse_args(argv)
    with recording("serve_load", args.record):
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model(Path(tmp)))
        try:
            r = run_load(model, requests=args.requests, concurrency=args.concurrency, bad_share=args.bad_share,
                         memory_slack=args.memory_slack, max_work=args.max_work)
        except LoadSetupError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for note in r["notes"]:
        print(note)
    for kind, msg in r["refusals"]:
        print(f"refused ({kind}): {msg}")
    print(f"requests {r['requests']} ({r['valid']} valid, {r['bad']} bad: {', '.join(r['bad_kinds'])}), "
          f"concurrency {args.concurrency}, {r['wall_s']:.1f} s")
    print(f"valid answered {r['valid_answered']}/{r['valid']}, bad refused in < 1 s {r['bad_refused_under_1s']}/"
          f"{r['bad']}, errors {r['errors']}")
    print(f"latency valid p50 {r['p50_valid_s'] * 1000:.0f} ms p95 {r['p95_valid_s'] * 1000:.0f} ms; bad p50 "
          f"{r['p50_bad_s'] * 1000:.0f} ms p95 {r['p95_bad_s'] * 1000:.0f} ms max {r['max_bad_s'] * 1000:.0f} ms")
    print(f"server memory {r['memory_before_mib']:.0f} MiB before, {r['memory_after_mib']:.0f} MiB after")
    for k in ("requests", "errors", "p50_valid_s", "p95_valid_s", "p95_bad_s", "memory_before_mib",
              "memory_after_mib"):
        result(f"serve_load_{k}", r[k])
    ok = r["errors"] == 0 and r["memory_back"] and r["server_up"]
    result("serve_load_ok", float(ok))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
