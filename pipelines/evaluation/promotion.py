"""Staged evaluation and gated promotion of registry versions (``candidate`` -> ``champion``).

``stage_all`` (CLI: ``python -m pipelines.evaluate --stage-all``) walks every version of the registered
model that has not been decided yet (no final ``eval.status``), oldest first, and records each step on the
version as tags:

1. **Fast stage** (``eval.stage1``): the validation bound on a fixed subset (``stage1_rows`` rows spread
   over the split, the evaluation's seed and batch size), compared with ``stage1_max_ppl`` and with the current
   champion's figure on the very same subset (``stage1_tolerance``: how far above the champion a candidate
   may be and still earn the full stage). A failing version never runs the full stage.
2. **Full stage** (``eval.stage2``): ``stage2_suite`` (full validation and zero-shot perplexities,
   generation, gen-PPL with entropy, MAUVE) through ``evaluate.evaluate_model``'s machinery; the headline
   figures become version tags (``val_ppl``, ``gen_ppl``, ``entropy``, ``mauve`` and their settings).
3. **Gate** (``eval.stage3``): validation PPL must beat the champion's (measured on the same data with the
   same settings) by ``margin``; every figure with a ``Gate`` in the suites' table (gen-PPL, entropy, MAUVE,
   ...) must lie within its bound. A passing version
   gets the alias ``champion``; the previous champion is tagged ``eval.replaced_by`` / ``eval.replaced_at``.

Every decided version loses the ``candidate`` alias and carries ``eval.status`` (``promoted`` or
``rejected``) and, when rejected, ``eval.reasons``. Champion figures measured for a comparison are cached
on the champion as ``eval.ppl.<hash>`` tags (keyed by data hash, rows, batch size, draws, seed), so they
are computed once. Re-running changes nothing: decided versions are skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from adlm_model.interop.checkpoint import CheckpointError
from pipelines.core.storage import parent_of
from pipelines.data.manifest import DataMismatchError, ManifestError
from pipelines.data.tokenizer import TokenizerError
from pipelines.evaluation.config import EvalConfig, EvalError
from pipelines.evaluation.eval_lm import EvalLMError
from pipelines.evaluation.metrics import MetricError
from pipelines.evaluation.plan import Plan, plan_evaluation
from pipelines.evaluation.report import EvalResult
from pipelines.evaluation.run import log_result, make_executor, run_plan
from pipelines.evaluation.suites import SUITES, check_suites, default_stage2, parse_suite
from pipelines.tracking.registry import RegistryError
from pipelines.tracking.runs import client as tracking_client
from pipelines.tracking.runs import redact_uri, require_server, resolve_tracking_uri

FINAL_STATUSES = ("promoted", "rejected")
CHAMPION = "champion"
CANDIDATE = "candidate"


class PromotionError(ValueError):
    """A staged-evaluation request that cannot run (no such registered model, bad gate settings)."""


@dataclass
class PromotionConfig:
    """Stages and gate of ``--stage-all``; every field can be set with ``--set key=value``."""

    model_name: str = "adlm"
    """Registered model whose waiting versions are processed."""
    stage1_rows: int = 256
    """Fast stage: score N validation rows spread over the split."""
    stage1_max_ppl: float = math.inf
    """Fast stage: the subset's validation bound must be at most this (inf: no threshold)."""
    stage1_tolerance: float = 0.05
    """Fast stage: the bound may exceed the champion's on the same subset by at most this fraction."""
    stage2_suite: tuple[str, ...] = field(default_factory=default_stage2)
    """Full stage suite (default: every suite of ``suites.SUITES`` marked ``in_stage2``; a suite that is not
    available with the settings, such as ``zero_shot`` without sets, is skipped)."""
    margin: float = 0.0
    """Gate: validation PPL must be below champion PPL x (1 - margin) (0: strictly lower)."""
    gen_ppl_max: float = math.inf
    """Gate: gen-PPL must be at most this."""
    entropy_min: float = 0.0
    """Gate: mean unigram entropy must be at least this (guards against repetitive samples)."""
    entropy_max: float = math.inf
    """Gate: mean unigram entropy must be at most this."""
    mauve_min: float = 0.0
    """Gate: MAUVE must be at least this."""
    bounds: dict[str, float] = field(default_factory=dict)
    """Gate bounds of suites without a field above (``--set gate.NAME=VALUE``; NAME as the suite's ``Gate``
    names it, e.g. ``gate.lm_eval_acc_min=0.3``)."""

    def validate(self) -> PromotionConfig:
        problems = []
        if self.stage1_rows < 1:
            problems.append(f"stage1_rows must be >= 1, got {self.stage1_rows}")
        if self.stage1_tolerance < 0:
            problems.append(f"stage1_tolerance must be >= 0, got {self.stage1_tolerance}")
        if not 0 <= self.margin < 1:
            problems.append(f"margin must be in [0, 1), got {self.margin}")
        if self.entropy_min > self.entropy_max:
            problems.append(f"entropy_min {self.entropy_min} > entropy_max {self.entropy_max}")
        if problems:
            raise PromotionError("; ".join(problems))
        try:
            suite = parse_suite(self.stage2_suite)
        except EvalError as e:
            raise PromotionError(f"stage2_suite: {e}") from e
        if "ppl" not in suite:
            raise PromotionError("stage2_suite must include ppl: the gate compares validation perplexities")
        known = {g.setting for s in SUITES.values() for g in s.gates}
        unknown = sorted(set(self.bounds) - known)
        if unknown:
            raise PromotionError(f"unknown gate {', '.join(unknown)}: use one of {', '.join(sorted(known))}")
        return self

    def bound(self, setting: str) -> float | None:
        """The bound of a gate setting: its field, else ``bounds``; None: not gated."""
        if setting in self.bounds:
            return float(self.bounds[setting])
        value = getattr(self, setting, None)
        return None if value is None else float(value)


