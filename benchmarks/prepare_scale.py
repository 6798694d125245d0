"""Benchmark of pipelines.prepare_data as the corpus grows: the driver's peak memory and the wall time
for a corpus and for four times that corpus, from local files and from a local stand-in for a hub dataset in
Parquet files (read through the hub path: ``data.hub`` with a mirror), and the throughput with 1 and 2
tokenizer actors.

Corpus: the bundled embedded text, one document a line, repeated to ``--size-mb`` (and 4x that); GPT-2
tokenizer, ``wrap`` rows of ``--length``. The stand-in holds the same lines as Parquet files of
``--file-mb`` each (row groups of 2,000 rows), so the 4x corpus has four times as many files, as a larger hub
dataset has. Each measurement is its own driver process: it starts a local Ray (2 CPUs) first, then times
``prepare()`` alone (actor start-up included, Ray start-up not) and reports its own peak RSS
(``ru_maxrss``: the whole process, Ray's client and the imports included, as the head node would see it) and,
sampled every 20 ms, its RSS before ``prepare()`` and at most during it.

Prints ``RESULT prep_driver_memory_growth_4x=<peak at 4x / peak at 1x>`` (goal <= 1.2; the larger of the two
inputs' ratios), ``RESULT prep_time_growth_4x=<time at 4x / time at 1x>`` (goal <= 4.4; the larger of the
two), and for information the throughput with 1 and 2 actors and their ratio.

    python benchmarks/prepare_scale.py                  # 25 MB and 100 MB
    python benchmarks/prepare_scale.py --size-mb 8      # 8 MB and 32 MB: a quicker try
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _record import add_argument, recording  # noqa: E402

DRIVER = r'''
import json, resource, sys, threading, time
args = json.loads(sys.argv[1])

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024

peak = {"mb": 0.0}
done = threading.Event()
def sample():
    while not done.is_set():
        peak["mb"] = max(peak["mb"], rss_mb())
        time.sleep(0.02)
from pipelines.core.runtime import init_ray
from pipelines.data.prepare import PrepareConfig, prepare
from pipelines.data.sources import NAMED_SOURCES
from tests.support.hub import stand_in_source
NAMED_SOURCES["standin"] = stand_in_source()
init_ray(num_cpus=2)
before = rss_mb()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
t = time.perf_counter()
m = prepare(PrepareConfig.from_dict(args["opts"]))["train"]
dt = time.perf_counter() - t
done.set()
sampler.join()
print(json.dumps({"seconds": dt, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "before_mb": before, "during_mb": peak["mb"], "rows": m.rows,
                  "stream_tokens": m.rows * (m.length - 2) + m.dropped_tail_tokens, "shards": len(m.shards)}))
'''


def corpus_lines() -> list[str]:
    import pyarrow.parquet as pq

    from pipelines.data.embedded import embedded_corpus

    lines: list[str] = []
    for f in embedded_corpus().values():
        for doc in pq.read_table(f).column("text").to_pylist():
            lines.extend(x for x in doc.splitlines() if x.strip())
    return lines


def build(work: Path, size_mb: float, file_mb: float, lines: list[str]) -> tuple[Path, Path]:
    """``corpus.txt`` of about ``size_mb`` and the same lines as a hub mirror of Parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.support.hub import REPO

    text = work / "corpus.txt"
    mirror = work / "mirror"
    files_dir = mirror / REPO / "plain_text"
    files_dir.mkdir(parents=True, exist_ok=True)
    target, written, part, buf, size = size_mb * 1e6, 0, 0, [], 0

    def flush() -> None:
        nonlocal part, buf, size
        if buf:
            pq.write_table(pa.table({"text": buf}), files_dir / f"train-{part:05d}.parquet", row_group_size=2000)
            part, buf, size = part + 1, [], 0

    with open(text, "w", encoding="utf-8") as fh:
        while written < target:
            for line in lines:
                fh.write(line + "\n")
                n = len(line.encode("utf-8")) + 1
                written += n
                buf.append(line)
                size += n
                if size >= file_mb * 1e6:
                    flush()
                if written >= target:
                    break
    flush()
    return text, mirror


