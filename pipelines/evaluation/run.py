"""Evaluate a checkpoint or a registered model version; stage and promote registry versions.

Suites (one table: ``evaluation/suites.py``; every metric has exactly the definition of docs/design/method.md, section 6; ``evaluation/metrics.py``):

- ``ppl``: the NELBO bound ``PPL <= exp(sum NELBO / tokens)`` on prepared splits (docs/design/method.md, section 1):
  EMA weights, ``t`` stratified inside each batch, a fixed seed per batch (so the figure does not depend
  on how batches are spread over workers), optionally ``t_draws`` draws per sequence, tokens pooled
  exactly (float64 sums). AR models report their exact NLL perplexity.
- ``zero_shot``: the same over every prepared zero-shot set (``zero_shot=``), one table.
- ``generate``: ``num_samples`` samples with any sampler of ``adlm_model.sampling.samplers``; ids and decoded texts
  are saved as ``samples.jsonl`` with the settings; the mean unigram entropy is always reported.
- ``gen_ppl``: an evaluation causal LM (``eval_lm=``: ``gpt2-large`` by default; ``smollm2`` offline; a
  local model; an AR checkpoint) scores the decoded samples; reported with entropy, sampler, T, p, count.
- ``mauve``: ``mauve-text`` on features of the samples vs as many validation texts (``mauve_featurizer=``).
- ``lm-eval``: EleutherAI's lm-evaluation-harness tasks through the project's adapter
  (``evaluation/lm_eval_model.py``; ``lm_eval_tasks=``, offline tasks by default).

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

from adlm_model.kinds import parameter_count
from pipelines.core.placement import check_task
from pipelines.core.runtime import init_ray
from pipelines.core.storage import cache_dir, is_uri, join
from pipelines.evaluation.config import EvalConfig
from pipelines.evaluation.executors import JobDeadlineError, LocalExecutor, RayExecutor
from pipelines.evaluation.jobs import JobSettings
from pipelines.evaluation.plan import Plan, plan_evaluation
from pipelines.evaluation.report import EvalResult, plots, summary_markdown, version_tags
from pipelines.evaluation.suites import SUITES, RunState
from pipelines.tracking.runs import client as mlflow_client
from pipelines.tracking.runs import ensure_experiment, resolve_tracking_uri


def make_executor(cfg: EvalConfig, *, in_process: bool, ray_address: str | None = None) -> Any:
    """In this process, or one Ray task per job (``ray_address`` > ``$RAY_ADDRESS`` > a local Ray)."""
    if in_process:
        return LocalExecutor()
    init_ray(ray_address)
    # A task no node can take would wait for good on a Ray that will not grow: refused now, in one line.
    check_task({"CPU": float(cfg.cpus_per_task), "GPU": max(float(cfg.gpus_per_task), 0.0)}, "the evaluation",
               "--set cpus_per_task=..., gpus_per_task=...")
    return RayExecutor(cfg.cpus_per_task, cfg.gpus_per_task, cfg.job_timeout_s)


def job_settings(plan: Plan) -> JobSettings:
    return JobSettings(cfg=plan.cfg, sampler=plan.sampler, sampler_kwargs=plan.sampler_kwargs, length=plan.length,
                       steps=plan.steps,
                       cache_dir=None if is_uri(plan.workdir) else str(cache_dir(plan.workdir)),
                       shared_cache=join(plan.workdir, "cache") if is_uri(plan.workdir) else None,
                       tracking_uri=plan.tracking_uri)


def run_plan(plan: Plan, executor: Any) -> EvalResult:
    """The expensive part: each chosen suite of the table (``suites.SUITES``) in canonical order; the NELBO of
    the planned datasets and the samples are computed once, by the first suite that needs them."""
    cfg = plan.cfg
    state = RunState(plan=plan, executor=executor, settings=job_settings(plan),
                     large_model=parameter_count(plan.model_cfg) >= cfg.gpu_min_params)
    for name in plan.suite:
        try:
            SUITES[name].run(state)
        except JobDeadlineError as e:
            raise JobDeadlineError(f"evaluation of {plan.ref.uri}, suite {name}: {e}") from None
    settings_out = {**dataclasses.asdict(cfg), "sampler": plan.sampler, "sampler_kwargs": plan.sampler_kwargs,
                    "length": plan.length, "steps": plan.steps}
    settings_out.update({"suite": list(plan.suite), "model": plan.ref.uri, "checkpoint": plan.ref.local_dir,
                         "kind": plan.model_cfg.kind, "executor": executor.name, "num_samples": cfg.num_samples,
                         "datasets": {d.label: {"split_dir": d.split_dir, "manifest_hash": d.manifest_hash}
                                      for d in plan.datasets}, **state.settings_out})
    return EvalResult(model=plan.ref.uri, suite=plan.suite, metrics=state.metrics, table=state.table,
                      settings=settings_out, version=plan.ref.version, samples=state.samples,
                      ppl_keys=state.ppl_keys, artifacts=state.artifacts)


def log_result(result: EvalResult, plan: Plan, *, stage: str | None = None, tag_version: bool = True) -> str:
    """An MLflow evaluation run with metrics, params, summary, samples and plots; returns its id.

    The run is tagged with the model name/version/URI; a registry version gets ``eval.run_id`` (or
    ``eval.stageN.run_id``) and, when ``tag_version``, the headline figures.
    """
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
    # lazy: keeps mlflow out of this module's import
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
        result.write_artifacts(out)
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