def gate_reasons(metrics: dict[str, float], suite: tuple[str, ...], promo: PromotionConfig) -> list[str]:
    """Why the figures of ``suite`` fail their gates (``suites.Gate``), in table order."""
    reasons = []
    for name in suite:
        for gate in SUITES[name].gates:
            bound = promo.bound(gate.setting)
            if gate.metric in metrics and bound is not None:
                why = gate.reason(metrics[gate.metric], bound)
                if why:
                    reasons.append(why)
    return reasons


@dataclass
class StageOutcome:
    """What ``stage_all`` did to one version."""

    version: str
    status: str
    """``promoted``, ``rejected`` (or ``skipped`` when already decided)."""
    stage: int
    """Last stage reached (1, 2, 3)."""
    reasons: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    replaced: str | None = None
    """The champion this version replaced."""
    definitions: dict[str, str] = field(default_factory=dict)
    """Figure -> its definition where one number can mean several things (gen-PPL)."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def alias_version(client: Any, name: str, alias: str) -> str | None:
    # lazy: keeps mlflow out of this module's import
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        # Only "no such alias" means None; any other failure (a locked store, an outage) must not read as
        # "no champion", which would promote a version without comparing it.
        if "not found" in str(e) or e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def waiting_versions(client: Any, name: str) -> list[Any]:
    """Versions without a final ``eval.status`` (oldest first); the champion itself is never waiting."""
    champion = alias_version(client, name, CHAMPION)
    versions = client.search_model_versions(f"name='{name}'")
    out = [mv for mv in versions
           if (mv.tags or {}).get("eval.status") not in FINAL_STATUSES and str(mv.version) != champion]
    return sorted(out, key=lambda mv: int(mv.version))


class _Stager:
    """Runs the stages for one registered model with one executor (one Ray session for all versions)."""

    def __init__(self, promo: PromotionConfig, cfg: EvalConfig, *, workdir: str | os.PathLike | None,
                 tracking_uri: str, executor: Any) -> None:
        self.promo, self.cfg, self.workdir, self.tracking_uri, self.executor = promo, cfg, workdir, tracking_uri, executor
        self.client = tracking_client(tracking_uri)
        self.name = promo.model_name

    # -- helpers ------------------------------------------------------------------------------------------
    def tag(self, version: str, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_model_version_tag(self.name, version, k, str(v))

    def uri(self, version: str) -> str:
        return f"models:/{self.name}/{version}"

    def plan(self, version: str, suite: tuple[str, ...], cfg: EvalConfig) -> Plan:
        return plan_evaluation(self.uri(version), suite, cfg, workdir=self.workdir, tracking_uri=self.tracking_uri)

    def run(self, plan: Plan, stage: str | None, tag_version: bool, log: bool = True) -> EvalResult:
        result = run_plan(plan, self.executor)
        if log:
            log_result(result, plan, stage=stage, tag_version=tag_version)
        return result

    def champion_ppl(self, champion: str, cfg: EvalConfig, key: str) -> float:
        """The champion's validation bound under exactly ``key`` (same data, rows, seed, ...); cached as a tag."""
        tag = "eval.ppl." + hashlib.sha256(key.encode()).hexdigest()[:12]
        tags = self.client.get_model_version(self.name, champion).tags or {}
        if tag in tags and tags.get(tag + ".key") == key:
            return float(tags[tag])
        result = self.run(self.plan(champion, ("ppl",), cfg), stage=None, tag_version=False, log=False)
        got = result.ppl_keys["validation"]
        if got != key:  # the champion resolved other data: the figures would not be comparable
            raise EvalError(f"champion v{champion} was measured as {got}, not {key}")
        value = result.metrics["val_ppl"]
        self.tag(champion, {tag: repr(value), tag + ".key": key})
        return value

    def decide(self, version: str, status: str, stage: int, reasons: list[str], figures: dict[str, float],
               replaced: str | None = None, definitions: dict[str, str] | None = None) -> StageOutcome:
        tags: dict[str, Any] = {"eval.status": status, "eval.decided_at": _now(), "eval.stage": stage}
        if reasons:
            tags["eval.reasons"] = "; ".join(reasons)
        self.tag(version, tags)
        if alias_version(self.client, self.name, CANDIDATE) == version:
            self.client.delete_registered_model_alias(self.name, CANDIDATE)
        return StageOutcome(version=version, status=status, stage=stage, reasons=reasons, figures=figures,
                            replaced=replaced, definitions=definitions or {})

    # -- the stages ---------------------------------------------------------------------------------------
    def process(self, version: str) -> StageOutcome:
        bad_input = (EvalError, CheckpointError, DataMismatchError, ManifestError, EvalLMError, MetricError,
                     RegistryError, TokenizerError)
        champion = alias_version(self.client, self.name, CHAMPION)
        self.tag(version, {"eval.status": "running", "eval.started_at": _now(), "eval.stage": 1})
        figures: dict[str, float] = {}

        # Stage 1: the fast validation bound on a fixed subset.
        cfg1 = dataclasses.replace(self.cfg, splits=("validation",), max_rows=self.promo.stage1_rows, zero_shot=())
        try:
            plan1 = self.plan(version, ("ppl",), cfg1)
        except bad_input as e:
            self.tag(version, {"eval.stage1": "failed"})
            return self.decide(version, "rejected", 1, [f"stage 1: {e}"], figures)
        r1 = self.run(plan1, stage="1", tag_version=False)
        fast, key1 = r1.metrics["val_ppl"], r1.ppl_keys["validation"]
        figures["stage1_val_ppl"] = fast
        reasons = []
        if not math.isfinite(fast) or fast > self.promo.stage1_max_ppl:
            reasons.append(f"stage 1: validation bound {fast:.4f} on {self.promo.stage1_rows} rows spread over the split is "
                           f"above the threshold {self.promo.stage1_max_ppl:g}")
        s1 = {"eval.stage1.val_ppl": f"{fast:.6g}", "eval.stage1.key": key1}
        if champion is not None:
            # Measure the champion on the candidate's data (same subset, seed, batch size).
            champ_cfg = dataclasses.replace(cfg1, data=parent_of(plan1.datasets[0].split_dir))
            try:
                champ_fast = self.champion_ppl(champion, champ_cfg, key1)
            except bad_input as e:
                reasons.append(f"stage 1: champion v{champion} cannot be measured on this data ({e})")
            else:
                figures["stage1_champion_val_ppl"] = champ_fast
                s1.update({"eval.stage1.champion": champion, "eval.stage1.champion_val_ppl": f"{champ_fast:.6g}"})
                limit = champ_fast * (1 + self.promo.stage1_tolerance)
                if fast > limit:
                    reasons.append(f"stage 1: validation bound {fast:.4f} is more than {self.promo.stage1_tolerance:.0%} "
                                   f"above champion v{champion}'s {champ_fast:.4f} on the same rows")
        s1["eval.stage1"] = "failed" if reasons else "passed"
        self.tag(version, s1)
        if reasons:
            return self.decide(version, "rejected", 1, reasons, figures)

        # Stage 2: the full evaluation.
        suite = [s for s in parse_suite(self.promo.stage2_suite)
                 if SUITES[s].available is None or SUITES[s].available(self.cfg)]
        self.tag(version, {"eval.stage": 2})
        try:
            plan2 = self.plan(version, tuple(suite), self.cfg)
        except bad_input as e:
            self.tag(version, {"eval.stage2": "failed"})
            return self.decide(version, "rejected", 2, [f"stage 2: {e}"], figures)
        r2 = self.run(plan2, stage="2", tag_version=True)
        m = r2.metrics
        figures.update({k: m[k] for s in suite for k in SUITES[s].headline if k in m})
        definitions = {k: v for s in suite if SUITES[s].definitions is not None
                       for k, v in SUITES[s].definitions(self.cfg).items()}
        self.tag(version, {"eval.stage2": "passed", "eval.stage": 3})

        # Stage 3: the gate.
        p = self.promo
        reasons = []
        if champion is not None:
            champ_cfg = dataclasses.replace(self.cfg, splits=("validation",),
                                            data=parent_of(plan2.datasets[0].split_dir))
            try:
                champ_val = self.champion_ppl(champion, champ_cfg, r2.ppl_keys["validation"])
            except bad_input as e:
                reasons.append(f"gate: champion v{champion} cannot be measured on this data ({e})")
            else:
                figures["champion_val_ppl"] = champ_val
                self.tag(version, {"eval.gate.champion": champion, "eval.gate.champion_val_ppl": f"{champ_val:.6g}"})
                if not m["val_ppl"] < champ_val * (1 - p.margin):
                    reasons.append(f"gate: validation PPL {m['val_ppl']:.4f} does not beat champion v{champion}'s "
                                   f"{champ_val:.4f} by the margin {p.margin:.1%}")
        elif not math.isfinite(m["val_ppl"]):
            reasons.append("gate: validation PPL is not finite")
        reasons += gate_reasons(m, tuple(suite), p)
        self.tag(version, {"eval.stage3": "failed" if reasons else "passed"})
        if reasons:
            return self.decide(version, "rejected", 3, reasons, figures, definitions=definitions)
        when = _now()
        self.client.set_registered_model_alias(self.name, CHAMPION, version)
        self.tag(version, {"eval.promoted_at": when, **({"eval.previous_champion": champion} if champion else {})})
        if champion is not None:
            self.tag(champion, {"eval.replaced_by": version, "eval.replaced_at": when})
        return self.decide(version, "promoted", 3, [], figures, replaced=champion, definitions=definitions)