def measure(opts: dict, env: dict[str, str]) -> dict:
    p = subprocess.run([sys.executable, "-c", DRIVER, json.dumps({"opts": opts})], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
        raise SystemExit("a measurement failed")
    return json.loads([x for x in p.stdout.splitlines() if x.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=25.0, help="the 1x corpus in MB (4x is measured too)")
    ap.add_argument("--file-mb", type=float, default=2.0, help="MB of text a Parquet file of the stand-in")
    ap.add_argument("--length", type=int, default=1024, help="row length L")
    ap.add_argument("--workdir", default=None, help="where corpora and outputs go (default: a temp folder)")
    add_argument(ap)
    args = ap.parse_args()
    with recording("prepare_scale", args.record):
        scale(args)


def scale(args: argparse.Namespace) -> None:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_prep_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
           "ADLM_WORKDIR": str(work), "PYTHONPATH": str(ROOT)}
    lines = corpus_lines()
    base = dict(tokenizer="gpt2", length=args.length, overwrite=True, actors=2, min_actors=2)
    runs: dict[tuple[str, int], dict] = {}
    print(f"GPT-2, wrap L={args.length}, {os.cpu_count()} CPUs; corpus {args.size_mb:g} MB and "
          f"{4 * args.size_mb:g} MB; 2 tokenizer actors unless said")
    for k in (1, 4):
        d = work / f"x{k}"
        d.mkdir(exist_ok=True)
        text, mirror = build(d, k * args.size_mb, args.file_mb, lines)
        files = len(list((mirror).rglob("*.parquet")))
        for kind, opts in (("local files", dict(source=[f"train={text}"])),
                           ("hub stand-in (Parquet)", dict(source=["standin"], hub_mirror=str(mirror)))):
            r = measure({**base, **opts, "out": str(d / "out")}, env)
            runs[(kind, k)] = r
            print(f"{kind:>24} {k}x ({text.stat().st_size / 1e6:5.1f} MB{f', {files} files' if 'hub' in kind else ''}): "
                  f"{r['seconds']:6.1f} s, {r['stream_tokens'] / r['seconds']:10,.0f} tokens/s, driver peak "
                  f"{r['peak_mb']:4.0f} MB (RSS {r['before_mb']:.0f} MB before prepare(), at most {r['during_mb']:.0f} MB "
                  f"during it), {r['shards']} shards")
        if k == 4:
            one = measure({**base, "source": [f"train={text}"], "actors": 1, "min_actors": 1, "out": str(d / "out1")},
                          env)
            two = runs[("local files", 4)]
            tps1, tps2 = one["stream_tokens"] / one["seconds"], two["stream_tokens"] / two["seconds"]
            print(f"throughput, local files 4x: 1 actor {tps1:,.0f} tokens/s, 2 actors {tps2:,.0f} tokens/s "
                  f"({tps2 / tps1:.2f}x)")
    mem = max(runs[(kind, 4)]["peak_mb"] / runs[(kind, 1)]["peak_mb"] for kind in ("local files", "hub stand-in (Parquet)"))
    tim = max(runs[(kind, 4)]["seconds"] / runs[(kind, 1)]["seconds"] for kind in ("local files", "hub stand-in (Parquet)"))
    during = max(runs[(kind, 4)]["during_mb"] / runs[(kind, 1)]["during_mb"]
                 for kind in ("local files", "hub stand-in (Parquet)"))
    print(f"(the same ratio for the RSS sampled during prepare() alone: {during:.3f})")
    print(f"RESULT prep_driver_memory_growth_4x={mem:.3f}")
    print(f"RESULT prep_time_growth_4x={tim:.3f}")
    print(f"RESULT prep_actors_2_over_1={tps2 / tps1:.3f}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"(benchmark took {time.time() - t0:.0f} s)")
