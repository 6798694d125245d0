"""The evaluation metrics as one table: every suite of ``--suite`` is one ``Suite`` entry of ``SUITES``.

An entry says what the suite needs (the suites it implies, the checks it runs before any weights load), how it
runs (on a ``RunState``: the plan, the executor, and the resources several suites share: the NELBO of the
planned datasets, the samples), how it is reported and tagged (its headline figures, its version tags, the
definitions printed next to its figures) and whether, and in which direction, it may gate promotion
(``Gate``). The planner (``plan.py``), the runner (``run.py``), the report (``report.py``) and promotion
(``promotion.py``) read this table and nothing else: adding a metric is one ``register_suite`` call plus its
function. Every figure keeps its single definition in ``metrics.py`` (docs/design/method.md, section 6), and its one description
(``Figure``: label, summary column, definition, settings tags) here, which the model card and the summary read.

Longer than 500 lines because it is the one table: every suite's entry (its checks, run, tags and figures) sits
beside the others, so that a new metric is one place to read and one to add.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adlm_model.kinds import KINDS, SAMPLERS, check_sampler_kind, check_sampler_options, model_kind, sampler_fits
from adlm_model.sampling.samplers import SamplerError
from pipelines.core.storage import join, name_of
from pipelines.data.manifest import read_manifest
from pipelines.data.reader import read_subset
from pipelines.evaluation import accuracy, lm_eval_suite
from pipelines.evaluation.config import (
    PPL_METRIC_NAMES,
    EvalConfig,
    EvalError,
    resolve_sampler,
    sampler_options,
    sampling_steps,
)
from pipelines.evaluation.datasets import discover_zero_shot, has_manifest, ppl_key
from pipelines.evaluation.eval_lm import check_eval_lm, check_featurizer, checkpoint_tokenizer, is_hub_model
from pipelines.evaluation.jobs import (
    gen_ppl_job,
    long_sample_job,
    mauve_job,
    ppl_job,
    sample_job,
    sample_segments,
    sample_text,
)
from pipelines.evaluation.metrics import (
    GEN_PPL_DEFINITIONS,
    MAUVE_MIN_SAMPLES,
    PooledNLL,
    check_mauve_inputs,
    reached_length,
    unigram_entropy,
)
from pipelines.evaluation.truth import bound_rows, plan_truth, sample_rows, skips_first, truth_of


@dataclass(frozen=True)
class Gate:
    """A bound promotion puts on one figure: ``min`` (the figure must be at least the bound) or ``max`` (at
    most). The bound is the ``PromotionConfig`` field named ``setting``, else ``PromotionConfig.bounds[setting]``
    (``--set gate.NAME=VALUE``); no bound set: no gate. A figure that is NaN never passes."""

    metric: str
    direction: str
    setting: str
    label: str = ""

    def reason(self, value: float, bound: float) -> str | None:
        """Why ``value`` fails this gate, or None."""
        ok = value >= bound if self.direction == "min" else value <= bound
        if ok:
            return None
        side = "below" if self.direction == "min" else "above"
        return f"gate: {self.label or self.metric} {value:.4f} {side} the bound {bound:g}"


PPL = "ppl"
"""A figure's definition that is the perplexity of the model's kind (a bound for a diffusion kind, exact for AR):
the model card words it for the kind."""


@dataclass(frozen=True)
class Figure:
    """A figure a suite records on a registry version (a version tag): its one description, which the model card
    (``serving/export.py``), the pipeline's summary (``orchestration/summary.py``) and the version's tags read."""

    tag: str
    """The version tag; with ``family``, a regular expression of a family's tags whose group 1 names the member
    (one a task, one a zero-shot set)."""
    label: str
    """Its name on the model card (a family's: ``{}`` is the member)."""
    column: str = ""
    """Its column in the pipeline's summary ('': none)."""
    definition: str = PPL
    """What it measures (docs/design/method.md, sections 1 and 6), in one paragraph; ``PPL``: the perplexity of the kind."""
    settings: tuple[str, ...] = ()
    """The version tags that say how it was measured."""
    family: bool = False

    def member(self, tag: str) -> str | None:
        """The member ``tag`` is of this figure (the tag itself for a single figure), or None."""
        if not self.family:
            return tag if tag == self.tag else None
        m = re.fullmatch(self.tag, tag)
        return m.group(1) if m else None


@dataclass(frozen=True)
class Suite:
    """One evaluation suite (a row of the table)."""

    name: str
    description: str
    """One line for ``--help``."""
    run: Callable[[RunState], None]
    """Adds its figures to ``state.metrics`` and its rows to ``state.table``."""
    implies: tuple[str, ...] = ()
    """Suites it needs (registered before it): ``gen_ppl`` implies ``generate``."""
    check: Callable[[EvalConfig, str | None], None] | None = None
    """Model-free checks of the settings (``cfg, tracking_uri``): run by the planner and by ``--stage-all``
    before any version is touched."""
    plan: Callable[[Any], None] | None = None
    """Checks against the resolved model that fill the plan (``plan.Plan``: datasets, sampler, ...)."""
    headline: tuple[str, ...] = ()
    """Figures tagged on the registry version (``%.6g``) and shown in promotion's outcome; empty: its single
    ``figures`` (what the card and the summary describe is what the version is tagged with)."""
    tags: Callable[[Any, EvalConfig], dict[str, str]] | None = None
    """More version tags (``result, cfg``): the settings its figures were measured with."""
    definitions: Callable[[EvalConfig], dict[str, str]] | None = None
    """Figure -> its definition, where one number can mean several things (gen-PPL)."""
    gates: tuple[Gate, ...] = ()
    available: Callable[[EvalConfig], bool] | None = None
    """Promotion's full stage skips the suite when this says False (``zero_shot`` without sets)."""
    in_stage2: bool = True
    """Part of promotion's default full stage (``PromotionConfig.stage2_suite``)."""
    auto: Callable[[Any], bool] | None = None
    """Joins the chosen suites on its own when this says True of the plan (``truth``: on testbed data)."""
    figures: tuple[Figure, ...] = ()
    """The figures it records on a version, described once (the model card and the summary list them)."""
    likelihood: bool = False
    """Scores the model's likelihood (its bound or NLL): refused for a sample-only kind (``ModelKind.sample_only``)."""

    def __post_init__(self) -> None:
        if not self.headline:
            object.__setattr__(self, "headline", tuple(f.tag for f in self.figures if not f.family))


SUITES: dict[str, Suite] = {}
"""Every suite, in canonical (registration) order: the order they run and are reported in."""


def register_suite(suite: Suite) -> Suite:
    """Add ``suite`` to the table (a name registered again is replaced in place)."""
    missing = [s for s in suite.implies if s not in SUITES]
    if missing:
        raise ValueError(f"suite {suite.name!r} implies unregistered suites {missing}: register them first")
    SUITES[suite.name] = suite
    return suite


def figures() -> list[Figure]:
    """Every suite's figures, in the suites' order."""
    return [f for suite in SUITES.values() for f in suite.figures]


def figures_of(tags: dict[str, str]) -> dict[str, tuple[Figure, str]]:
    """The figures among a version's tags: tag -> (its figure, its member), in the suites' order (a family's
    members sorted)."""
    out: dict[str, tuple[Figure, str]] = {}
    for f in figures():
        found = sorted((t, f.member(t)) for t in tags if f.member(t) is not None)
        out.update({t: (f, m) for t, m in found if t not in out})
    return out


def parse_suite(suite: str | Sequence[str]) -> tuple[str, ...]:
    """Suite names in canonical order, with the suites they imply."""
    items = [s.strip() for s in (suite.split(",") if isinstance(suite, str) else suite) if s.strip()]
    unknown = [s for s in items if s not in SUITES]
    if unknown or not items:
        raise EvalError(f"unknown suite {', '.join(unknown) or '(empty)'}: use a comma list of {', '.join(SUITES)}")
    chosen: set[str] = set()
    todo = list(items)
    while todo:
        s = todo.pop()
        if s not in chosen:
            chosen.add(s)
            todo.extend(SUITES[s].implies)
    return tuple(s for s in SUITES if s in chosen)


def check_suites(suite: Sequence[str], cfg: EvalConfig, tracking_uri: str | None) -> None:
    """Every model-free check of ``suite`` (one-line errors, nothing loaded)."""
    for name in suite:
        if SUITES[name].check is not None:
            SUITES[name].check(cfg, tracking_uri)


def default_stage2() -> tuple[str, ...]:
    return tuple(s.name for s in SUITES.values() if s.in_stage2)


def suites_help() -> str:
    return "; ".join(f"{s.name}: {s.description}" for s in SUITES.values())


# ----------------------------------------------------------------------------------------------------------
# What a suite's run sees.


@dataclass
class RunState:
    """One evaluation in progress: the plan, the executor, the figures so far, and the resources several
    suites share, computed once on first use (``nelbo``, ``draw_samples``)."""

    plan: Any
    executor: Any
    settings: Any
    """``jobs.JobSettings`` (pickled into every task)."""
    large_model: bool = False
    """The model asks for a GPU per task (``EvalConfig.gpu_min_params``)."""
    metrics: dict[str, float] = field(default_factory=dict)
    table: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    ppl_keys: dict[str, str] = field(default_factory=dict)
    settings_out: dict[str, Any] = field(default_factory=dict)
    """Extra settings a suite records with the run (params, summary.json)."""
    artifacts: dict[str, str] = field(default_factory=dict)
    """Files a suite keeps with the evaluation run: artifact path -> text (the accuracy suite's per-row answers)."""
    _nelbo: dict[str, tuple[Any, int]] | None = None
    _sampled: bool = False

    @property
    def cfg(self) -> EvalConfig:
        return self.plan.cfg

    @property
    def model(self) -> str:
        """The pinned URI every task resolves on its node."""
        return self.plan.ref.pinned

    def row(self, quantity: str, value: float, details: str, *, bound: bool = False,
            stderr: float | None = None) -> None:
        self.table.append({"quantity": quantity, "value": value, "bound": bound, "details": details,
                           **({"stderr": stderr} if stderr is not None else {})})

    def nelbo(self) -> dict[str, tuple[Any, int]]:
        """Dataset label -> (``metrics.PooledNLL``, rows) of every planned dataset, scored in one wave of jobs."""
        if self._nelbo is not None:
            return self._nelbo
        cfg = self.cfg
        jobs, owners = [], []
        for ds in self.plan.datasets:
            n = min(cfg.max_rows, ds.rows) if cfg.max_rows else ds.rows
            chunk = n if not cfg.rows_per_task else math.ceil(cfg.rows_per_task / cfg.batch_size) * cfg.batch_size
            for start in range(0, n, max(chunk, 1)):
                jobs.append({"model": self.model, "split_dir": ds.split_dir, "start": start,
                             "stop": min(n, start + chunk), "settings": self.settings})
                owners.append(ds.label)
        results = []
        if jobs:
            total_rows = sum(j["stop"] - j["start"] for j in jobs)
            results = self.executor.run(ppl_job, jobs, "NELBO scoring", unit="row", total_units=total_rows,
                                        progress_kw="rows", large=self.large_model)
        out: dict[str, tuple[Any, int]] = {}
        for ds in self.plan.datasets:
            pooled, rows = PooledNLL(), 0
            for r, owner in zip(results, owners, strict=True):
                if owner == ds.label:
                    pooled.add(r["nll_sum"], r["n_tokens"])
                    rows += r["rows"]
            out[ds.label] = (pooled, rows)
        self._nelbo = out
        return out

    def report_ppl(self, select: Callable[[str], bool]) -> None:
        """Figures and rows of the planned datasets whose label ``select`` accepts."""
        cfg = self.cfg
        bound = model_kind(self.plan.model_cfg.kind).diffusion  # diffusion figures are upper bounds (docs/design/method.md, section 1)
        scored = self.nelbo()
        for ds in self.plan.datasets:
            if not select(ds.label):
                continue
            pooled, rows = scored[ds.label]
            prefix = PPL_METRIC_NAMES.get(ds.label, ds.label.replace("zero_shot/", "zero_shot_"))
            self.metrics.update({f"{prefix}_ppl": pooled.ppl, f"{prefix}_nll": pooled.nll,
                                 f"{prefix}_tokens": float(pooled.n_tokens), f"{prefix}_rows": float(rows)})
            self.row(f"{ds.label} PPL", pooled.ppl,
                     f"{pooled.n_tokens} tokens, {rows} rows, {cfg.t_draws} t draw(s)/sequence, seed {cfg.seed}, "
                     f"{'EMA' if cfg.use_ema else 'raw'} weights, {ds.source}", bound=bound)
            self.ppl_keys[ds.label] = ppl_key(ds, cfg)

    def draw_samples(self) -> list[dict[str, Any]]:
        """``num_samples`` samples (ids, decoded text, documents, unigram entropy), drawn once."""
        if self._sampled:
            return self.samples
        cfg, plan = self.cfg, self.plan
        sizes = [min(cfg.sample_batch_size, cfg.num_samples - s) for s in range(0, cfg.num_samples, cfg.sample_batch_size)]
        jobs = [{"model": self.model, "batch_index": i, "n": n, "settings": self.settings} for i, n in enumerate(sizes)]
        batches = self.executor.run(sample_job, jobs, f"sampling ({plan.sampler}, T={plan.steps})", unit="sample",
                                    large=self.large_model, total_units=cfg.num_samples, progress_kw="steps",
                                    step_total=plan.steps + 1)
        ids = np.concatenate(batches, axis=0)
        for i, row in enumerate(ids):
            segs = sample_segments(row, plan.tokenizer)
            self.samples.append({"index": i, "text": "\n\n".join(segs), "segments": segs, "ids": row.tolist(),
                                 "entropy": unigram_entropy(row)})
        self._sampled = True
        return self.samples


def gen_ppl_definition(cfg: EvalConfig) -> str:
    """The definition printed next to every gen-PPL figure (docs/design/method.md, section 6): the evaluation LM, the
    pooling, the truncation and the first-token convention."""
    return (f"token-pooled NLL under {cfg.eval_lm}, EOS targets excluded, truncated to {cfg.gen_ppl_max_length}, "
            f"{GEN_PPL_DEFINITIONS[cfg.gen_ppl_first_token]}")


# ----------------------------------------------------------------------------------------------------------
# The suites.


def _is_zero_shot(label: str) -> bool:
    return label.startswith("zero_shot/")


def _plan_ppl(plan: Any) -> None:
    data = plan.data_dir()
    splits = list(plan.cfg.splits)
    if splits == ["auto"]:
        splits = [s for s in ("validation", "test") if has_manifest(join(data, s))]
        if not splits:
            raise EvalError(f"no validation or test split under {data}; pass --set data=DIR of prepared data")
    for s in splits:
        plan.add_dataset(s, join(data, s) if not has_manifest(s) else s)


def _ppl_tags(result: Any, cfg: EvalConfig) -> dict[str, str]:
    m, tags = result.metrics, {}
    if "validation" in result.ppl_keys:
        tags["eval.val_key"] = result.ppl_keys["validation"]
    if "val_ppl" in m:
        tags["val_ppl.settings"] = (f"NELBO bound, {int(m['val_tokens'])} tokens, t_draws={cfg.t_draws}, "
                                    f"seed={cfg.seed}, batch={cfg.batch_size}, ema={cfg.use_ema}")
    return tags


def _plan_zero_shot(plan: Any) -> None:
    if not plan.cfg.zero_shot:
        raise EvalError("suite zero_shot needs the prepared zero-shot sets: --set zero_shot=NAME=DIR,... "
                        "(python -m pipelines.prepare_data --source wikitext2 ... --out DIR)")
    for name, split_dir in discover_zero_shot(plan.cfg.zero_shot, plan.workdir):
        plan.add_dataset(f"zero_shot/{name}", split_dir)


def _zero_shot_tags(result: Any, cfg: EvalConfig) -> dict[str, str]:
    return {f"{row['quantity'].split(' ')[0].replace('/', '.')}_ppl": f"{row['value']:.6g}"
            for row in result.table if row["quantity"].startswith("zero_shot/")}


def _plan_generate(plan: Any) -> None:
    cfg, model_cfg = plan.cfg, plan.model_cfg
    plan.tokenizer = checkpoint_tokenizer(plan.ref.local_dir, plan.meta)
    plan.sampler = resolve_sampler(cfg.sampler, model_cfg.kind)
    plan.length = cfg.sample_length or model_cfg.seq_len
    try:  # the confidence sampler's block must divide the length
        sampler = check_sampler_options(plan.sampler, cfg.sampler_kwargs, length=plan.length)
        check_sampler_kind(plan.sampler, model_cfg.kind)
    except SamplerError as e:
        raise EvalError(f"{e} (sampler=auto picks the model kind's default)") from e
    plan.sampler_kwargs = sampler_options(plan.sampler, cfg.sampler_kwargs, plan.tokenizer)
    plan.steps = sampling_steps(cfg, model_cfg.kind, plan.meta)  # a distilled version's own T unless set
    if not sampler.any_length and plan.length > model_cfg.seq_len:
        raise EvalError(f"sample_length {plan.length} exceeds the model's seq_len {model_cfg.seq_len}; only the "
                        "bd3lm sampler generates beyond it")


def _run_generate(state: RunState) -> None:
    samples, plan = state.draw_samples(), state.plan
    state.metrics["entropy"] = float(np.mean([s["entropy"] for s in samples]))
    state.metrics["num_samples"] = float(len(samples))
    state.row("unigram entropy (nats)", state.metrics["entropy"],
              f"mean over {len(samples)} samples of length {plan.length}; sampler {plan.sampler}, T={plan.steps}, "
              f"p={state.cfg.nucleus_p}")


def _generate_tags(result: Any, cfg: EvalConfig) -> dict[str, str]:
    s = result.settings
    return {"gen.settings": (f"sampler={s['sampler']} T={s['steps']} p={s['nucleus_p']} n={len(result.samples)} "
                             f"length={s['length']} seed={s['seed']}"
                             + (f" {json.dumps(s['sampler_kwargs'], sort_keys=True)}" if s["sampler_kwargs"] else ""))}


def _check_gen_ppl(cfg: EvalConfig, tracking_uri: str | None) -> None:
    check_eval_lm(cfg.eval_lm, tracking_uri=tracking_uri)


def _run_gen_ppl(state: RunState) -> None:
    cfg, plan, samples = state.cfg, state.plan, state.draw_samples()
    r = state.executor.run(gen_ppl_job, [{"texts": [s["segments"] for s in samples], "settings": state.settings}],
                           f"gen-PPL ({cfg.eval_lm})", large=is_hub_model(cfg.eval_lm))[0]
    state.metrics.update({"gen_ppl": r["gen_ppl"], "gen_nll": r["nll_sum"] / max(r["n_tokens"], 1),
                          "gen_tokens": float(r["n_tokens"]), "gen_truncated": float(r["n_truncated"])})
    entropy = float(np.mean([s["entropy"] for s in samples]))
    state.row("gen PPL", r["gen_ppl"],
              f"eval LM {cfg.eval_lm}; sampler {plan.sampler}, T={plan.steps}, p={cfg.nucleus_p}, {len(samples)} "
              f"samples, entropy {entropy:.3f}; {r['n_tokens']} tokens pooled, EOS targets excluded, truncated to "
              f"{r['max_length']}, {GEN_PPL_DEFINITIONS[r['first_token']]}")


def _check_mauve(cfg: EvalConfig, tracking_uri: str | None) -> None:
    check_mauve_inputs(cfg.num_samples, cfg.num_samples, cfg.mauve_min_samples)
    check_featurizer(cfg.mauve_featurizer)


def _plan_mauve(plan: Any) -> None:
    data = plan.data_dir()
    ref_dir = plan.cfg.mauve_reference_split
    ref_dir = ref_dir if has_manifest(ref_dir) else join(data, ref_dir)
    m = read_manifest(ref_dir)
    m.check_fits(plan.model_cfg, plan.meta.get("tokenizer_hash"))
    m.check_shards()
    check_mauve_inputs(plan.cfg.num_samples, m.rows, plan.cfg.mauve_min_samples)
    plan.reference_split = m.split_dir


def _run_mauve(state: RunState) -> None:
    cfg, plan, samples = state.cfg, state.plan, state.draw_samples()
    ref_ids, _ = read_subset(plan.reference_split, len(samples), 0, len(samples))  # spread over the split
    refs = [sample_text(row, plan.tokenizer) for row in ref_ids]
    r = state.executor.run(mauve_job, [{"sample_texts": [s["text"] for s in samples], "reference_texts": refs,
                                        "settings": state.settings}], f"MAUVE ({cfg.mauve_featurizer})",
                           large=is_hub_model(cfg.mauve_featurizer))[0]
    state.metrics.update({"mauve": r["mauve"], "mauve_frontier_integral": r["frontier_integral"],
                          "mauve_samples": float(r["n_samples"])})
    # Allowed below the floor (mauve_min_samples lowered: the demo's 16) but said: a handful of histogram
    # buckets over so few points reads near 1 or near 0 by chance (16 samples: 0.9997 and 0.278, seen).
    few = (f"; too few samples for a meaningful figure (< {MAUVE_MIN_SAMPLES}): a wiring check"
           if r["n_samples"] < MAUVE_MIN_SAMPLES else "")
    state.row("MAUVE", r["mauve"], f"featurizer {r['featurizer']}; {r['n_samples']} samples vs {r['n_samples']} "
              f"{name_of(plan.reference_split)} texts; {r['num_buckets']} buckets, c={cfg.mauve_scaling}{few}")


register_suite(Suite(
    "ppl", "NELBO perplexity bound on prepared splits (AR: exact)",
    lambda state: state.report_ppl(lambda label: not _is_zero_shot(label)),
    plan=_plan_ppl, tags=_ppl_tags, likelihood=True,
    figures=(Figure("val_ppl", "Validation perplexity", "validation PPL (bound)",
                    settings=("val_ppl.settings", "eval.val_key")),
             Figure("test_ppl", "Test perplexity"))))
register_suite(Suite(
    "zero_shot", "the same bound on every prepared zero-shot set (zero_shot=)",
    lambda state: state.report_ppl(_is_zero_shot), plan=_plan_zero_shot, tags=_zero_shot_tags, likelihood=True,
    available=lambda cfg: bool(cfg.zero_shot),
    figures=(Figure(r"zero_shot\.(.+)_ppl", "Zero-shot perplexity ({})", settings=("eval.val_key",), family=True),)))
register_suite(Suite(
    "generate", "num_samples samples with the sampler; mean unigram entropy", _run_generate, plan=_plan_generate,
    tags=_generate_tags,
    gates=(Gate("entropy", "min", "entropy_min", "entropy"), Gate("entropy", "max", "entropy_max", "entropy")),
    figures=(Figure("entropy", "Unigram entropy", "entropy", "The mean unigram entropy of samples (per sample, "
                    "entropy of its token-id histogram, in nats).", ("gen.settings",)),)))
register_suite(Suite(
    "gen_ppl", "generative perplexity of the samples under eval_lm", _run_gen_ppl, implies=("generate",),
    check=_check_gen_ppl,
    tags=lambda result, cfg: {"gen_ppl.eval_lm": cfg.eval_lm, "gen_ppl.definition": gen_ppl_definition(cfg)},
    definitions=lambda cfg: {"gen_ppl": gen_ppl_definition(cfg)},
    gates=(Gate("gen_ppl", "max", "gen_ppl_max", "gen-PPL"),),
    figures=(Figure("gen_ppl", "Generative perplexity", "gen-PPL", "Decode samples to text, re-tokenise with the "
                    "evaluation LM's tokenizer (reference: `gpt2-large`), truncate to 1024, score with the evaluation "
                    "LM, pool the NLL over tokens (not a mean of per-sample perplexities), excluding EOS targets. "
                    "Meaningless alone: read it with the sampler, `T`, `p`, sample count and the unigram entropy.",
                    ("gen_ppl.definition", "gen.settings", "gen_ppl.eval_lm")),)))
register_suite(Suite(
    "mauve", "MAUVE of the samples against as many validation texts", _run_mauve, implies=("generate",),
    check=_check_mauve, plan=_plan_mauve,
    tags=lambda result, cfg: {"mauve.featurizer": cfg.mauve_featurizer,
                              "mauve.samples": f"{result.metrics.get('mauve_samples', 0):.0f}"},
    gates=(Gate("mauve", "min", "mauve_min", "MAUVE"),),
    figures=(Figure("mauve", "MAUVE", "MAUVE", "MAUVE (`mauve-text`): generated texts against the same number of "
                    "reference texts from the validation split, with the featurizer recorded.",
                    ("gen.settings", "mauve.featurizer", "mauve.samples")),)))


def _plan_truth(plan: Any) -> None:
    if plan_truth(plan) is None:
        raise EvalError("suite truth needs testbed data (python -m pipelines.prepare_data --source testbed): "
                        f"no split of {plan.data_dir()} carries the language in its manifest")


def _auto_truth(plan: Any) -> bool:
    """On testbed data, the figures against the truth come beside the bound and the samples."""
    return any(s in plan.suite for s in ("ppl", "zero_shot", "generate")) and plan_truth(plan) is not None


def _run_truth(state: RunState) -> None:
    """The bound's excess over the exact entropy for every testbed split scored, and the samples under the
    language's exact likelihood (``evaluation/truth.py``)."""
    plan = state.plan
    if any(s in plan.suite for s in ("ppl", "zero_shot")):
        scored = state.nelbo()
        for ds in plan.datasets:
            truth = truth_of(ds.split_dir)
            if truth is None:
                continue
            prefix = PPL_METRIC_NAMES.get(ds.label, ds.label.replace("zero_shot/", "zero_shot_"))
            m, rows = bound_rows(prefix, ds.label, scored[ds.label][0].nll, truth, skips_first(plan.model_cfg))
            state.metrics.update(m)
            state.table.extend(rows)
    truth = plan_truth(plan)
    if "generate" in plan.suite and truth is not None and plan.length == truth["length"]:
        ids = np.asarray([s["ids"] for s in state.draw_samples()])
        m, rows = sample_rows(ids, truth)
        state.metrics.update(m)
        state.table.extend(rows)


register_suite(Suite(
    "truth", "on testbed data: the bound's excess over the exact entropy, the samples' true NLL (joins on its own)",
    _run_truth, plan=_plan_truth, auto=_auto_truth, in_stage2=False,
    figures=(Figure("val_excess_nats", "Validation bound's excess over the exact entropy", definition="On testbed "
                    "data: the validation bound (nats per token) minus the ground-truth language's exact entropy on "
                    "the positions the kind scores.", settings=("val_ppl.settings",)),
             Figure("true_nll", "Samples' true NLL", definition="On testbed data: the negative log-likelihood of the "
                    "samples under the ground-truth language's exact likelihood (nats per token).",
                    settings=("gen.settings",)))))


def _lm_eval(fn: str) -> Callable[..., Any]:
    """A function of ``lm_eval_suite``, imported when used (the harness is imported only by this suite)."""
    def call(*args: Any) -> Any:
        return getattr(lm_eval_suite, fn)(*args)

    return call


register_suite(Suite(
    "lm-eval", "EleutherAI lm-evaluation-harness tasks through the adlm adapter (--tasks; offline tasks by default)",
    _lm_eval("run_lm_eval"), check=_lm_eval("check_lm_eval"), tags=_lm_eval("lm_eval_tags"),
    gates=(Gate("lm_eval.acc_mean", "min", "lm_eval_acc_min", "lm-eval mean accuracy"),), in_stage2=False,
    likelihood=True,
    figures=(Figure(r"lm_eval\.([^.]+\.[^.]+)", "lm-eval {}", "lm-eval", "A task of EleutherAI's "
                    "lm-evaluation-harness (its own metric), scored through the adlm adapter: AR log-likelihoods "
                    "exact, the diffusion kinds' through the NELBO bound; the value ± its standard error.",
                    ("lm_eval.settings",), family=True),)))


def _accuracy(fn: str) -> Callable[..., Any]:
    """A function of ``accuracy`` (the reasoning suite), imported when used."""
    def call(*args: Any) -> Any:
        return getattr(accuracy, fn)(*args)

    return call


ACCURACY_DEFINITION = ("The share of a reasoning split's rows whose greedy answer (the text after the last `#`, "
                       "decoded at the stage the weights were kept at) equals the gold answer exactly; Wilson's 95% "
                       "score interval beside it.")

register_suite(Suite(
    "accuracy", "ACoT-fine-tuned versions: greedy answers of a reasoning split (accuracy_split), exact match, "
    "its Wilson interval (level 0.95); per-row answers as an artifact", _accuracy("run_accuracy"),
    plan=_accuracy("plan_accuracy"), tags=_accuracy("accuracy_tags"), in_stage2=False,
    headline=("answer_accuracy", "answer_accuracy_lo", "answer_accuracy_hi"),
    gates=(Gate("answer_accuracy", "min", "accuracy_min", "answer accuracy"),
           Gate("answer_accuracy_lo", "min", "accuracy_lo_min", "answer accuracy's Wilson 95% lower bound")),
    figures=(Figure("answer_accuracy", "Answer accuracy (exact match)", "", ACCURACY_DEFINITION,
                    ("answer_accuracy.settings",)),
             Figure("answer_accuracy_lo", "Answer accuracy, Wilson 95% lower bound", "", "The lower end of the "
                    "answer accuracy's Wilson 95% score interval.", ("answer_accuracy.settings",)),
             Figure("answer_accuracy_hi", "Answer accuracy, Wilson 95% upper bound", "", "The upper end of the "
                    "answer accuracy's Wilson 95% score interval.", ("answer_accuracy.settings",)))))


# ----------------------------------------------------------------------------------------------------------
# BD3-LM's arbitrary-length comparison.

BD3LM_TABLE7: dict[int, dict[str, tuple[float, str]]] = {
    1024: {"AR": (14.1, "1K"), "SEDD": (52.0, "1K"), "MDLM": (46.8, "1K"), "SSD-LM T=1000": (37.2, "40K"),
           "SSD-LM T=25": (281.3, "1K"), "BD3-LM L'=16": (33.4, "1K"), "BD3-LM L'=8": (30.4, "1K"),
           "BD3-LM L'=4": (25.7, "1K")},
    2048: {"AR": (13.2, "2K"), "MDLM": (41.3, "2K"), "SSD-LM T=1000": (35.3, "80K"), "SSD-LM T=25": (281.9, "2K"),
           "BD3-LM L'=16": (31.5, "2K"), "BD3-LM L'=8": (28.2, "2K"), "BD3-LM L'=4": (23.6, "2K")},
}
"""The published figures of the suite, (gen-PPL under gpt2-large, NFEs) per model and sample length: Arriola et al.,
"Block Diffusion", ICLR 2025 (arXiv 2503.09573), Table 7 (300 samples each; models trained on OpenWebText with a
context of 1024; SSD-LM is the released 400M model)."""

LONG_DEFINITION = ("samples of long_length tokens drawn with an any-length sampler; gen-PPL: decoded, re-tokenised by "
                   "the evaluation LM, truncated to long_length tokens and scored in windows of the LM's context moved "
                   "by half of it (BD3-LM's sliding window), NLL pooled over tokens, EOS targets excluded")


def _check_long(cfg: EvalConfig, tracking_uri: str | None) -> None:
    check_eval_lm(cfg.eval_lm, tracking_uri=tracking_uri)


def _plan_long(plan: Any) -> None:
    """The sampler of ``generate`` (resolved here when that suite is not chosen), which must fit the model and, past
    the model's context, generate any length."""
    cfg, model_cfg = plan.cfg, plan.model_cfg
    if plan.tokenizer is None:
        plan.tokenizer = checkpoint_tokenizer(plan.ref.local_dir, plan.meta)
        plan.sampler = resolve_sampler(cfg.sampler, model_cfg.kind)
        plan.steps = sampling_steps(cfg, model_cfg.kind, plan.meta)
    try:
        sampler = check_sampler_options(plan.sampler, cfg.sampler_kwargs, length=cfg.long_length)
        check_sampler_kind(plan.sampler, model_cfg.kind)
    except SamplerError as e:
        raise EvalError(f"suite arbitrary_length: {e}") from e
    plan.sampler_kwargs = plan.sampler_kwargs or sampler_options(plan.sampler, cfg.sampler_kwargs, plan.tokenizer)
    if cfg.long_length > model_cfg.seq_len and not sampler.any_length:
        fit = [n for n, s in SAMPLERS.items() if s.any_length and sampler_fits(s, KINDS[model_cfg.kind])]
        raise EvalError(f"suite arbitrary_length: long_length {cfg.long_length} exceeds the model's context of "
                        f"{model_cfg.seq_len} and sampler {plan.sampler!r} generates within it; pass "
                        + (f"--set sampler={fit[0]}" if fit else "a model whose kind has an any-length sampler")
                        + (f" (samplers that generate any length on a {model_cfg.kind} model: {', '.join(fit)})"
                           if fit else ""))


def _run_long(state: RunState) -> None:
    cfg, plan = state.cfg, state.plan
    settings = dataclasses.replace(state.settings, length=cfg.long_length)
    sizes = [min(cfg.sample_batch_size, cfg.long_num_samples - s)
             for s in range(0, cfg.long_num_samples, cfg.sample_batch_size)]
    jobs = [{"model": state.model, "batch_index": i, "n": n, "settings": settings} for i, n in enumerate(sizes)]
    out = state.executor.run(long_sample_job, jobs, f"arbitrary-length sampling ({plan.sampler}, T={plan.steps}, "
                             f"{cfg.long_length} tokens)", unit="sample", large=state.large_model,
                             total_units=cfg.long_num_samples, progress_kw="steps", step_total=plan.steps + 1)
    ids = np.concatenate([o["ids"] for o in out], axis=0)
    nfes = float(np.average([o["network_calls"] for o in out], weights=sizes))
    texts = [sample_segments(row, plan.tokenizer) for row in ids]
    r = state.executor.run(gen_ppl_job, [{"texts": texts, "settings": state.settings, "max_length": cfg.long_length,
                                          "long": True}], f"gen-PPL of long samples ({cfg.eval_lm})",
                           large=is_hub_model(cfg.eval_lm))[0]
    entropy = float(np.mean([unigram_entropy(row) for row in ids]))
    reached = float(np.mean([reached_length(row, cfg.long_window, cfg.long_min_entropy) for row in ids]))
    state.metrics.update({"long_gen_ppl": r["gen_ppl"], "long_entropy": entropy, "long_reached": reached,
                          "long_nfes": nfes, "long_samples": float(len(ids)), "long_length": float(cfg.long_length),
                          "long_gen_tokens": float(r["n_tokens"])})
    published = BD3LM_TABLE7.get(cfg.long_length)
    beside = ("; published (BD3-LM paper, Table 7, L=" + str(cfg.long_length) + "): "
              + ", ".join(f"{k} {v[0]:g} ({v[1]} NFEs)" for k, v in published.items())) if published else ""
    how = (f"{len(ids)} samples of {cfg.long_length} tokens beyond a context of {plan.model_cfg.seq_len}; sampler "
           f"{plan.sampler}, T={plan.steps}, p={cfg.nucleus_p}")
    state.row("gen PPL beyond the context", r["gen_ppl"],
              f"eval LM {cfg.eval_lm}, {r['n_tokens']} tokens pooled in sliding windows, entropy {entropy:.3f}; {how}"
              f"{beside}")
    state.row("share of samples reaching the length", reached,
              f"every {cfg.long_window}-token window with unigram entropy >= {cfg.long_min_entropy:g} nats; {how}")
    state.row("NFEs per sample", nfes, f"network calls of a sample's batch; {how}")


def _long_tags(result: Any, cfg: EvalConfig) -> dict[str, str]:
    s = result.settings
    return {"long.settings": (f"length={cfg.long_length} n={cfg.long_num_samples} sampler={s['sampler']} "
                              f"T={s['steps']} p={s['nucleus_p']} seed={s['seed']} reach=window {cfg.long_window} >= "
                              f"{cfg.long_min_entropy:g} nats"
                              + (f" {json.dumps(s['sampler_kwargs'], sort_keys=True)}" if s["sampler_kwargs"] else "")),
            "long.eval_lm": cfg.eval_lm}


register_suite(Suite(
    "arbitrary_length", "BD3-LM's arbitrary-length table: long_num_samples samples of long_length tokens beyond the "
    "context; gen-PPL (sliding window), the share reaching the length, NFEs", _run_long, check=_check_long,
    plan=_plan_long, tags=_long_tags, in_stage2=False, definitions=lambda cfg: {"long_gen_ppl": LONG_DEFINITION},
    figures=(Figure("long_gen_ppl", "Generative perplexity of long samples", "", "Gen-PPL of samples longer than "
                    "the model's context (BD3-LM's arbitrary-length table): " + LONG_DEFINITION + ".",
                    ("long.settings", "long.eval_lm")),
             Figure("long_reached", "Share of long samples reaching their length", "", "The share of long samples "
                    "whose every window of long_window tokens keeps a unigram entropy of at least long_min_entropy "
                    "nats (BD3-LM's stop rule: 256 tokens, 4 nats).", ("long.settings",)),
             Figure("long_nfes", "Network calls per long sample", "", "Forward passes of the network per sample "
                    "(NFEs: SSD-LM T per block, BD3-LM at most one per token).", ("long.settings",)))))
