"""Dated records under ``benchmarks/results/`` for runs that predate ``--record``, written from their committed raw files.

Each source below is a raw file the run itself wrote and that is committed: a ``gpu_check.json``, a benchmark's
log with its RESULT lines, a study's results. The record states what the raw file holds (date, the run's commit,
machine, command, RESULT lines) and, where the raw file does not hold something, says so and gives the run's
documented setting instead. Every figure in a record is read from the raw file; nothing is typed.

    python benchmarks/records_from_raw.py            # (re)write the records
    python benchmarks/records_from_raw.py --check    # exit 1 when a committed record differs from its source
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
HEADER = "Written by `benchmarks/records_from_raw.py` from the committed raw files below; not edited by hand."


@dataclass(frozen=True)
class Source:
    """One run: its raw files (relative to the repository), the record's topic, and what the raw files lack."""

    kind: str
    """``gpu_check`` (a gpu_check.json), ``log`` (a log with RESULT lines) or ``study`` (a study's results)."""
    raw: tuple[str, ...]
    topic: str
    machine: str = ""
    """The machine's slug and description when the raw file does not hold them."""
    command: str = ""
    """The command when the raw file does not hold it."""
    notes: tuple[str, ...] = ()


SOURCES: tuple[Source, ...] = (
    Source("gpu_check", ("benchmarks/gpu_runs/2026-11-27_h100.json",), "gpu-check"),
    Source("gpu_check", ("benchmarks/gpu_runs/2026-11-27_h100_compile_loss.json",), "gpu-check-compile-loss",
           notes=("Resumed from the first run's JSON (`--resume`): the items it did not rerun keep that run's "
                  "figures.",)),
    Source("gpu_check", ("benchmarks/gpu_runs/2026-11-27_h100_kv_steps.json",), "gpu-check-kv-steps"),
    Source("gpu_check", ("benchmarks/gpu_runs/2026-11-28_h200.json",), "gpu-check"),
    Source("log", ("benchmarks/runs/2026-11-28_h100_natural_256/cpu_half_natural.log",
                   "benchmarks/runs/2026-11-28_h100_natural_256/fs_natural_mdlm.log",
                   "benchmarks/runs/2026-11-28_h100_natural_256/fs_natural_adlm.log"),
           "fast-sampling-natural", machine="cpu: the models trained on an NVIDIA H100 (`fs_natural_*.log`), "
           "the samplers timed on a 2-core CPU, one thread (`cpu_half_natural.log`)",
           command="python benchmarks/fast_sampling.py --train-steps 18000 --batch 256 --presets natural "
                   "--workdir W  (the models trained by bash benchmarks/gpu_fast_sampling.sh 18000 540 mdlm,adlm "
                   "128x2 256 natural)"),
    Source("log", ("benchmarks/runs/2026-11-28_h200_anchored_256/cpu_half_anchored.log",
                   "benchmarks/runs/2026-11-28_h200_anchored_256/fs_anchored_mdlm.log",
                   "benchmarks/runs/2026-11-28_h200_anchored_256/fs_anchored_adlm.log",
                   "benchmarks/runs/2026-11-28_h200_anchored_256/anchored_frontier.json"),
           "fast-sampling-anchored", machine="cpu: the models trained on an NVIDIA H200 (`fs_anchored_*.log`), "
           "distilled and timed on a 2-core CPU, one thread (`cpu_half_anchored.log`)",
           command="python benchmarks/fast_sampling.py --train-steps 18000 --batch 256 --presets anchored "
                   "--distill-presets anchored --workdir W  (the models trained by bash "
                   "benchmarks/gpu_fast_sampling.sh 18000 570 mdlm,adlm 128x2 256 anchored)"),
    Source("study", ("studies/laptop/table.md", "studies/laptop/results.csv", "studies/laptop/curves.png"),
           "study-laptop", machine="cpu: a 2-core CPU, two runs at a time",
           command="python -m pipelines.study studies/laptop.yaml"),
    Source("study", ("studies/testbed/table.md", "studies/testbed/results.json", "studies/testbed/results.csv",
                     "studies/testbed/curves.png"),
           "study-testbed", machine="cpu: a 2-core CPU, two runs at a time",
           command="python -m pipelines.study studies/testbed.yaml"),
    Source("study", ("studies/testbed_sedd/table.md", "studies/testbed_sedd/results.json",
                     "studies/testbed_sedd/results.csv", "studies/testbed_sedd/curves.png"),
           "study-testbed-sedd", machine="cpu: a 2-core CPU, two runs at a time",
           command="python -m pipelines.study studies/testbed_sedd.yaml"),
    Source("confirm", tuple(f"benchmarks/runs/2026-12-06_cpu2_demo_confirm/{f}" for f in (
        "confirm.json", "confirm.md", "confirm.csv", "confirm.png", "search.png", "trials.md")),
           "tune-confirm-demo", machine="cpu2: a 2-core CPU shared with other work (load average 7-13), two trials "
           "at a time",
           command="python -m pipelines.prepare_data --source embedded && python -m pipelines.tune --space "
                   "tune_spaces/demo.yaml --config configs/demo.yaml --confirm 3",
           notes=("`ccf9137` (the search and the confirmation's runs; the report rewritten by a rerun of the same "
                  "command at `b00843b`, which trained nothing)",)),
    Source("confirm", tuple(f"studies/testbed_tuned/{f}" for f in (
        "confirm.json", "confirm.md", "confirm.csv", "confirm.png", "search-adlm.png", "search-mdlm.png",
        "trials-adlm.md", "trials-mdlm.md", "load.log")),
           "study-testbed-tuned", machine="cpu2: a 2-core CPU shared with other work, two runs at a time, the "
           "study's processes at nice -2",
           command="python -m pipelines.prepare_data --source testbed && python -m pipelines.tune --space "
                   "tune_spaces/testbed_tuned.yaml",
           notes=("`8e74e8c` (the pre-registration commit: the space and its hypothesis; every run of the study, "
                  "searches and confirmation, from a checkout of it; the confirmation was interrupted once and resumed by "
                  "rerunning the same command, its finished runs kept)",
                  "load.log samples the load from 20:51 UTC, while the confirmation's runs trained; the searches "
                  "before it were not sampled.",
                  "The MDLM arm's seed 1 stalled: its bound fell to 18.3 PPL by step 1,800, then stayed between "
                  "17.6 and 18.9 to step 4,800 (the other four seeds: 13.6 to 14.1 at 4,800). It is a real run of "
                  "the tuned setting (learning rate 3.7e-3, no warm-up) and stays in every number.",
                  "Step budgets: ASHA let ADLM's search train 6,200 steps and MDLM's 4,400 (10 trials each); the "
                  "space's sizing comment (written before the run) expected about 4,000 an arm.",
                  "Two of the ADLM winner's three settings sit at the edge of the searched range (tau = 8, the "
                  "largest value offered; the learning rate 1.25e-3 near the lower bound 1e-3).")),
)


