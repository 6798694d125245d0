"""Evaluate a checkpoint or a registered model version; stage and promote registry versions.

Suites (every metric has exactly the definition of METHOD.md section 6; ``evaluation/metrics.py``):

- ``ppl``: the NELBO bound ``PPL <= exp(sum NELBO / tokens)`` on prepared splits (METHOD.md section 1):
  EMA weights, ``t`` stratified inside each batch, a fixed seed per batch (so the figure does not depend
  on how batches are spread over workers), optionally ``t_draws`` draws per sequence, tokens pooled
  exactly (float64 sums). AR models report their exact NLL perplexity.
- ``zero_shot``: the same over every prepared zero-shot set (``zero_shot=``), one table.
- ``generate``: ``num_samples`` samples with any sampler of ``adlm_model.samplers``; ids and decoded texts
  are saved as ``samples.jsonl`` with the settings; the mean unigram entropy is always reported.
- ``gen_ppl``: an evaluation causal LM (``eval_lm=``: ``gpt2-large`` by default; ``smollm2`` offline; a
  local model; an AR checkpoint) scores the decoded samples; reported with entropy, sampler, T, p, count.
- ``mauve``: ``mauve-text`` on features of the samples vs as many validation texts (``mauve_featurizer=``).

Execution: on Ray by default (one task per split chunk and per sample batch, a GPU each when the cluster
has GPUs; ``RAY_ADDRESS`` or ``--ray-address`` picks the cluster), or ``--in-process``. The results are
an MLflow run (tags ``model_name``/``model_version``) with metrics, ``summary.md``/``summary.json``,
``samples.jsonl`` and plots; a registry version gets the headline figures as tags and ``eval.run_id``.

Bad input (unknown URI/alias, a checkpoint that does not fit the data, an eval LM or featurizer that cannot
be loaded offline, too few samples for MAUVE, unknown settings) fails in one line before any model is
loaded or Ray starts. Staged evaluation and gated promotion live in ``evaluation/promotion.py``.
"""


from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.data.reader import read_subset
from pipelines.evaluation.config import PPL_METRIC_NAMES, EvalConfig
from pipelines.evaluation.eval_lm import is_hub_model
from pipelines.evaluation.executors import LocalExecutor, RayExecutor
from pipelines.evaluation.jobs import (
    JobSettings,
    gen_ppl_job,
    mauve_job,
    ppl_job,
    sample_job,
    sample_segments,
    sample_text,
)
from pipelines.evaluation.metrics import GEN_PPL_DEFINITIONS
from pipelines.evaluation.plan import Plan, plan_evaluation, ppl_key
from pipelines.evaluation.report import EvalResult, plots, summary_markdown, version_tags
from pipelines.evaluation.truth import bound_rows, plan_truth, sample_rows, skips_first, truth_of
from pipelines.storage import cache_dir, is_uri, join, name_of


def make_executor(cfg: EvalConfig, *, in_process: bool, ray_address: str | None = None) -> Any:
    """In this process, or one Ray task per job (``ray_address`` > ``$RAY_ADDRESS`` > a local Ray)."""
    if in_process:
        return LocalExecutor()
    from pipelines.runtime import init_ray

    init_ray(ray_address)
    return RayExecutor(cfg.cpus_per_task, cfg.gpus_per_task)


def job_settings(plan: Plan) -> JobSettings:
    return JobSettings(cfg=plan.cfg, sampler=plan.sampler, sampler_kwargs=plan.sampler_kwargs, length=plan.length,
                       steps=plan.steps,
                       cache_dir=None if is_uri(plan.workdir) else str(cache_dir(plan.workdir)),
                       shared_cache=join(plan.workdir, "cache") if is_uri(plan.workdir) else None,
                       tracking_uri=plan.tracking_uri)


