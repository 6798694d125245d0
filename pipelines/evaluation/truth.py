"""Evaluation against the truth, wherever the data is the ground-truth testbed (``adlm_model.testbed.language``).

A prepared testbed split carries its language in ``manifest.truth`` (``pipelines.data.synthetic``): the exact
entropy per token, the floors and the config that rebuilds the language. Then two readings replace guesswork:

- **the bound's excess over the exact entropy**: ``bound_nll - H`` in nats per scored token, and the ratio
  ``bound_nll / H``. Both sides count the same positions: all L for MDLM/ADLM, positions 1..L-1 for AR and
  BD3-LM (which leave the BOS position out; it carries 0 nats, so ``H`` is the row entropy over L or L - 1).
  A perfect model has excess 0 (a diffusion bound only in expectation over ``t``); above the unigram + position
  floor, a model has learned no context.
- **samples scored by the true log-likelihood**: the mean NLL per token of generated rows under the language
  itself, its distance from the exact entropy, and the rows the language cannot emit at all. Beside it, the
  samples' mean unigram entropy next to that of true rows: a sampler that lowers the true NLL below the entropy
  by collapsing diversity shows it there. (gen-PPL under a small LM is gameable; the truth is not.)

Each function takes plain numbers or arrays, so it can be one entry of a metric registry.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pipelines.core.storage import join
from pipelines.data.manifest import ManifestError, read_manifest


def truth_of(split_dir: str | None) -> dict[str, Any] | None:
    """The split's ``manifest.truth`` (a testbed split), else None."""
    if not split_dir:
        return None
    try:
        return read_manifest(split_dir).truth or None
    except ManifestError:
        return None


def plan_truth(plan: Any) -> dict[str, Any] | None:
    """The truth of an evaluation's data, if it is the testbed: its MAUVE reference split, its perplexity splits,
    else the model's own data folder (``data=`` or the checkpoint's training data)."""
    dirs = [plan.reference_split, *(d.split_dir for d in plan.datasets)]
    if plan.data:
        dirs += [join(plan.data, "validation"), join(plan.data, "train")]
    return next((t for t in map(truth_of, dirs) if t is not None), None)


def skips_first(model_cfg: Any) -> bool:
    """Whether a kind's bound leaves position 0 out (AR: no target there; BD3-LM: ``ignore_bos``)."""
    # lazy: keeps torch out of this module's import
    from adlm_model.kinds import model_kind

    return not model_kind(model_cfg.kind).diffusion or bool(getattr(model_cfg, "skips_bos", False))


def exact_entropy(truth: dict[str, Any], skip_first: bool) -> tuple[float, float]:
    """(entropy, its standard error) in nats per scored token."""
    key = "entropy_per_token_skip_first" if skip_first else "entropy_per_token"
    return float(truth[key]), float(truth[f"{key}_se"])


def bound_vs_truth(nll_per_token: float, truth: dict[str, Any], skip_first: bool = False) -> dict[str, float]:
    """The bound (nats per scored token) against the exact entropy and the floors on the same positions."""
    h, se = exact_entropy(truth, skip_first)
    floors = truth["floors_skip_first" if skip_first else "floors"]
    return {"entropy": h, "entropy_se": se, "excess_nats": nll_per_token - h, "excess_ratio": nll_per_token / h,
            "floor_unigram": float(floors["unigram"]), "floor_unigram_position": float(floors["unigram_position"]),
            "below_floor_nats": float(floors["unigram_position"]) - nll_per_token}


def samples_vs_truth(ids: np.ndarray, truth: dict[str, Any], reference_rows: int = 2000) -> dict[str, float]:
    """Generated rows (n, L) scored by the language: mean true NLL per token over the rows it can emit (all L
    positions, as ``entropy_per_token``), its distance from the exact entropy, the fraction it cannot emit, and
    the mean unigram entropy of the samples and of ``reference_rows`` true rows. Raises ValueError when the
    samples' length is not the language's."""
    # lazy: keeps torch out of this module's import
    import torch

    # lazy: keeps torch out of this module's import
    from adlm_model.sampling.samplers import unigram_entropy
    from adlm_model.testbed.language import Testbed

    tb = Testbed.from_dict(truth["config"])
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] != tb.length:
        raise ValueError(f"samples of shape {ids.shape} cannot be scored by the testbed (rows of {tb.length}); "
                         f"generate with length={tb.length}")
    lp = tb.log_prob(torch.as_tensor(ids, dtype=torch.long)).numpy()
    ok = np.isfinite(lp)
    nll = float(-lp[ok].mean() / tb.length) if ok.any() else math.inf
    h = float(truth["entropy_per_token"])
    true_rows = tb.sample(reference_rows, seed=30_000_000).numpy()
    return {"true_nll": nll, "true_nll_excess": nll - h, "entropy_exact": h,
            "impossible_fraction": float(1.0 - ok.mean()),
            "sample_unigram_entropy": float(np.mean([unigram_entropy(r) for r in ids])),
            "data_unigram_entropy": float(np.mean([unigram_entropy(r) for r in true_rows]))}


def bound_rows(prefix: str, label: str, nll_per_token: float, truth: dict[str, Any], skip_first: bool
               ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Metrics ``{prefix}_excess_nats`` / ``{prefix}_excess_ratio`` and the table row beside the bound."""
    r = bound_vs_truth(nll_per_token, truth, skip_first)
    where = "positions 1..L-1" if skip_first else "all L positions"
    metrics = {f"{prefix}_excess_nats": r["excess_nats"], f"{prefix}_excess_ratio": r["excess_ratio"],
               f"{prefix}_entropy_exact": r["entropy"]}
    row = {"quantity": f"{label} excess over the exact entropy (nats/token)", "value": r["excess_nats"],
           "bound": False,
           "details": f"bound {nll_per_token:.4f} - exact entropy {r['entropy']:.4f} ± {r['entropy_se']:.4f} "
                      f"nats/token on {where} (ratio {r['excess_ratio']:.4f}); floors: unigram + position "
                      f"{r['floor_unigram_position']:.4f} ({'below' if r['below_floor_nats'] > 0 else 'NOT below'} "
                      f"it by {r['below_floor_nats']:+.4f}), unigram {r['floor_unigram']:.4f}"}
    return metrics, [row]


def sample_rows(ids: np.ndarray, truth: dict[str, Any]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Metrics ``true_nll``, ``true_nll_excess``, ``impossible_fraction`` and the table row beside gen-PPL."""
    r = samples_vs_truth(ids, truth)
    metrics = {k: r[k] for k in ("true_nll", "true_nll_excess", "impossible_fraction")}
    row = {"quantity": "samples' true NLL (nats/token)", "value": r["true_nll"], "bound": False,
           "details": f"under the testbed's exact likelihood; exact entropy {r['entropy_exact']:.4f} (distance "
                      f"{r['true_nll_excess']:+.4f}); {r['impossible_fraction']:.1%} of {len(ids)} samples are "
                      f"impossible rows (left out of the mean); unigram entropy of samples "
                      f"{r['sample_unigram_entropy']:.3f} vs true rows {r['data_unigram_entropy']:.3f} nats"}
    return metrics, [row]