def _git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def committed_in(path: str) -> tuple[str, str]:
    """(short hash, ISO date) of the last commit that changed ``path``: the commit that holds this raw file."""
    out = _git("log", "-1", "--format=%h %ad", "--date=short", "--", path)
    if not out:
        raise SystemExit(f"error: {path} is not committed: commit the raw file before writing its record")
    h, d = out.split()
    return h, d


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def _slug(gpu: str) -> str:
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", gpu.upper())
    return re.sub(r"[^a-z0-9]+", "", (m.group(1) if m else gpu).lower()) or "gpu"


@dataclass
class Record:
    date: str
    machine_slug: str
    topic: str
    rows: list[tuple[str, str]]
    command: str
    results: list[str]
    raw: tuple[str, ...]
    sections: list[tuple[str, list[str]]]

    @property
    def name(self) -> str:
        return f"{self.date}_{self.machine_slug}_{self.topic}.md"

    def render(self) -> str:
        lines = [f"# {self.topic}: {self.date}, {self.machine_slug}", "", HEADER, "", "| | |", "|---|---|",
                 *(f"| {k} | {v} |" for k, v in self.rows), "", "## Command", "", "```", self.command, "```", "",
                 "## Results", "", "```", *(self.results or ["(no RESULT line in the raw file)"]), "```"]
        for title, body in self.sections:
            lines += ["", f"## {title}", "", *body]
        lines += ["", "## Raw files", ""]
        lines += [f"- [{Path(p).name}]({os.path.relpath(ROOT / p, RESULTS)})" for p in self.raw]
        return "\n".join(lines) + "\n"