def run_plan(plan: Plan, executor: Any) -> EvalResult:
    """The expensive part: perplexities, samples, gen-PPL, MAUVE."""
    cfg, suite, settings = plan.cfg, plan.suite, job_settings(plan)
    model = plan.ref.pinned  # each task resolves it on the node where it runs
    from adlm_model.kinds import parameter_count

    large_model = parameter_count(plan.model_cfg) >= cfg.gpu_min_params
    metrics: dict[str, float] = {}
    table: list[dict[str, Any]] = []
    ppl_keys: dict[str, str] = {}
    from adlm_model.kinds import model_kind

    bound = model_kind(plan.model_cfg.kind).diffusion  # diffusion figures are upper bounds (METHOD.md section 1)

    # -- perplexities ------------------------------------------------------------------------------------
    jobs, owners = [], []
    for ds in plan.datasets:
        n = min(cfg.max_rows, ds.rows) if cfg.max_rows else ds.rows
        chunk = n if not cfg.rows_per_task else math.ceil(cfg.rows_per_task / cfg.batch_size) * cfg.batch_size
        for start in range(0, n, max(chunk, 1)):
            jobs.append({"model": model, "split_dir": ds.split_dir, "start": start, "stop": min(n, start + chunk),
                         "settings": settings})
            owners.append(ds)
    if jobs:
        total_rows = sum(j["stop"] - j["start"] for j in jobs)
        results = executor.run(ppl_job, jobs, "NELBO scoring", unit="row", total_units=total_rows, progress_kw="rows",
                               large=large_model)
        for ds in plan.datasets:
            from pipelines.evaluation.metrics import PooledNLL

            pooled = PooledNLL()
            rows = 0
            for r, owner in zip(results, owners, strict=True):
                if owner is ds:
                    pooled.add(r["nll_sum"], r["n_tokens"])
                    rows += r["rows"]
            prefix = PPL_METRIC_NAMES.get(ds.label, ds.label.replace("zero_shot/", "zero_shot_"))
            metrics.update({f"{prefix}_ppl": pooled.ppl, f"{prefix}_nll": pooled.nll,
                            f"{prefix}_tokens": float(pooled.n_tokens), f"{prefix}_rows": float(rows)})
            table.append({"quantity": f"{ds.label} PPL", "value": pooled.ppl, "bound": bound,
                          "details": f"{pooled.n_tokens} tokens, {rows} rows, {cfg.t_draws} t draw(s)/sequence, "
                                     f"seed {cfg.seed}, {'EMA' if cfg.use_ema else 'raw'} weights, {ds.source}"})
            ppl_keys[ds.label] = ppl_key(ds, cfg)
            truth = truth_of(ds.split_dir)  # a testbed split: the bound against the exact entropy
            if truth is not None:
                m, rows_ = bound_rows(prefix, ds.label, pooled.nll, truth, skips_first(plan.model_cfg))
                metrics.update(m)
                table.extend(rows_)

    # -- samples -----------------------------------------------------------------------------------------
    samples: list[dict[str, Any]] = []
    if "generate" in suite:
        from pipelines.evaluation.metrics import unigram_entropy

        sizes = [min(cfg.sample_batch_size, cfg.num_samples - s) for s in range(0, cfg.num_samples, cfg.sample_batch_size)]
        jobs = [{"model": model, "batch_index": i, "n": n, "settings": settings} for i, n in enumerate(sizes)]
        batches = executor.run(sample_job, jobs, f"sampling ({plan.sampler}, T={plan.steps})", unit="sample", large=large_model,
                               total_units=cfg.num_samples, progress_kw="steps", step_total=plan.steps + 1)
        ids = np.concatenate(batches, axis=0)
        for i, row in enumerate(ids):
            segs = sample_segments(row, plan.tokenizer)
            samples.append({"index": i, "text": "\n\n".join(segs), "segments": segs, "ids": row.tolist(),
                            "entropy": unigram_entropy(row)})
        metrics["entropy"] = float(np.mean([s["entropy"] for s in samples]))
        metrics["num_samples"] = float(len(samples))
        table.append({"quantity": "unigram entropy (nats)", "value": metrics["entropy"], "bound": False,
                      "details": f"mean over {len(samples)} samples of length {plan.length}; sampler {plan.sampler}, "
                                 f"T={plan.steps}, p={cfg.nucleus_p}"})
        truth = plan_truth(plan)
        if truth is not None and plan.length == truth["length"]:  # testbed data: the samples under the truth
            m, rows_ = sample_rows(ids, truth)
            metrics.update(m)
            table.extend(rows_)
    if "gen_ppl" in suite:
        r = executor.run(gen_ppl_job, [{"texts": [s["segments"] for s in samples], "settings": settings}],
                         f"gen-PPL ({cfg.eval_lm})", large=is_hub_model(cfg.eval_lm))[0]
        metrics.update({"gen_ppl": r["gen_ppl"], "gen_nll": r["nll_sum"] / max(r["n_tokens"], 1),
                        "gen_tokens": float(r["n_tokens"]), "gen_truncated": float(r["n_truncated"])})
        table.append({"quantity": "gen PPL", "value": r["gen_ppl"], "bound": False,
                      "details": f"eval LM {cfg.eval_lm}; sampler {plan.sampler}, T={plan.steps}, p={cfg.nucleus_p}, "
                                 f"{len(samples)} samples, entropy {metrics['entropy']:.3f}; {r['n_tokens']} tokens "
                                 f"pooled, EOS targets excluded, truncated to {r['max_length']}, "
                                 f"{GEN_PPL_DEFINITIONS[r['first_token']]}"})
    if "mauve" in suite:
        ref_ids, _ = read_subset(plan.reference_split, len(samples), 0, len(samples))  # spread over the split
        refs = [sample_text(row, plan.tokenizer) for row in ref_ids]
        r = executor.run(mauve_job, [{"sample_texts": [s["text"] for s in samples], "reference_texts": refs,
                                      "settings": settings}], f"MAUVE ({cfg.mauve_featurizer})", large=is_hub_model(cfg.mauve_featurizer))[0]
        metrics.update({"mauve": r["mauve"], "mauve_frontier_integral": r["frontier_integral"]})
        table.append({"quantity": "MAUVE", "value": r["mauve"], "bound": False,
                      "details": f"featurizer {r['featurizer']}; {r['n_samples']} samples vs {r['n_samples']} "
                                 f"{name_of(plan.reference_split)} texts; {r['num_buckets']} buckets, "
                                 f"c={cfg.mauve_scaling}"})
    settings_out = {**dataclasses.asdict(cfg), "sampler": plan.sampler, "sampler_kwargs": plan.sampler_kwargs,
                    "length": plan.length, "steps": plan.steps}
    settings_out.update({"suite": list(suite), "model": plan.ref.uri, "checkpoint": plan.ref.local_dir, "kind": plan.model_cfg.kind,
                         "executor": executor.name, "num_samples": cfg.num_samples,
                         "datasets": {d.label: {"split_dir": d.split_dir, "manifest_hash": d.manifest_hash}
                                      for d in plan.datasets}})
    return EvalResult(model=plan.ref.uri, suite=suite, metrics=metrics, table=table, settings=settings_out,
                      version=plan.ref.version, samples=samples, ppl_keys=ppl_keys)


