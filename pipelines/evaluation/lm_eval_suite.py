"""The ``lm-eval`` suite: EleutherAI's lm-evaluation-harness tasks on the project's adapter (``lm_eval_model``).

``--suite lm-eval --tasks lambada_openai,piqa`` runs the harness's own task definitions (they download their
data: network needed); without ``--tasks`` the offline tasks of ``lm_eval_tasks/`` (the group
``adlm_offline``: ``adlm_lastword``, ``adlm_choice``, ``adlm_generate``, made from the embedded corpus's test
split). Task names and the adapter's settings are checked before any model loads. Every task's figures and
the harness's standard errors become metrics ``lm_eval.TASK.METRIC`` / ``lm_eval.TASK.METRIC_stderr`` and
version tags; for the diffusion kinds each task also gets the Monte Carlo error of its log-likelihoods
(``lm_eval.TASK.mc_stderr``: the root mean square of the per-request standard errors, nats;
``lm_eval.TASK.mc_stderr_of_mean``: that of the task's mean log-likelihood; ``lm_eval.TASK.mc_samples`` draws a
request).

No process pool: the harness's bootstrap standard errors (perplexity and the other non-mean metrics) fork a
``multiprocessing`` pool unless ``DISABLE_MULTIPROC`` is set, and a fork of a multi-threaded Ray worker can
deadlock (seen: 20 minutes, a child on a futex). ``single_process_harness`` sets it around every run: the
harness then draws the same resamples (a ``random.Random(i)`` per chunk of 1,000, ``lm_eval_bootstrap_iters``
in all) in one loop, so the ``_stderr`` figures are the ones the pool would give (the standard deviation of
the metric over the resamples), only computed serially (1,000 resamples of a few hundred documents: well
under a second).
"""

from __future__ import annotations

import contextlib
import difflib
import math
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from adlm_model.kinds import get_sampler
from pipelines.core.runtime import environ
from pipelines.evaluation.config import EvalConfig, EvalError, resolve_sampler, sampling_steps

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
"""The offline tasks (YAML over local files made by ``lm_eval_data``)."""
OFFLINE_GROUP = "adlm_offline"


def tasks_of(cfg: EvalConfig) -> list[str]:
    return list(cfg.lm_eval_tasks) or [OFFLINE_GROUP]


def include_paths(cfg: EvalConfig) -> list[str]:
    return [str(TASK_DIR), *[p for p in cfg.lm_eval_include_path.split(":") if p and p != str(TASK_DIR)]]


def adapter_settings(cfg: EvalConfig, kind: str | None = None) -> dict[str, Any]:
    """The adapter's ``--model_args`` from the evaluation's settings (one source for both CLIs)."""
    # lazy: keeps lm_eval, tqdm out of this module's import
    from pipelines.evaluation.lm_eval_model import AdapterSettings

    steps = sampling_steps(cfg, kind)
    s = AdapterSettings(mc_samples=cfg.lm_eval_mc_samples, mask_draws=cfg.lm_eval_mask_draws,
                        batch_size=cfg.lm_eval_batch_size, device=cfg.device, dtype=cfg.lm_eval_dtype, seed=cfg.seed,
                        use_ema=cfg.use_ema, greedy_max_tokens=cfg.lm_eval_greedy_max_tokens, t_draws=cfg.t_draws,
                        sampler=cfg.sampler, steps=steps, nucleus_p=cfg.nucleus_p,
                        sampler_kwargs=dict(cfg.sampler_kwargs))
    return vars(s.validate())


def _our_tasks() -> set[str]:
    """The offline tasks, their group and their tag."""
    return {p.stem for p in TASK_DIR.glob("*.yaml")} | {"adlm_offline_tasks"}


def _task_manager(cfg: EvalConfig, names: list[str]) -> Any:
    """The harness's task index: only ours when every name is ours (indexing its ~15,000 tasks takes ~20 s)."""
    # lazy: keeps lm_eval out of this module's import
    from lm_eval.tasks import TaskManager

    local_only = all(n in _our_tasks() for n in names) and not cfg.lm_eval_include_path
    return TaskManager(include_path=include_paths(cfg), include_defaults=not local_only)


