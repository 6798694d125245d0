"""The whole pipeline, top to bottom: what ``make demo`` runs and what a cluster job submits.

    python -m pipelines.run_all                      # the embedded demo (CPU, offline, about 5 minutes here)
    python -m pipelines.run_all --profile smoke      # a 1-2 minute end-to-end check (tests, job submit)
    ray job submit --working-dir . --runtime-env runtime_env.yaml -- python -m pipelines.run_all

Stages (each one is also its own CLI; this script only chains them):

1. ``prepare``: Ray Data tokenises and packs the embedded corpus (gensim's Wikipedia sample and the
   King James Bible, shipped by pip packages) into Parquet shards with manifests.
2. ``train``: ADLM (``configs/demo.yaml``), the AR baseline (``configs/demo_ar.yaml``) and MDLM
   (``configs/demo_mdlm.yaml``) with Ray Train on 2 CPU workers; each run's best EMA checkpoint by
   validation bound is registered ``@candidate``.
3. ``tune``: a small gamma/tau search (``tune_spaces/demo.yaml``) with ASHA; the best trial is
   registered ``@candidate``.
4. ``evaluate``: staged evaluation of every waiting version (fast validation bound, then validation
   PPL, samples, gen-PPL under SmolLM2-135M, unigram entropy and MAUVE on MiniLM features, all
   offline), and the gate promotes the best to ``@champion``.
5. A summary table (ADLM vs AR vs MDLM vs the sweep's best), two samples of the champion and the command
   that opens the MLflow UI.

Everything lives under the work directory (``--workdir`` > ``$ADLM_WORKDIR`` > ``./work``) and the
MLflow store (``$MLFLOW_TRACKING_URI`` > ``sqlite:///<workdir>/mlflow.db``). Every stage resumes:
rerunning the script reuses the prepared shards, continues finished training runs (nothing to do),
resumes the sweep and only evaluates versions that are still waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from adlm_model.config import ConfigError
from pipelines.evaluation.config import EVAL_PROFILES
from pipelines.runtime import PROJECT_ROOT, init_ray, quiet_environment
from pipelines.storage import join, resolve_workdir, write_text
from pipelines.tracking import client, resolve_tracking_uri

PROFILES = ("demo", "smoke")


@dataclass
class Profile:
    """What one profile of the pipeline runs."""

    name: str
    train_runs: list[tuple[str, str, list[str]]]
    """(label, recipe, --set overrides) of each training run."""
    sweep: str | None
    """The search space (``tune_spaces/<name>.yaml``) of the sweep over ``configs/demo.yaml``, or None."""
    sweep_overrides: list[str] = field(default_factory=list)
    eval_settings: dict[str, Any] = field(default_factory=dict)
    promotion: dict[str, Any] = field(default_factory=dict)
    prepare: dict[str, Any] = field(default_factory=dict)


def profile(name: str) -> Profile:
    if name == "demo":
        return Profile(
            name="demo",
            # ADLM first (the first champion, fully evaluated), then the AR baseline (the one model that learns
            # context within these minutes: it replaces ADLM), then MDLM (screened out by the fast stage).
            train_runs=[("ADLM", "configs/demo.yaml", []), ("AR", "configs/demo_ar.yaml", []),
                        ("MDLM", "configs/demo_mdlm.yaml", [])],
            sweep="demo",
            # Sized for 2 cores: 16 samples of 32 steps (gen-PPL under SmolLM2 costs ~2 s a sample here), MAUVE
            # on those 16 (a wiring check at this size, not a measurement), and no nucleus: the demo models'
            # distributions are nearly flat, so top-p is vocabulary-wide work at every step (a bottom-k
            # selection at best, a full sort at worst), which this time budget leaves out.
            eval_settings=dict(EVAL_PROFILES["demo"], profile="demo"),
            promotion=dict(stage1_rows=64, stage1_tolerance=0.10, margin=0.0,
                           stage2_suite=("ppl", "generate", "gen_ppl", "mauve")),
            prepare=dict(source=["embedded"]),
        )
    if name == "smoke":
        tiny = ["model.hidden=32", "model.heads=2", "model.n_blocks=1", "model.denoiser_blocks=1", "model.cond_dim=16",
                "run.max_steps=8", "run.val_every=4", "run.ckpt_every=4", "run.log_every=4", "run.val_batches=1",
                "batch.global_batch=8", "batch.micro_batch=8", "scaling.num_workers=1", "scaling.cpus_per_worker=0.5",
                "run.name=smoke-adlm", "data.train=data/smoke/train",
                "data.validation=data/smoke/validation", "model.vocab_size=512", "model.seq_len=32",
                "mlflow.experiment=adlm-smoke"]
        return Profile(
            name="smoke", train_runs=[("ADLM", "configs/demo.yaml", tiny)], sweep="smoke",
            sweep_overrides=[s for s in tiny if not s.startswith(("run.name=", "run.max_steps", "run.val_every",
                                                                  "run.ckpt_every", "run.log_every"))],
            eval_settings=dict(num_samples=8, sample_batch_size=8, steps=8, sampler="mdlm", max_rows=32, batch_size=8,
                               cpus_per_task=0.5),
            promotion=dict(stage1_rows=16, stage2_suite=("ppl", "generate")),
            prepare=dict(source=["smoke"]),
        )
    raise ConfigError(f"unknown profile {name!r}; use one of {', '.join(PROFILES)}")


def _smoke_sources(wd: str) -> list[str]:
    """Small slices of the embedded corpus as local text files (the smoke profile's source)."""
    from pipelines.data.embedded import embedded_slices

    files = embedded_slices(join(wd, "data", "smoke-text"), {"train": 60_000, "validation": 12_000})
    return [f"{split}={p}" for split, p in files.items()]


def _banner(msg: str) -> None:
    print(f"\n{'=' * 100}\n== {msg}\n{'=' * 100}", flush=True)


def run(profile_name: str = "demo", *, workdir: str | os.PathLike | None = None, skip_sweep: bool = False) -> dict:
    """Run every stage; returns the summary (also written to ``<workdir>/summary.json`` and ``.md``)."""
    quiet_environment()
    prof = profile(profile_name)
    wd = resolve_workdir(workdir)
    os.environ["ADLM_WORKDIR"] = wd  # Ray workers and Tune trials see the same work directory
    uri = resolve_tracking_uri(wd)
    t0 = time.time()
    timings: dict[str, float] = {}

    # Validate every recipe and space before any work starts (one-line errors).
    from pipelines.training.config import load_config

    cfgs = [(label, load_config(PROJECT_ROOT / recipe, sets)) for label, recipe, sets in prof.train_runs]
    space = None
    if prof.sweep and not skip_sweep:
        from pipelines.tuning.space import load_space
        from pipelines.tuning.sweep import plan_sweep

        space = load_space(PROJECT_ROOT / "tune_spaces" / f"{prof.sweep}.yaml")
        plan_sweep(space, PROJECT_ROOT / "configs" / "demo.yaml", prof.sweep_overrides, workdir=wd, check_data=False)

    init_ray()

    # 1. Data.
    _banner(f"1/4 prepare data ({prof.name}) -> {join(wd, 'data')}")
    t = time.time()
    from pipelines.data.prepare import prepare

    if prof.name == "smoke":
        prepare(dict(source=_smoke_sources(wd), out=join(wd, "data", "smoke"), train_tokenizer=512, length=32,
                     actor_cpus=0.25))
    else:
        prepare(dict(source=["embedded"], out=join(wd, "data", "embedded")))
    timings["prepare"] = time.time() - t

    # 2. Training runs.
    from pipelines.training.trainer import train

    results = {}
    for label, cfg in cfgs:
        _banner(f"2/4 train {label} ({cfg.model.kind}, run {cfg.run.name}, {cfg.run.max_steps} steps)")
        t = time.time()
        results[label] = train(cfg, workdir=wd, tracking_uri=uri)
        timings[f"train {label}"] = time.time() - t

    # 3. The sweep.
    sweep_res = None
    if space is not None:
        _banner(f"3/4 gamma/tau sweep {space.name} ({space.total_trials} trials, ASHA)")
        t = time.time()
        from pipelines.tuning.sweep import sweep

        sweep_res = sweep(space, PROJECT_ROOT / "configs" / "demo.yaml", prof.sweep_overrides, workdir=wd,
                          tracking_uri=uri)
        timings["sweep"] = time.time() - t

    # 4. Staged evaluation and promotion.
    _banner("4/4 staged evaluation of every @candidate and promotion to @champion")
    t = time.time()
    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.promotion import PromotionConfig, outcomes_markdown, stage_all

    model_name = cfgs[0][1].mlflow.registered_model
    outcomes = stage_all(PromotionConfig(model_name=model_name, **prof.promotion), EvalConfig(**prof.eval_settings),
                         workdir=wd, tracking_uri=uri)
    print(outcomes_markdown(outcomes), flush=True)
    timings["evaluate"] = time.time() - t
    timings["total"] = time.time() - t0

    summary = _summary(uri, model_name, results, sweep_res, timings)
    summary["samples"] = _champion_samples(summary, wd, uri, prof.name)
    write_text(join(wd, "summary.json"), json.dumps(summary, indent=2, default=str))
    md = _summary_markdown(summary, uri)
    write_text(join(wd, "summary.md"), md)
    _banner("summary")
    print(md, flush=True)
    return summary


def _summary(uri: str, model_name: str, results: dict, sweep_res: Any, timings: dict[str, float]) -> dict:
    from pipelines.evaluation.promotion import CHAMPION, alias_version

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

        rows.append({"model": label, "version": version, "kind": tags.get("kind"), "gamma": tags.get("gamma"),
                     "tau": tags.get("tau"), "val_ppl": num("val_ppl"), "gen_ppl": num("gen_ppl"),
                     "entropy": num("entropy"), "mauve": num("mauve"), "status": tags.get("eval.status"),
                     "reasons": tags.get("eval.reasons", ""), "champion": version == champion})
    return {"model_name": model_name, "champion": champion, "rows": rows, "timings_s": timings,
            "tracking_uri": uri}


def _champion_samples(summary: dict, wd: str, uri: str, profile_name: str) -> list[str]:
    """Two short unconditional samples of the champion, drawn through the same generator as
    ``pipelines.generate`` and the served model (seeded: a rerun prints the same two)."""
    if not summary.get("champion"):
        return []
    from pipelines.serving.generate import open_generator, run_generation

    try:
        loaded = open_generator(f"models:/{summary['model_name']}@champion", tracking_uri=uri, workdir=wd,
                                device="cpu")
        length = 24 if profile_name == "smoke" else 48
        req = loaded.generator.request(length=length, steps=length, num_samples=2, seed=0)
        return [g.completion for g in run_generation(loaded, req, progress=False)]
    except Exception as e:  # noqa: BLE001 - the summary stands without its samples; say why
        print(f"WARNING: sampling the champion failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
        return []


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def _summary_markdown(s: dict, uri: str) -> str:
    out = ["| model | version | gamma | tau | validation PPL (bound) | gen-PPL | entropy | MAUVE | status |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        status = (r["status"] or "-") + (" **champion**" if r["champion"] else "")
        anchor = (f"{float(r['gamma']):.3g}" if r["gamma"] else "-", _fmt(r["tau"])) if r["kind"] == "adlm" else ("-", "-")
        out.append(f"| {r['model']} | {_fmt(r['version'])} | {anchor[0]} | {anchor[1]} | {_fmt(r['val_ppl'])} | "
                   f"{_fmt(r['gen_ppl'])} | {_fmt(r['entropy'])} | {_fmt(r['mauve'])} | {status} |")
    out.append("")
    out.append(f"Champion: {s['model_name']} v{s['champion']} (models:/{s['model_name']}@champion)" if s["champion"]
               else "No champion: every candidate was rejected (see the eval.reasons tags).")
    for i, text in enumerate(s.get("samples") or [], 1):
        out.append(f"Champion sample {i}: " + " ".join(text.split())[:400])
    out.append("Times: " + ", ".join(f"{k} {v:.0f} s" for k, v in s["timings_s"].items()))
    if uri.startswith("sqlite:"):
        out.append(f"Open the MLflow UI: mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000")
    else:
        out.append(f"MLflow: {uri}")
    return "\n".join(out) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.run_all",
        description="Run the whole ADLM pipeline: prepare -> train ADLM and MDLM -> gamma/tau sweep -> staged "
                    "evaluation and promotion -> summary. Offline on the embedded corpus; rerun to resume.")
    p.add_argument("--profile", choices=PROFILES, default="demo",
                   help="demo: the `make demo` pipeline (about 5 minutes on 2 CPU cores); smoke: a 1-2 minute check")
    p.add_argument("--workdir", default=None, help="work directory (default: $ADLM_WORKDIR or ./work)")
    p.add_argument("--skip-sweep", action="store_true", help="leave out the gamma/tau sweep")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args.profile, workdir=args.workdir, skip_sweep=args.skip_sweep)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