def log_result(result: EvalResult, plan: Plan, *, stage: str | None = None, tag_version: bool = True) -> str:
    """An MLflow evaluation run with metrics, params, summary, samples and plots; returns its id.

    The run is tagged with the model name/version/URI; a registry version gets ``eval.run_id`` (or
    ``eval.stageN.run_id``) and, when ``tag_version``, the headline figures.
    """
    from pipelines.tracking import client as mlflow_client
    from pipelines.tracking import ensure_experiment, resolve_tracking_uri

    plan.tracking_uri = plan.tracking_uri or resolve_tracking_uri(plan.workdir)
    client = mlflow_client(plan.tracking_uri)
    exp = ensure_experiment(plan.cfg.experiment, plan.tracking_uri, plan.workdir)
    ref = plan.ref
    label = f"{ref.name}-v{ref.version}" if ref.version else Path(ref.local_dir).name
    tags = {"model_uri": ref.uri, "checkpoint": ref.local_dir, "eval.suite": ",".join(result.suite),
            "model_kind": plan.model_cfg.kind}
    if ref.version:
        tags.update({"model_name": ref.name, "model_version": ref.version})
        if ref.run_id:
            tags["training_run_id"] = ref.run_id
    if stage:
        tags["eval.stage"] = stage
    run = client.create_run(exp, run_name=f"eval-{label}" + (f"-stage{stage}" if stage else ""), tags=tags)
    rid = run.info.run_id
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    params = {k: (json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v))[:6000]
              for k, v in result.settings.items() if k != "datasets"}
    client.log_batch(rid, metrics=[Metric(k, float(v), now, 0) for k, v in result.metrics.items()
                                   if v is not None and math.isfinite(float(v))],
                     params=[Param(k, v) for k, v in params.items()])
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        (out / "summary.md").write_text(summary_markdown(result))
        (out / "summary.json").write_text(json.dumps({"model": result.model, "suite": list(result.suite),
                                                      "metrics": result.metrics, "table": result.table,
                                                      "settings": result.settings}, indent=2, sort_keys=True))
        if result.samples:
            with open(out / "samples.jsonl", "w") as f:
                for s in result.samples:
                    f.write(json.dumps({k: s[k] for k in ("index", "text", "ids", "entropy")}) + "\n")
        plots(result, out)
        client.log_artifacts(rid, str(out))
    client.set_terminated(rid)
    if ref.version:
        key = f"eval.stage{stage}.run_id" if stage else "eval.run_id"
        client.set_model_version_tag(ref.name, ref.version, key, rid)
        if tag_version:
            for k, v in version_tags(result, plan.cfg).items():
                client.set_model_version_tag(ref.name, ref.version, k, v)
    result.run_id = rid
    return rid


def evaluate_model(model: str, suite: str | Sequence[str] = ("ppl",), cfg: EvalConfig | None = None, *,
                   workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
                   in_process: bool = False, ray_address: str | None = None, log: bool = True,
                   stage: str | None = None, tag_version: bool = True) -> EvalResult:
    """Evaluate ``model`` (``models:/name@alias``, ``models:/name/N`` or a checkpoint directory).

    Checks everything first (``plan_evaluation``), then runs on Ray (or in this process), then logs an
    MLflow run (``log=True``) and tags a registry version. Returns the metrics, the table and the samples.
    """
    cfg = cfg or EvalConfig()
    plan = plan_evaluation(model, suite, cfg, workdir=workdir, tracking_uri=tracking_uri)
    executor = make_executor(cfg, in_process=in_process, ray_address=ray_address)
    result = run_plan(plan, executor)
    if log:
        log_result(result, plan, stage=stage, tag_version=tag_version)
    return result
