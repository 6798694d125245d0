"""The whole pipeline's summary: one row per registered version (its figures, as the evaluation suites describe
them: validation bound, gen-PPL with its definition, entropy, MAUVE, lm-eval's tasks when run; the staged
evaluation's decision), the sweep's trials, two samples of the
champion, the stage times, and, for the demo, whether it did what it promises (``profiles.DemoGoals``).

It is also the README's demo summary, written from a run, never typed (``main``): what lies between
``<!-- demo-summary:begin -->`` and ``<!-- demo-summary:end -->`` is replaced with the summary exactly as
``make demo`` prints it (the table as Markdown, the lines after it in a text block; the checkout's own path left
out, so that ``sqlite:////home/.../work/mlflow.db`` reads ``sqlite:///work/mlflow.db``, which works from any
checkout's root), under a line saying when and where it ran:

    python -m pipelines.orchestration.summary              # from the last run's work/summary.md
    python -m pipelines.orchestration.summary --run        # run `make demo`'s command first
    python -m pipelines.orchestration.summary --workdir DIR --readme PATH
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from adlm_model.kinds import KINDS
from pipelines.core.cli import run_command
from pipelines.core.logs import add_logging_flags, get_logger
from pipelines.core.runtime import PROJECT_ROOT
from pipelines.core.storage import exists, join, read_text, resolve_workdir, write_text
from pipelines.evaluation.metrics import MAUVE_MIN_SAMPLES
from pipelines.evaluation.promotion import CHAMPION, alias_version
from pipelines.evaluation.suites import PPL, figures, figures_of
from pipelines.orchestration.profiles import DemoGoals, Profile
from pipelines.serving.generate import open_generator, run_generation
from pipelines.tracking.runs import client, redact_uri

log = get_logger(__name__)


def summarize(prof: Profile, uri: str, model_name: str, vocab_size: int, results: dict, sweep_res: Any,
              timings: dict[str, float]) -> dict:
    """The summary as a dict (``summary.json``); ``results``: label -> ``TrainResult``."""
    c = client(uri)
    rows = []
    entries = [(label, r.registered_version) for label, r in results.items()]
    if sweep_res is not None and sweep_res.registered_version:
        entries.append((f"ADLM sweep best ({sweep_res.best.trial_id})", sweep_res.registered_version))
    champion = alias_version(c, model_name, CHAMPION)  # None: every candidate was rejected
    for label, version in entries:
        tags = dict(c.get_model_version(model_name, version).tags) if version else {}

        def num(key: str, tags: dict = tags) -> float | None:
            try:
                return float(tags[key])
            except (KeyError, ValueError):
                return None

        # MAUVE from fewer samples than MAUVE_MIN_SAMPLES is no figure (the demo's 16: chance near 1 or 0);
        # its value stays in the registry, with its count, and the summary says why it shows none.
        mauve, mauve_n = num("mauve"), num("mauve.samples")
        too_few = mauve is not None and mauve_n is not None and mauve_n < MAUVE_MIN_SAMPLES
        # One entry a summary column of the suites' figures (pipelines.evaluation.suites: Figure.column): a single
        # figure as a number, a family (lm-eval's tasks) as member -> value.
        shown = {f.tag: num(f.tag) for f in figures() if f.column and not f.family}
        families = {f.tag: {m: tags[t] for t, (g, m) in figures_of(tags).items() if g is f}
                    for f in figures() if f.column and f.family}
        rows.append({"model": label, "version": version, "kind": tags.get("kind"), "gamma": tags.get("gamma"),
                     "tau": tags.get("tau"), **shown, "families": families,
                     "gen_ppl_definition": tags.get("gen_ppl.definition"),
                     "mauve": None if too_few else mauve,
                     "mauve_note": f"n/a (too few samples: {mauve_n:.0f})" if too_few else None,
                     "status": tags.get("eval.status"),
                     "reasons": tags.get("eval.reasons", ""), "champion": version == champion})
    sweep = None
    if sweep_res is not None:
        sweep = {"name": sweep_res.name, "trials": len(sweep_res.trials),
                 "stopped": sorted(t.trial_id for t in sweep_res.trials if t.status == "stopped"),
                 "statuses": {t.trial_id: t.status for t in sweep_res.trials}}
    return {"profile": prof.name, "model_name": model_name, "champion": champion, "vocab_size": vocab_size,
            "rows": rows, "sweep": sweep, "timings_s": timings, "tracking_uri": redact_uri(uri), "comparable": prof.comparable}


def check_goals(s: dict, goals: DemoGoals) -> list[dict[str, Any]]:
    """Each promise of the demo with what this run measured and whether it holds (``s``: the summary with its
    samples)."""
    champ = next((r for r in s["rows"] if r["champion"]), None)
    bound, limit = (champ or {}).get("val_ppl"), goals.champion_bound_over_vocab * s["vocab_size"]
    sweep = s.get("sweep") or {"trials": 0, "stopped": []}
    return [
        {"goal": f"champion's validation bound <= vocabulary/10 = {limit:g}",
         "measured": "no champion" if champ is None else f"{bound:.1f} ({champ['model']})",
         "met": bound is not None and bound <= limit},
        {"goal": f"sweep of >= {goals.min_trials} trials, ASHA stopping >= {goals.min_stopped}",
         "measured": f"{sweep['trials']} trials, {len(sweep['stopped'])} stopped",
         "met": sweep["trials"] >= goals.min_trials and len(sweep["stopped"]) >= goals.min_stopped},
        {"goal": f"{goals.samples} samples of the champion", "measured": f"{len(s.get('samples') or [])}",
         "met": len(s.get("samples") or []) >= goals.samples},
    ]


SAMPLE_DRAWS = 4
"""Batches of ``n`` the summary draws at most to find ``n`` non-empty samples of the champion."""


def champion_samples(s: dict, wd: str, uri: str, length: int, n: int = 2) -> list[str]:
    """Up to ``n`` short unconditional samples of the champion with text in them, drawn through the same
    generator as ``pipelines.generate`` and the served model (seeded: a rerun prints the same ones). A sample
    that is empty (the model drew EOS first: an AR model may, right after BOS) is neither shown nor counted:
    further seeded batches are drawn, ``SAMPLE_DRAWS`` at most, and fewer than ``n`` is what the summary says."""
    if not s.get("champion"):
        return []
    texts: list[str] = []
    try:
        loaded = open_generator(f"models:/{s['model_name']}@champion", tracking_uri=uri, workdir=wd, device="cpu")
        for seed in range(SAMPLE_DRAWS):
            req = loaded.generator.request(length=length, steps=length, num_samples=n, seed=seed)
            texts += [g.completion for g in run_generation(loaded, req, progress=False) if g.completion.strip()]
            if len(texts) >= n:
                break
    except Exception as e:  # noqa: BLE001 - the summary stands without its samples; say why
        log.warning(f"sampling the champion failed ({type(e).__name__}: {str(e)[:200]})")
    if len(texts) < n:
        log.warning(f"the champion drew {len(texts)} non-empty samples of {n} in {SAMPLE_DRAWS} batches")
    return texts[:n]


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def _columns(rows: list[dict]) -> list[Any]:
    """The summary's figure columns: every single figure with a column, a family's only when a row has one."""
    return [f for f in figures() if f.column and (not f.family or any((r.get("families") or {}).get(f.tag)
                                                                       for r in rows))]


def _cell(r: dict, f: Any) -> str:
    if f.family:
        return "; ".join(f"{m} {v}" for m, v in sorted(((r.get("families") or {}).get(f.tag) or {}).items())) or "-"
    if f.tag == "mauve" and r.get("mauve_note"):
        return r["mauve_note"]
    bound = "<= " if f.definition == PPL and r["kind"] in KINDS and KINDS[r["kind"]].diffusion and r.get(f.tag) is not None else ""
    return bound + _fmt(r.get(f.tag))


def summary_markdown(s: dict) -> str:
    cols = _columns(s["rows"])
    out = ["| model | kind | version | gamma | tau | " + " | ".join(f.column for f in cols) + " | status |",
           "|---|---|---|---|---|" + "---|" * len(cols) + "---|"]
    for r in s["rows"]:
        status = (r["status"] or "-") + (" **champion**" if r["champion"] else "")
        # gamma and tau are tagged on anchored (ADLM) versions only (pipelines.tracking.registry.training_tags)
        anchor = (f"{float(r['gamma']):.3g}", _fmt(r["tau"])) if r["gamma"] is not None else ("-", "-")
        out.append(f"| {r['model']} | {_fmt(r['kind'])} | {_fmt(r['version'])} | {anchor[0]} | {anchor[1]} | "
                   + " | ".join(_cell(r, f) for f in cols) + f" | {status} |")
    out.append("")
    for d in sorted({r["gen_ppl_definition"] for r in s["rows"] if r["gen_ppl"] is not None and r["gen_ppl_definition"]}):
        out.append(f"gen-PPL: {d}.")
    if not s.get("comparable", False):
        out.append(f"Profile {s.get('profile', '?')}: minutes of training and a small evaluation, there to show the "
                   "wiring and that the models learn; no figure here compares with a published one (those need "
                   "the recipes in configs/ and `pipelines.evaluate --profile paper`).")
    champ = next((r for r in s["rows"] if r["champion"]), None)
    out.append(f"Champion: {s['model_name']} v{s['champion']}, the {champ['model'] if champ else '?'} run "
               f"(models:/{s['model_name']}@champion)" if s["champion"]
               else "No champion: every candidate was rejected (see the eval.reasons tags).")
    if any(r.get("mauve_note") for r in s["rows"]):
        out.append(f"MAUVE: shown only from {MAUVE_MIN_SAMPLES} samples up; below that its few histogram buckets "
                   "read near 1 or near 0 by chance (the registry keeps the value and its sample count).")
    for i, text in enumerate(s.get("samples") or [], 1):
        out.append(f"Champion sample {i}: " + " ".join(text.split())[:400])
    if s.get("sweep"):
        sw = s["sweep"]
        out.append(f"Sweep {sw['name']}: {sw['trials']} trials, ASHA stopped {len(sw['stopped'])} early"
                   + (f" ({', '.join(sw['stopped'])})" if sw["stopped"] else ""))
    out.append("Times: " + ", ".join(f"{k} {v:.0f} s" for k, v in s["timings_s"].items()))
    for g in s.get("goals") or []:
        out.append(f"Demo goal: {g['goal']}: {g['measured']} -> {'met' if g['met'] else 'NOT MET'}")
    uri = s["tracking_uri"]
    if uri.startswith("sqlite:"):
        out.append(f"Open the MLflow UI: mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000")
    else:
        out.append(f"MLflow: {redact_uri(uri)}")
    return "\n".join(out) + "\n"


def write_summary(prof: Profile, wd: str, uri: str, model_name: str, vocab_size: int, results: dict, sweep_res: Any,
                  timings: dict[str, float]) -> tuple[dict, str]:
    """The pipeline's summary (the champion's samples and the profile's goals included), written to
    ``<workdir>/summary.json`` and ``summary.md``; returns it and its markdown."""
    summary = summarize(prof, uri, model_name, vocab_size, results, sweep_res, timings)
    summary["samples"] = champion_samples(summary, wd, uri, prof.sample_length)
    if prof.goals is not None:
        summary["goals"] = check_goals(summary, prof.goals)
    write_text(join(wd, "summary.json"), json.dumps(summary, indent=2, default=str))
    md = summary_markdown(summary)
    write_text(join(wd, "summary.md"), md)
    return summary, md


# ---- The README's demo summary ----
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
    out = [BEGIN, f"<!-- written by `python -m pipelines.orchestration.summary`; {provenance} -->", "",
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.orchestration.summary",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=None, help="the demo's work directory (default: $ADLM_WORKDIR or ./work)")
    p.add_argument("--readme", default=str(PROJECT_ROOT / "README.md"), help="the README to update")
    p.add_argument("--run", action="store_true", help="run the demo first (`make demo`'s command)")
    add_logging_flags(p)
    return p


def _run(args: argparse.Namespace) -> int:
    readme = Path(args.readme)
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
    print(f"{readme}: the demo summary block rewritten ({provenance})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), _run, argv, bad_input=(OSError, SummaryError))


if __name__ == "__main__":
    sys.exit(main())