def from_gpu_check(src: Source) -> Record:
    path = src.raw[0]
    d = json.loads((ROOT / path).read_text())
    env = d["env"]
    h, day = committed_in(path)
    results, items = [], []
    for name, item in d["items"].items():
        status = item.get("status", "?")
        if status == "ok":
            results += [f"RESULT {k}={_fmt(v)}" for k, v in item.get("results", {}).items()]
        why = item.get("reason") or (item.get("error") or "").split("\n")[0]
        items.append(f"| `{name}` | {status} | {why[:160]} |")
    machine = (f"{env.get('gpu')} ({env.get('gpu_memory_gib', 0):.0f} GiB, driver {env.get('driver')}, "
               f"flash-attn {'yes' if env.get('flash_attn') else 'no'}); {env.get('cpu_count')} CPU cores")
    rows = [("date (UTC)", d["started"].replace("T", " ")[:19]), ("commit of the run", f"`{env.get('commit', '')[:12]}`"),
            ("raw file committed in", f"`{h}` ({day})"), ("machine", machine),
            ("software", f"Python {env.get('python')}, torch {env.get('torch')}, CUDA {env.get('cuda')}"),
            ("wall time", f"{d.get('elapsed_s', float('nan')):.1f} s (the script's own clock)"),
            ("items", ", ".join(f"{n} {k}" for k, n in sorted((d.get("summary") or {}).items())) or "see below")]
    sections = [("Items", ["| item | status | reason or error |", "|---|---|---|", *items])]
    if src.notes:
        sections.insert(0, ("Notes", list(src.notes)))
    return Record(d["started"][:10], _slug(env.get("gpu", "gpu")), src.topic, rows,
                  "python benchmarks/gpu_check.py " + " ".join(d.get("argv", [])), results, src.raw, sections)


def from_log(src: Source) -> Record:
    results: list[str] = []
    for p in src.raw:
        if p.endswith(".log"):
            results += [line.strip() for line in (ROOT / p).read_text().splitlines() if line.startswith("RESULT ")]
    h, day = committed_in(src.raw[0])
    slug, _, desc = src.machine.partition(": ")
    date = re.search(r"\d{4}-\d{2}-\d{2}", src.raw[0]).group(0)
    first = (ROOT / src.raw[0]).read_text().splitlines()[0]
    rows = [("date", f"{date} (the raw files' folder)"), ("commit of the run", "not in the raw files"),
            ("raw files committed in", f"`{h}` ({day})"), ("machine", f"{desc} (not in the raw files: the run's "
                                                                       "documented setting)"),
            ("setting (the log's first line)", first)]
    return Record(date, slug, src.topic, rows, src.command, results, src.raw,
                  [("Notes", list(src.notes))] if src.notes else [])


def _study_results(src: Source) -> tuple[list[str], list[str]]:
    """RESULT lines and a truth paragraph from a study's results.json (or its CSV for the laptop study)."""
    results, truth = [], []
    js = [p for p in src.raw if p.endswith("results.json")]
    if js:
        d = json.loads((ROOT / js[0]).read_text())
        for arm in d["arms"]:
            for key, name in (("steps_summary", "bound_ppl_steps"), ("flops_summary", "bound_ppl_flops"),
                              ("excess_steps", "excess_nats_steps"), ("excess_flops", "excess_nats_flops")):
                s = arm.get(key)
                if s:
                    results.append(f"RESULT {d['study']}_{arm['name']}_{name}_mean={_fmt(s['mean'])}")
        for c in d.get("comparisons", []):
            dn = c["difference_nats"]
            name = f"{d['study']}_{c['arm']}_vs_{c['against']}_{c['budget']}_diff_nats"
            results += [f"RESULT {name}={_fmt(dn['mean'])}", f"RESULT {name}_lo95={_fmt(dn['lo'])}",
                        f"RESULT {name}_hi95={_fmt(dn['hi'])}"]
        t = d.get("truth") or {}
        if t:
            truth = [f"- exact entropy: {t['entropy_per_token']:.4f} ± {t['entropy_per_token_se']:.4f} nats/token "
                     f"over all {t['length']} positions; {t['entropy_per_token_skip_first']:.4f} over 1..L-1",
                     f"- floors (all positions): unigram {t['floors']['unigram']:.4f}, unigram + position "
                     f"{t['floors']['unigram_position']:.4f} nats/token"]
            av = t.get("anchor_value") or {}
            if av:
                truth.append(f"- anchors: {av['anchors_per_row']['mean']:.2f} a row; mutual information with the "
                             f"rest of the row {av['mutual_information_per_token']['mean']:.3f} nats/token; a lone "
                             f"token from the anchors alone against from nothing: "
                             f"{av['gain_at_full_masking']['mean']:.2f} nats")
            truth.append(f"- wall time as results.json records it: {d['seconds'] / 60:.1f} min")
    else:
        rows = list(csv.DictReader((ROOT / next(p for p in src.raw if p.endswith(".csv"))).open()))
        arms: dict[str, list[dict]] = {}
        for r in rows:
            arms.setdefault(r["arm"], []).append(r)
        for arm, rs in arms.items():
            for key in ("bound_equal_steps", "bound_equal_flops"):
                vals = [float(r[key]) for r in rs if r[key]]
                if vals:
                    results.append(f"RESULT laptop_{arm}_{key}_mean={_fmt(sum(vals) / len(vals))}")
    return results, truth


