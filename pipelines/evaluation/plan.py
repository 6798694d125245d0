"""Planning an evaluation: every check that can fail on bad input, before weights are loaded or Ray starts.

``plan_evaluation`` resolves the model (``registry.resolve_model_ref``: a ``models:/`` URI, downloaded once
into the cache, or a checkpoint folder), then runs each chosen suite's checks from the table
(``suites.SUITES``): the prepared splits and zero-shot sets (each must fit the model), the sampler and its
options, the evaluation LM, the MAUVE featurizer, the lm-eval tasks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from adlm_model.interop.checkpoint import read_config
from adlm_model.kinds import model_kind
from pipelines.core.storage import cache_dir, is_uri, resolve_workdir
from pipelines.data.manifest import read_manifest
from pipelines.evaluation.config import EvalConfig, EvalError
from pipelines.evaluation.datasets import (  # noqa: F401 - re-exported: the datasets' helpers lived here
    Dataset,
    data_dir_for,
    discover_zero_shot,
    has_manifest,
    ppl_key,
)
from pipelines.evaluation.suites import SUITES, check_suites, parse_suite
from pipelines.tracking.registry import ModelRef, resolve_model_ref
from pipelines.tracking.runs import require_server, resolve_tracking_uri


@dataclass
class Plan:
    """Everything checked before the expensive work."""

    ref: ModelRef
    model_cfg: Any
    meta: dict[str, Any]
    suite: tuple[str, ...]
    cfg: EvalConfig
    datasets: list[Dataset]
    tokenizer: Any = None
    sampler: str = ""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    length: int = 0
    steps: int = 0
    """Sampling steps T for this model's kind (``steps_by_kind``, else ``steps``)."""
    reference_split: str | None = None
    tracking_uri: str | None = None
    workdir: str | None = None
    lm_eval: dict[str, Any] = field(default_factory=dict)
    """The lm-eval suite's resolved tasks and settings (``lm_eval_suite.plan_lm_eval``)."""
    accuracy: dict[str, Any] = field(default_factory=dict)
    """The accuracy suite's split and decoding stage (``accuracy.plan_accuracy``)."""
    data: str | None = None
    """The prepared data folder (``data=`` or the checkpoint's training data)."""

    def data_dir(self) -> str:
        """The prepared data folder, or a one-line error naming the setting."""
        if not self.data:
            raise EvalError(f"no data: checkpoint {self.ref.local_dir} does not name its training data; pass "
                            "--set data=DIR (a folder written by python -m pipelines.prepare_data)")
        return self.data

    def add_dataset(self, label: str, split_dir: str) -> None:
        """Plan scoring ``split_dir`` as ``label``; its manifest must fit the model."""
        m = read_manifest(split_dir)
        m.check_fits(self.model_cfg, self.meta.get("tokenizer_hash"))
        m.check_shards()
        self.datasets.append(Dataset(label=label, split_dir=m.split_dir, rows=m.rows, tokens=m.tokens,
                                     manifest_hash=m.content_hash(), source=m.source))


def _refuse_likelihood(suite: Sequence[str], kind: str) -> None:
    """A sample-only kind (``ModelKind.sample_only``: SSD-LM) has no likelihood here: its suites are refused."""
    bad = [n for n in suite if SUITES[n].likelihood]
    if bad and model_kind(kind).sample_only:
        sample = ", ".join(n for n, s in SUITES.items() if not s.likelihood and s.auto is None)
        raise EvalError(f"suite {', '.join(bad)} scores the model's likelihood, which a {kind} model has none of here "
                        f"(sample-only); use the sample suites ({sample})")


def plan_evaluation(model: str, suite: str | Sequence[str], cfg: EvalConfig, *, workdir: str | os.PathLike | None = None,
                    tracking_uri: str | None = None) -> Plan:
    """Every check that can fail on bad input, before any weights are loaded or Ray starts: the settings, each
    suite's model-free checks, then the model and each suite's checks against it (``suites.Suite.plan``)."""
    cfg.validate()
    require_server(tracking_uri or resolve_tracking_uri(workdir), "an evaluation (it logs its results as a run)")
    suite = parse_suite(suite)
    if tracking_uri is None and (model.startswith("models:/") or cfg.eval_lm.startswith("models:/")):
        tracking_uri = resolve_tracking_uri(workdir)
    check_suites(suite, cfg, tracking_uri)
    wd = resolve_workdir(workdir)
    ref = resolve_model_ref(model, tracking_uri, None if is_uri(wd) else cache_dir(wd))
    model_cfg, meta = read_config(ref.local_dir)
    _refuse_likelihood(suite, model_cfg.kind)
    plan = Plan(ref=ref, model_cfg=model_cfg, meta=meta, suite=suite, cfg=cfg, datasets=[],
                tracking_uri=tracking_uri, workdir=wd, data=data_dir_for(cfg, meta, workdir))
    for name in suite:
        if SUITES[name].plan is not None:
            SUITES[name].plan(plan)
    joined = [n for n, s in SUITES.items() if n not in suite and s.auto is not None and s.auto(plan)]
    if joined:  # e.g. the figures against the truth, on testbed data
        plan.suite = tuple(n for n in SUITES if n in suite or n in joined)
        for name in joined:
            if SUITES[name].plan is not None:
                SUITES[name].plan(plan)
    return plan
