"""What an evaluation shows: the result, its Markdown table, its plots, and the registry version's tags."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.evaluation.config import EvalConfig


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


def summary_markdown(result: EvalResult) -> str:
    lines = [f"# Evaluation of {result.model}", "",
             f"suite: {', '.join(result.suite)}; executor: {result.settings.get('executor')}", "",
             "| quantity | value | details |", "|---|---|---|"]
    for row in result.table:
        v = row["value"]
        shown = "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"
        lines.append(f"| {row['quantity']} | {'<= ' if row.get('bound') else ''}{shown} | {row['details']} |")
    lines += ["", "PPL of diffusion models is the NELBO upper bound (METHOD.md section 1); gen-PPL, entropy and "
              "MAUVE follow METHOD.md section 6.", ""]
    return "\n".join(lines)


def plots(result: EvalResult, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
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


def gen_ppl_definition(cfg: EvalConfig) -> str:
    """The definition printed next to every gen-PPL figure (METHOD.md section 6): the evaluation LM, the
    pooling, the truncation and the first-token convention."""
    from pipelines.evaluation.metrics import GEN_PPL_DEFINITIONS

    return (f"token-pooled NLL under {cfg.eval_lm}, EOS targets excluded, truncated to {cfg.gen_ppl_max_length}, "
            f"{GEN_PPL_DEFINITIONS[cfg.gen_ppl_first_token]}")


def version_tags(result: EvalResult, cfg: EvalConfig) -> dict[str, str]:
    """Headline figures and the settings they were measured with, for the registry version."""
    m, s = result.metrics, result.settings
    tags: dict[str, str] = {}
    for k in ("val_ppl", "test_ppl", "gen_ppl", "entropy", "mauve"):
        if k in m:
            tags[k] = f"{m[k]:.6g}"
    for row in result.table:
        if row["quantity"].startswith("zero_shot/"):
            tags[f"{row['quantity'].split(' ')[0].replace('/', '.')}_ppl"] = f"{row['value']:.6g}"
    if "validation" in result.ppl_keys:
        tags["eval.val_key"] = result.ppl_keys["validation"]
    if "val_ppl" in m:
        tags["val_ppl.settings"] = (f"NELBO bound, {int(m['val_tokens'])} tokens, t_draws={cfg.t_draws}, "
                                    f"seed={cfg.seed}, batch={cfg.batch_size}, ema={cfg.use_ema}")
    tags["eval.profile"] = cfg.profile or "custom"
    if "generate" in result.suite:
        tags["gen.settings"] = (f"sampler={s['sampler']} T={s['steps']} p={s['nucleus_p']} n={len(result.samples)} "
                                f"length={s['length']} seed={s['seed']}"
                                + (f" {json.dumps(s['sampler_kwargs'], sort_keys=True)}" if s["sampler_kwargs"] else ""))
    if "gen_ppl" in result.suite:
        tags["gen_ppl.eval_lm"] = cfg.eval_lm
        tags["gen_ppl.definition"] = gen_ppl_definition(cfg)
    if "mauve" in result.suite:
        tags["mauve.featurizer"] = cfg.mauve_featurizer
    return tags
