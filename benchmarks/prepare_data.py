"""Benchmark of pipelines.prepare_data: ours end to end vs the reference recipe vs the tokenizer limit.

On the same corpus (the bundled embedded text repeated to ``--size-mb``, one document a line), GPT-2
tokenizer, ``wrap`` packing into rows of ``--length``:

1. limit: ``tokenizers`` ``encode_batch`` alone over the texts already in memory, all cores
   (``TOKENIZERS_PARALLELISM=true``), no packing, no writing (the tokenizer limit);
1b. engine limit: the same for the engine ours uses when it is not ``tokenizers``: for GPT-2, tiktoken's
   ``encode_to_numpy`` on batches of documents joined by EOS, one thread per core, no packing, no writing.
   Ours cannot beat it; the ratio says how much of the engine's speed survives Ray's start-up, packing and
   writing;
2. reference: the MDLM recipe with Hugging Face ``datasets``: ``load_dataset("text")``, ``map`` with batched
   tokenisation + EOS, then ``map`` group-and-wrap into ``BOS ... EOS`` rows, ``num_proc=2``; start-up
   (imports, caching) included;
3. ours: ``python -m pipelines.prepare_data`` in a fresh process, Ray start-up and shard writing included.

Each runs in its own process. Throughput = stream tokens (documents + EOS) / wall seconds.
Prints ``RESULT prep_over_reference=...`` (goal >= 1.25), ``RESULT prep_over_tokenizer_limit=...``
(goal >= 0.9) and, for information, ``RESULT prep_over_engine_limit=...``.

    python benchmarks/prepare_data.py                 # 100 MB
    python benchmarks/prepare_data.py --size-mb 20    # a quicker try
    python benchmarks/prepare_data.py --engine tokenizers   # ours on the tokenizers engine (as before tiktoken)
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

LIMIT = r'''
import json, sys, time
from pipelines.data.tokenizer import load_tokenizer
lines = [l for l in open(sys.argv[1], encoding="utf-8").read().splitlines() if l.strip()]
tok = load_tokenizer("gpt2").backend
t = time.perf_counter(); n = 0
for i in range(0, len(lines), 8192):
    n += sum(len(e.ids) for e in tok.encode_batch_fast(lines[i:i + 8192], add_special_tokens=False))
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "tokens": n + len(lines)}))
'''

ENGINE_LIMIT = r'''
import json, sys, time, os
from concurrent.futures import ThreadPoolExecutor
from pipelines.data.encoder import DocEncoder
from pipelines.data.tokenizer import load_tokenizer
lines = [l for l in open(sys.argv[1], encoding="utf-8").read().splitlines() if l.strip()]
info = load_tokenizer("gpt2")
enc = DocEncoder(info.tokenizer_json, sys.argv[2])
batches = [lines[i:i + 8192] for i in range(0, len(lines), 8192)]
t = time.perf_counter()
with ThreadPoolExecutor(os.cpu_count()) as pool:  # tiktoken releases the GIL while it encodes
    n = sum(len(flat) for flat, _ in pool.map(lambda b: enc(b, info.eos_id), batches))
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "tokens": n, "engine": enc.engine}))
'''

REFERENCE = r'''
import itertools, json, sys, time
t0 = time.perf_counter()
import datasets
from pipelines.data.tokenizer import load_tokenizer
from transformers import PreTrainedTokenizerFast
info = load_tokenizer("gpt2")
tok = PreTrainedTokenizerFast(tokenizer_object=info.backend)
EOS = BOS = info.eos_id
L = int(sys.argv[2])
ds = datasets.load_dataset("text", data_files=sys.argv[1], split="train", cache_dir=sys.argv[3])
def tokenize(b):
    ids = tok(b["text"], add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return {"input_ids": [t + [EOS] for t in ids]}
def group(b):
    cat = list(itertools.chain(*b["input_ids"]))
    n = (len(cat) // (L - 2)) * (L - 2)
    return {"input_ids": [[BOS] + cat[i:i + L - 2] + [EOS] for i in range(0, n, L - 2)]}
ds = ds.map(tokenize, batched=True, num_proc=2, remove_columns=["text"])
out = ds.map(group, batched=True, num_proc=2)
rows = len(out)
print(json.dumps({"seconds": time.perf_counter() - t0, "rows": rows}))
'''


def build_corpus(path: Path, size_mb: float) -> None:
    if path.is_file() and path.stat().st_size >= size_mb * 1e6:
        return
    import pyarrow.parquet as pq

    from pipelines.data.embedded import embedded_corpus

    files = embedded_corpus()
    lines = []
    for f in files.values():
        for doc in pq.read_table(f).column("text").to_pylist():
            lines.extend(x for x in doc.splitlines() if x.strip())
    block = ("\n".join(lines) + "\n").encode("utf-8")
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        written = 0
        while written < size_mb * 1e6:
            fh.write(block)
            written += len(block)
    os.replace(tmp, path)


def run(code_or_args: list[str], env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run(code_or_args, cwd=ROOT, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-5000:])
        raise SystemExit(f"benchmark step failed: {' '.join(code_or_args[:4])}")
    return dt, p.stdout


def last_json(out: str) -> dict:
    """The JSON line a step prints last (progress bars and warnings go elsewhere)."""
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=100.0, help="corpus size in MB (the goal is read at >= 100)")
    ap.add_argument("--length", type=int, default=1024, help="row length L")
    ap.add_argument("--workdir", default=None, help="where the corpus and outputs go (default: a temp folder)")
    ap.add_argument("--actors", type=int, default=None, help="passed to prepare_data --actors")
    ap.add_argument("--skip-reference", action="store_true", help="only the limits and ours")
    ap.add_argument("--engine", default="auto", choices=("auto", "tiktoken", "tokenizers"),
                    help="passed to prepare_data --engine (auto: tiktoken for GPT-2)")
    add_argument(ap)
    args = ap.parse_args()
    with recording("prepare_data", args.record):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_prep_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "ADLM_WORKDIR": str(work),
           "HF_DATASETS_CACHE": str(work / "hf"), "PYTHONPATH": str(ROOT)}
    os.environ.setdefault("ADLM_WORKDIR", str(work))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # this process loads the tokenizer too (the engine check)
    corpus = work / f"corpus_{args.size_mb:g}mb.txt"
    build_corpus(corpus, args.size_mb)
    mb = corpus.stat().st_size / 1e6
    print(f"corpus: {corpus} ({mb:.1f} MB, one document a line), GPT-2 tokenizer, wrap L={args.length}, "
          f"{os.cpu_count()} CPUs")

    _, out = run([sys.executable, "-c", LIMIT, str(corpus)], {**env, "TOKENIZERS_PARALLELISM": "true"})
    lim = last_json(out)
    tokens = lim["tokens"]
    lim_tps = tokens / lim["seconds"]
    print(f"limit (encode_batch, all cores):     {lim['seconds']:7.1f} s  {lim_tps:10,.0f} tokens/s  ({tokens:,} tokens)")

    from pipelines.data.encoder import resolve_engine
    from pipelines.data.tokenizer import load_tokenizer

    engine = resolve_engine(load_tokenizer("gpt2").tokenizer_json, args.engine)
    eng_tps = lim_tps
    if engine != "tokenizers":
        _, out = run([sys.executable, "-c", ENGINE_LIMIT, str(corpus), engine], env)
        el = last_json(out)
        assert el["tokens"] == tokens, "the engines disagree on the token count"
        eng_tps = tokens / el["seconds"]
        print(f"engine limit ({engine}, all cores):       {el['seconds']:7.1f} s  {eng_tps:10,.0f} tokens/s")

    ref_tps = None
    if not args.skip_reference:
        shutil.rmtree(work / "hf", ignore_errors=True)
        dt, out = run([sys.executable, "-c", REFERENCE, str(corpus), str(args.length), str(work / "hf")],
                      {**env, "TOKENIZERS_PARALLELISM": "false"})
        ref = last_json(out)
        ref_tps = tokens / dt
        print(f"reference (datasets.map, num_proc=2): {dt:7.1f} s  {ref_tps:10,.0f} tokens/s  ({ref['rows']:,} rows)")
        shutil.rmtree(work / "hf", ignore_errors=True)

    cmd = [sys.executable, "-m", "pipelines.prepare_data", "--source", f"train={corpus}", "--tokenizer", "gpt2",
           "--length", str(args.length), "--out", str(work / "ours"), "--overwrite", "--quiet", "--engine", engine]
    if args.actors:
        cmd += ["--actors", str(args.actors)]
    dt, out = run(cmd, {**env, "TOKENIZERS_PARALLELISM": "false"})
    from pipelines.data.manifest import read_manifest

    m = read_manifest(work / "ours" / "train")
    ours_tps = tokens / dt
    print(f"ours (prepare_data, Ray, {engine}): {dt:7.1f} s  {ours_tps:10,.0f} tokens/s  ({m.rows:,} rows, "
          f"{len(m.shards)} shards)")
    assert m.rows * (args.length - 2) + m.dropped_tail_tokens == tokens, "ours packed a different token stream"
    if ref_tps is not None:
        print(f"RESULT prep_over_reference={ours_tps / ref_tps:.3f}")
    print(f"RESULT prep_over_tokenizer_limit={ours_tps / lim_tps:.3f}")
    print(f"RESULT prep_over_engine_limit={ours_tps / eng_tps:.3f}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