def check_stage_all(promo: PromotionConfig, cfg: EvalConfig, tracking_uri: str) -> None:
    """Bad settings or a missing registered model fail here, before any version is touched."""
    # lazy: keeps mlflow out of this module's import
    from mlflow.exceptions import MlflowException

    promo.validate()
    cfg.validate()
    check_suites(parse_suite(promo.stage2_suite), cfg, tracking_uri)
    client = tracking_client(tracking_uri)
    try:
        client.get_registered_model(promo.model_name)
    except MlflowException as e:  # RESOURCE_DOES_NOT_EXIST, or a store that does not answer
        raise PromotionError(f"no registered model {promo.model_name!r} in {redact_uri(tracking_uri)}: train with registration "
                             "on (python -m pipelines.train ...) or pass --name") from e


def stage_all(promo: PromotionConfig | None = None, cfg: EvalConfig | None = None, *,
              workdir: str | os.PathLike | None = None, tracking_uri: str | None = None, in_process: bool = False,
              ray_address: str | None = None) -> list[StageOutcome]:
    """Process every waiting version of ``promo.model_name`` (oldest first); returns what happened to each."""

    promo, cfg = promo or PromotionConfig(), cfg or EvalConfig()
    tracking_uri = tracking_uri or resolve_tracking_uri(workdir)
    check_stage_all(promo, cfg, tracking_uri)
    require_server(tracking_uri, "staging the registered versions")
    client = tracking_client(tracking_uri)
    waiting = waiting_versions(client, promo.model_name)
    if not waiting:
        return []
    executor = make_executor(cfg, in_process=in_process, ray_address=ray_address)
    stager = _Stager(promo, cfg, workdir=workdir, tracking_uri=tracking_uri, executor=executor)
    return [stager.process(str(mv.version)) for mv in waiting]


def outcomes_markdown(outcomes: list[StageOutcome]) -> str:
    if not outcomes:
        return "No registry version is waiting for evaluation."
    lines = ["| version | status | stage | figures | reasons |", "|---|---|---|---|---|"]
    for o in outcomes:
        figs = ", ".join(f"{k}={v:.4g}" for k, v in o.figures.items())
        extra = f" (replaced v{o.replaced})" if o.replaced else ""
        lines.append(f"| {o.version} | {o.status}{extra} | {o.stage} | {figs} | {'; '.join(o.reasons)} |")
    defined = sorted({(k, d) for o in outcomes for k, d in o.definitions.items()})
    lines += [""] * bool(defined) + [f"{k}: {d}" for k, d in defined]
    return "\n".join(lines)


__all__ = ["PromotionConfig", "PromotionError", "StageOutcome", "check_stage_all", "gate_reasons",
           "alias_version", "outcomes_markdown", "stage_all", "waiting_versions"]
