"""What a sweep's confirmation leaves behind (``pipelines.tuning.confirm``): its report (Markdown, CSV, JSON, the
pictures) beside the sweep's under ``<workdir>/sweeps/<name>/``, the parent MLflow run's metrics, tags and artifacts,
and the confirmed runs registered as versions tagged with the primary interval."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from pipelines.core.storage import join, read_text, temp_dir, write_bytes_atomic
from pipelines.evaluation.truth import exact_entropy, skips_first, truth_of
from pipelines.studies.comparisons import nats
from pipelines.studies.stats import Summary, summarise
from pipelines.tracking.registry import register_once, training_tags
from pipelines.tracking.runs import RUN_NAME_TAG, best_effort, client, log_artifact_safely
from pipelines.training.config import TrainConfig
from pipelines.tuning.confirm import ConfirmPlan, ConfirmResult, Contrast
from pipelines.tuning.report import TrialRow, plot_confirmation, plot_search


def _truth(plan: ConfirmPlan) -> dict[str, Any] | None:
    cfg = plan.arms[0].config
    return truth_of(cfg.resolve_path(cfg.data.validation, plan.workdir))


def confirm_markdown(plan: ConfirmPlan, bounds: dict[str, dict[str, dict[int, float]]], line: str) -> str:
    """The confirmation's report: the arms, their search budgets, each reading's bounds and every contrast."""
    space = plan.space
    truth = _truth(plan)
    out = [f"## Confirmation of sweep `{space.name}`", "", f"**{line}**", "",
           f"Fresh seeds {plan.seeds} (no search trial used them); every arm validated on the same rows with the same "
           "noise draw; d = ln bound(against) - ln bound(arm), nats per token, paired by seed, Student-t 95% "
           "interval; the search's own runs enter no number here.", ""]
    if space.hypothesis:
        out += ["**Pre-registered** (committed with the space before its first run):", ""]
        out += ["> " + ln if ln.strip() else ">" for ln in space.hypothesis.strip().splitlines()] + [""]
    out += ["| arm | role | configuration | parameters | GFLOP/step | trained to | search budget |",
            "|---|---|---|---|---|---|---|"]
    for a in plan.arms:
        out.append(f"| {a.name} | {a.role} | {a.label} | {a.params / 1e6:.2f} M | {a.flops_per_step / 1e9:.2f} | "
                   f"{a.steps:,} steps | {plan.budgets.get(a.name, '—')} |")
    out += ["", "Validation bound per reading, nats/token (mean ± sd [95% interval] over seeds)"
            + (", and its excess over the exact entropy" if truth else "") + ":", "",
            "| reading | arm | step | seeds | bound |" + (" excess over the entropy |" if truth else ""),
            "|---|---|---|---|---|" + ("---|" if truth else "")]
    for r in plan.readings:
        for arm, step in r.step.items():
            vals = [nats(v) for v in bounds[r.key].get(arm, {}).values()]
            s = summarise(vals).text(4) if vals else "—"
            ex = ""
            if truth:
                h = exact_entropy(truth, skips_first(plan.arm(arm).config.model))[0]
                ex = " " + (summarise([v - h for v in vals]).text(4) if vals else "—") + " |"
            out.append(f"| {r.text} | {arm} | {step:,} | {len(vals)} | {s} |{ex}")
    out += ["", "| contrast | reading | seeds | d (nats/token) | verdict |", "|---|---|---|---|---|"]
    for c in plan.contrasts:
        d = c.difference
        reading = next(r for r in plan.readings if r.key == c.reading).text
        out.append(f"| {'**primary** ' if c.primary else ''}{c.arm} vs {c.against} | {reading} | "
                   f"{0 if d is None else d.n} | {'—' if d is None else d.text(4)} | {c.verdict} |")
    return "\n".join(out) + "\n"


def _csv(result: ConfirmResult) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["reading", "arm", "seed", "step", "val_ppl", "nats_per_token"])
    for r in result.plan.readings:
        for arm, step in r.step.items():
            for seed, v in sorted(result.bounds[r.key].get(arm, {}).items()):
                w.writerow([r.key, arm, seed, step, v, nats(v)])
    return buf.getvalue()


def _json(result: ConfirmResult) -> dict[str, Any]:
    def s(x: Summary | None) -> dict | None:
        return None if x is None else {k: getattr(x, k) for k in ("n", "mean", "sd", "lo", "hi")}

    p = result.plan
    return {"sweep": p.space.name, "seeds": p.seeds, "summary": result.summary,
            "arms": [{"name": a.name, "role": a.role, "label": a.label, "steps": a.steps, "parameters": a.params,
                      "flops_per_step": a.flops_per_step, "search_budget": p.budgets.get(a.name),
                      "settings": a.raw} for a in p.arms],
            "readings": [{"key": r.key, "step": r.step} for r in p.readings],
            "bounds": {k: {a: {str(s_): v for s_, v in d.items()} for a, d in arms.items()}
                       for k, arms in result.bounds.items()},
            "contrasts": [{"arm": c.arm, "against": c.against, "reading": c.reading, "primary": c.primary,
                           "difference_nats": s(c.difference), "verdict": c.verdict} for c in result.contrasts],
            "hypothesis": p.space.hypothesis}


def report(result: ConfirmResult, parent: str | None, register: bool, rows: list[TrialRow] | None) -> None:
    """The files beside the sweep's report (``<workdir>/sweeps/<name>/``: confirm.md, .csv, .json, .png and the
    search's picture again, the confirmed winner ringed), the parent run's metrics, tags and artifacts, and the
    registered versions."""
    plan = result.plan
    result.markdown = confirm_markdown(plan, result.bounds, result.summary)
    out = temp_dir("adlm-confirm-")
    (out / "confirm.md").write_text(result.markdown)
    (out / "confirm.csv").write_text(_csv(result))
    (out / "confirm.json").write_text(json.dumps(_json(result), indent=2))
    plot_confirmation(result, out / "confirm.png")
    winner = next((r for r in rows or [] if r.status == "finished" and r.params == result.winner_params), None)
    if rows and winner is not None:
        plot_search(rows, out / "search.png", f"sweep {plan.space.name}: {len(rows)} trials", best=winner,
                    best_label=f"confirmed: {plan.primary.verdict} {plan.against.name}")
    local = sorted(out.iterdir())
    if parent is not None:
        _log(result, parent, local, register)
    dest = join(plan.workdir, "sweeps", plan.space.name)
    for f in local:
        write_bytes_atomic(join(dest, f.name), f.read_bytes())
        result.artifacts[f.name] = join(dest, f.name)
    shutil.rmtree(out, ignore_errors=True)


def _log(result: ConfirmResult, parent: str, files: list[Path], register: bool) -> None:
    # lazy: keeps mlflow out of this module's import
    import mlflow

    plan = result.plan
    with best_effort(plan.tracking_uri, "the confirmation's results are not logged to MLflow (they are on disk)",
                     stop_on_refusal=False):
        c = client(plan.tracking_uri)
        stamp = int(time.time() * 1000)
        metrics = []
        for ct in result.contrasts:
            if ct.difference is None:
                continue
            key = f"confirm/{ct.arm}_vs_{ct.against}/{ct.reading.replace(':', '_')}"
            for k in ("mean", "lo", "hi"):
                v = getattr(ct.difference, k)
                if math.isfinite(v):
                    metrics.append(mlflow.entities.Metric(f"{key}/d_{k}", v, stamp, 0))
        if metrics:
            c.log_batch(parent, metrics=metrics)
        p = plan.primary
        c.set_tag(parent, "confirm.summary", result.summary[:5000])
        c.set_tag(parent, "confirm.verdict", p.verdict)
        c.set_tag(parent, "confirm.seeds", json.dumps(plan.seeds))
        for f in files:
            log_artifact_safely(plan.tracking_uri, parent, f, "sweep")
        if register:
            result.versions = _register(result, p)


def _register(result: ConfirmResult, p: Contrast) -> list[str]:
    """The winner's and the comparator's confirmation runs as versions, tagged with the primary interval (once: a
    rerun finds them); no alias moves."""
    plan = result.plan
    c = client(plan.tracking_uri)
    d = p.difference
    versions = []
    for rp in plan.runs:
        arm = plan.arm(rp.arm)
        if arm.role == "ablation":
            continue
        cfg = TrainConfig.from_dict(json.loads(json.dumps(rp.raw)))
        name = cfg.mlflow.registered_model
        exp = c.get_experiment_by_name(cfg.mlflow.experiment)
        found = c.search_runs([exp.experiment_id], f"tags.`{RUN_NAME_TAG}` = '{rp.run_name}'", max_results=1) \
            if exp else []
        if not found:
            continue
        run_id = found[0].info.run_id
        meta = json.loads(read_text(join(plan.workdir, "checkpoints", rp.run_name, "config.json"))).get("meta", {})
        step = int(meta.get("step", rp.max_steps))
        tags = training_tags(cfg.model, run_name=rp.run_name, step=step, val_ppl=meta.get("val_ppl"),
                             sweep=plan.space.name, **{
                                 "confirm.arm": arm.name, "confirm.role": arm.role, "confirm.seed": rp.seed,
                                 "confirm.against": p.against, "confirm.reading": p.reading,
                                 "confirm.verdict": p.verdict, "confirm.seeds": json.dumps(plan.seeds),
                                 "confirm.d_mean": d.mean if d else "", "confirm.d_lo": d.lo if d else "",
                                 "confirm.d_hi": d.hi if d else ""})
        mv, _ = register_once(run_id, name, step, tags, tracking_uri=plan.tracking_uri, aliases=())
        versions.append(str(mv.version))
    return versions