def check_lm_eval(cfg: EvalConfig, tracking_uri: str | None) -> None:
    """The harness is installed, every task name is known to it, the adapter's settings are valid: one line
    each, before any model loads."""
    try:
        # lazy: optional: lm_eval may be absent, and that is handled
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise EvalError("suite lm-eval needs the harness: pip install lm-eval==0.4.13") from e
    adapter_settings(cfg)
    if cfg.lm_eval_limit < 0:
        raise EvalError(f"lm_eval_limit must be >= 0 (0: every document), got {cfg.lm_eval_limit}")
    names = tasks_of(cfg)
    ours = _our_tasks()
    # A name in our namespace is ours or unknown: no need to index the harness's ~15,000 tasks (~20 s) for it.
    unknown = [n for n in names if n.startswith("adlm_") and n not in ours]
    known = ours
    if not unknown:
        tm = _task_manager(cfg, names)
        known = set(tm.all_tasks)
        unknown = [n for n in names if n not in known]
    if unknown:
        hints = {n: difflib.get_close_matches(n, known, n=3) for n in unknown}
        said = "; ".join(f"{n} (close: {', '.join(h)})" if h else n for n, h in hints.items())
        raise EvalError(f"unknown lm-eval task {said}: list them with lm-eval ls tasks, or pass --tasks with names "
                        f"from {TASK_DIR.name}/ ({OFFLINE_GROUP}) offline")


NO_PROCESS_POOL = {"DISABLE_MULTIPROC": "1", "LMEVAL_DISABLE_MULTIPROC": "1"}
"""What makes lm-eval 0.4.13 bootstrap in one loop (``lm_eval.api.metrics.bootstrap_stderr`` reads the first;
``lm_eval.defaults`` the second)."""


@contextlib.contextmanager
def single_process_harness() -> Iterator[None]:
    """The harness without its process pool while inside (module docstring); the environment restored after."""
    with environ(NO_PROCESS_POOL):
        yield


def lm_eval_job(model: str, settings: Any, adapter: dict[str, Any], tasks: list[str]) -> dict[str, Any]:
    """Load the model into the adapter, run the harness on ``tasks``; figures per task and the adapter's Monte
    Carlo errors (plain JSON types: what a Ray task returns)."""
    # lazy: keeps lm_eval, tqdm out of this module's import
    from pipelines.evaluation.lm_eval_model import ADLMEvalLM

    cfg = settings.cfg
    lm = ADLMEvalLM(pretrained=model, tracking_uri=settings.tracking_uri, **adapter)
    # The harness prints progress notes on stdout; ours carries only results (``--json``): they go to stderr.
    with contextlib.redirect_stdout(sys.stderr), single_process_harness():
        out = _evaluate(lm, cfg, tasks)
    figures: dict[str, dict[str, float]] = {}
    for task, res in out["results"].items():
        for key, value in res.items():
            if "," not in key or not isinstance(value, (int, float, np.floating)) or isinstance(value, bool):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}_{filt}"
            figures.setdefault(task, {})[name] = float(value)
    mc: dict[str, dict[str, float]] = {}
    for task in {s["task"] for s in lm.stats}:
        ses = [s["stderr"] for s in lm.stats if s["task"] == task]
        mc[task] = {"requests": float(len(ses)), "mc_stderr": math.sqrt(sum(x * x for x in ses) / len(ses)),
                    "mc_stderr_of_mean": math.sqrt(sum(x * x for x in ses)) / len(ses),
                    "mc_samples": float(lm.stats[0]["samples"])}
    n_docs = {t: int(v.get("effective", v.get("original", 0))) for t, v in (out.get("n-samples") or {}).items()}
    return {"figures": figures, "mc": mc, "n_docs": n_docs, "adapter": lm.describe(),
            "version": str(out.get("lm_eval_version") or _version())}


def _evaluate(lm: Any, cfg: EvalConfig, tasks: list[str]) -> dict[str, Any]:
    # lazy: keeps lm_eval out of this module's import
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=tasks, task_manager=_task_manager(cfg, tasks),
                           limit=cfg.lm_eval_limit or None,
                           num_fewshot=cfg.lm_eval_num_fewshot if cfg.lm_eval_num_fewshot >= 0 else None,
                           bootstrap_iters=cfg.lm_eval_bootstrap_iters, log_samples=False, random_seed=cfg.seed,
                           numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed)