def from_study(src: Source) -> Record:
    h, day = committed_in(src.raw[0])
    slug, _, desc = src.machine.partition(": ")
    results, truth = _study_results(src)
    table = (ROOT / src.raw[0]).read_text().strip().splitlines()
    table = [("#" + line) if line.startswith("### ") else line for line in table]
    rows = [("date", f"{day} (the commit of the results)"), ("commit of the run", "not in the raw files"),
            ("raw files committed in", f"`{h}` ({day})"),
            ("machine", f"{desc} (not in the raw files: the run's documented setting)")]
    sections = []
    if truth:
        sections.append(("The language (from results.json)", truth))
    sections.append(("The study's own table (table.md, as the study wrote it)", table))
    return Record(day, slug, src.topic, rows, src.command, results, src.raw, sections)


def _load_summary(path: str) -> str:
    """The 1-minute load averages a ``load.log`` sampled (one ``<UTC time> <1 min> <5 min> <15 min>`` line a minute)."""
    vals = sorted(float(line.split()[1]) for line in (ROOT / path).read_text().splitlines() if line.strip())
    if not vals:
        return "not sampled"
    return (f"1-minute load average {vals[0]:.1f} to {vals[-1]:.1f}, median {vals[len(vals) // 2]:.1f} over "
            f"{len(vals)} samples a minute apart (2 cores: other work shared the machine above 2)")


def from_confirm(src: Source) -> Record:
    """A sweep's confirmation (``confirm.json`` as ``pipelines.tuning.confirm_report`` wrote it) and its report."""
    path = next(p for p in src.raw if p.endswith("confirm.json"))
    d = json.loads((ROOT / path).read_text())
    h, day = committed_in(path)
    slug, _, desc = src.machine.partition(": ")
    results = []
    for c in d["contrasts"]:
        dn = c["difference_nats"]
        if dn is None:
            continue
        name = f"{d['sweep']}_{c['arm']}_vs_{c['against']}_{c['reading'].replace(':', '')}_d_nats"
        results += [f"RESULT {name}={_fmt(dn['mean'])}", f"RESULT {name}_lo95={_fmt(dn['lo'])}",
                    f"RESULT {name}_hi95={_fmt(dn['hi'])}"]
    for key, arms in d["bounds"].items():
        for arm, by_seed in arms.items():
            vals = [math.log(v) for v in by_seed.values()]
            if vals:
                results.append(f"RESULT {d['sweep']}_{arm}_{key.replace(':', '')}_bound_nats_mean="
                               f"{_fmt(sum(vals) / len(vals))}")
    rows = [("date", f"{day} (the commit of the results)"), ("commit of the run", src.notes[0] if src.notes else
                                                              "not in the raw files"),
            ("raw files committed in", f"`{h}` ({day})"),
            ("machine", f"{desc} (not in the raw files: the run's documented setting)"),
            ("fresh seeds", ", ".join(str(s) for s in d["seeds"])),
            ("verdict (the primary contrast)", d["summary"])]
    loads = [p for p in src.raw if p.endswith("load.log")]
    if loads:
        rows.append(("load", _load_summary(loads[0])))
    report = [("#" + line) if line.startswith("## ") else line
              for line in (ROOT / next(p for p in src.raw if p.endswith("confirm.md"))).read_text().strip().splitlines()]
    sections = [("The confirmation's own report (confirm.md, as the sweep wrote it)", report)]
    for p in src.raw:
        if Path(p).match("trials*.md"):  # trials.md, or one a searched arm (trials-<arm>.md)
            sections.append((f"Search trials ({Path(p).name})", (ROOT / p).read_text().strip().splitlines()))
    if len(src.notes) > 1:
        sections.insert(0, ("Notes", list(src.notes[1:])))
    return Record(day, slug, src.topic, rows, src.command, results, src.raw, sections)


BUILDERS: dict[str, Callable[[Source], Record]] = {"gpu_check": from_gpu_check, "log": from_log,
                                                  "study": from_study, "confirm": from_confirm}


def records() -> list[Record]:
    return [BUILDERS[s.kind](s) for s in SOURCES]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare the committed records with their sources")
    args = p.parse_args(argv)
    stale = []
    RESULTS.mkdir(parents=True, exist_ok=True)
    for rec in records():
        path = RESULTS / rec.name
        text = rec.render()
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("error: records out of date with their raw files (python benchmarks/records_from_raw.py): "
              + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
