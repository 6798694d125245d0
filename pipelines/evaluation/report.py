"""What an evaluation shows: the result, its Markdown table, its plots, and the registry version's tags."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.evaluation.config import EvalConfig
from pipelines.evaluation.suites import SUITES, gen_ppl_definition  # noqa: F401 - gen_ppl_definition re-exported


@dataclass
class EvalResult:
    """Outcome of ``evaluate_model``."""

    model: str
    suite: tuple[str, ...]
    metrics: dict[str, float]
    table: list[dict[str, Any]]
    settings: dict[str, Any]
    run_id: str | None = None
    version: str | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    ppl_keys: dict[str, str] = field(default_factory=dict)
    """Dataset label (``validation``, ``test``, ``zero_shot/NAME``) -> the identity of its perplexity figure
    (``plan.ppl_key``: same key, same number); what staged evaluation compares champions by."""
    artifacts: dict[str, str] = field(default_factory=dict)
    """Files kept with the evaluation run: artifact path -> text (``suites.RunState.artifacts``)."""

    def write_artifacts(self, out: Path) -> list[Path]:
        """Write ``artifacts`` under ``out`` (the folder logged as the run's artifacts); returns the files."""
        made = []
        for rel, text in self.artifacts.items():
            p = out / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text, encoding="utf-8")
            made.append(p)
        return made


def summary_markdown(result: EvalResult) -> str:
    lines = [f"# Evaluation of {result.model}", "",
             f"suite: {', '.join(result.suite)}; executor: {result.settings.get('executor')}", "",
             "| quantity | value | details |", "|---|---|---|"]
    for row in result.table:
        v = row["value"]
        shown = "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"
        if row.get("stderr") is not None and shown != "n/a":
            shown += f" ± {row['stderr']:.4f}"
        lines.append(f"| {row['quantity']} | {'<= ' if row.get('bound') else ''}{shown} | {row['details']} |")
    lines += ["", "PPL of diffusion models is the NELBO upper bound (docs/design/method.md, section 1); gen-PPL, entropy and "
              "MAUVE follow docs/design/method.md, section 6; ± is a standard error.", ""]
    return "\n".join(lines)


def plots(result: EvalResult, out: Path) -> list[Path]:
    # lazy: keeps matplotlib out of this module's import
    import matplotlib

    matplotlib.use("Agg")
    # lazy: keeps matplotlib out of this module's import
    import matplotlib.pyplot as plt

    made = []
    ppl_rows = [r for r in result.table if r["quantity"].endswith(" PPL") and r["quantity"] != "gen PPL"]
    if ppl_rows:
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(ppl_rows)), 3.2))
        ax.bar([r["quantity"].replace(" PPL", "") for r in ppl_rows], [r["value"] for r in ppl_rows], color="#4c72b0")
        ax.set_ylabel("PPL (upper bound)" if ppl_rows[0].get("bound") else "PPL")
        ax.set_title("Perplexity by dataset")
        ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        p = out / "ppl.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        made.append(p)
    if result.samples:
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        ax.hist([s["entropy"] for s in result.samples], bins=min(30, max(5, len(result.samples) // 4)), color="#55a868")
        ax.set_xlabel("unigram entropy of a sample (nats)")
        ax.set_ylabel("samples")
        ax.set_title(f"Sample entropy (mean {result.metrics.get('entropy', float('nan')):.3f})")
        fig.tight_layout()
        p = out / "entropy.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        made.append(p)
    return made


def version_tags(result: EvalResult, cfg: EvalConfig) -> dict[str, str]:
    """Headline figures and the settings they were measured with, for the registry version: each suite of the
    result as its entry in ``suites.SUITES`` says."""
    tags: dict[str, str] = {}
    for name in result.suite:
        suite = SUITES[name]
        tags.update({k: f"{result.metrics[k]:.6g}" for k in suite.headline if k in result.metrics})
        if suite.tags is not None:
            tags.update(suite.tags(result, cfg))
    tags["eval.profile"] = cfg.profile or "custom"
    return tags