def _version() -> str:
    return version("lm_eval")


def generation_label(adapter: dict[str, Any]) -> str:
    """How a generative task's answers were made (the adapter's ``describe()``): the sampler and its steps."""
    sampler = resolve_sampler(str(adapter.get("sampler", "auto")), str(adapter.get("kind")))
    steps = f", T={adapter.get('steps')}" if get_sampler(sampler).steps else ""
    return f"generated by the {sampler} sampler{steps}, nucleus_p {adapter.get('nucleus_p')}"


def run_lm_eval(state: Any) -> None:
    cfg, plan = state.cfg, state.plan
    tasks = tasks_of(cfg)
    adapter = adapter_settings(cfg, plan.model_cfg.kind)
    r = state.executor.run(lm_eval_job, [{"model": state.model, "settings": state.settings, "adapter": adapter,
                                          "tasks": tasks}], f"lm-eval ({', '.join(tasks)})",
                           large=state.large_model)[0]
    exact = r["adapter"]["exact"]
    accs = []
    for task in sorted(r["figures"]):
        figs, mc = r["figures"][task], r["mc"].get(task)
        for name in sorted(k for k in figs if not k.endswith("_stderr")):
            value, se = figs[name], figs.get(f"{name}_stderr")
            state.metrics[f"lm_eval.{task}.{name}"] = value
            if se is not None and math.isfinite(se):
                state.metrics[f"lm_eval.{task}.{name}_stderr"] = se
            if mc is None:  # a generative task (generate_until): no log-likelihood was computed
                how = generation_label(r["adapter"])
            elif exact:
                how = "exact log-likelihoods (AR)"
            else:
                how = (f"MC ELBO, {int(mc['mc_samples'])} {adapter['mask_draws']} draws/request, MC stderr "
                       f"{mc['mc_stderr']:.4f} nats/request (rms)")
            state.row(f"lm-eval {task} {name}", value,
                      f"{r['n_docs'].get(task, '?')} docs; {how}; ± = harness stderr; lm-eval {r['version']}",
                      stderr=se if se is not None and math.isfinite(se) else None)
            if name == "acc":
                accs.append(value)
        if mc is not None and not exact:
            state.metrics[f"lm_eval.{task}.mc_stderr"] = mc["mc_stderr"]
            state.metrics[f"lm_eval.{task}.mc_stderr_of_mean"] = mc["mc_stderr_of_mean"]
            state.metrics[f"lm_eval.{task}.mc_samples"] = mc["mc_samples"]
    if accs:
        state.metrics["lm_eval.acc_mean"] = float(np.mean(accs))
    state.settings_out["lm_eval"] = {"tasks": tasks, "adapter": r["adapter"], "version": r["version"],
                                     "limit": cfg.lm_eval_limit, "num_fewshot": cfg.lm_eval_num_fewshot}


def lm_eval_tags(result: Any, cfg: EvalConfig) -> dict[str, str]:
    """``lm_eval.TASK.METRIC`` = ``value ± stderr`` per figure, and the settings they were measured with."""
    m = result.metrics
    tags = {}
    for k, v in m.items():
        if k.startswith("lm_eval.") and not k.endswith(("_stderr", ".mc_samples", "_of_mean")) and k.count(".") == 2:
            se = m.get(f"{k}_stderr")
            tags[k] = f"{v:.6g}" + (f" ± {se:.3g}" if se is not None else "")
    s = (result.settings.get("lm_eval") or {}).get("adapter", {})
    tags["lm_eval.settings"] = (f"tasks={','.join(tasks_of(cfg))} limit={cfg.lm_eval_limit or 'all'} "
                                f"fewshot={cfg.lm_eval_num_fewshot if cfg.lm_eval_num_fewshot >= 0 else 'task'} "
                                + ("exact (AR)" if s.get("exact") else
                                   f"mc_samples={cfg.lm_eval_mc_samples} mask_draws={cfg.lm_eval_mask_draws}")
                                + f" seed={cfg.seed}")
    return tags
