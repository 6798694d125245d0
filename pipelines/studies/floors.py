"""The context-free floors of a prepared split: what a model that ignores context can reach, in nats per token
and as perplexity, so that a study can say whether its arms learned any context at all.

    python -m pipelines.studies.floors work/data/study-bpe1024/validation --train work/data/study-bpe1024/train

- **unigram**: one distribution over the vocabulary for every position;
- **unigram + position**: one distribution per position of the row (BOS/EOS framing is learnt here).

Each is computed two ways. *In-sample* (the split's own frequencies scored on itself): the lowest NLL any such
model can have on this split, a strict floor. *Fitted on train* (``--train``; add-``alpha`` smoothing, scored
on the split): what such a model trained on the training split gets, the realistic floor. Positions: all L
(as MDLM and ADLM score them) and 1..L-1 (as AR and BD3-LM do); pads never count. A bound above a floor means
the model has learned no more than token frequencies. On testbed data the manifest's exact floors are printed
beside the estimates.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import numpy as np

from pipelines.core.cli import run_command
from pipelines.core.logs import add_logging_flags
from pipelines.data.manifest import ManifestError, read_manifest
from pipelines.data.reader import read_rows


def _counts(ids: np.ndarray, mask: np.ndarray | None, width: int, first: int) -> tuple[np.ndarray, np.ndarray]:
    """(pooled counts (width,), per-position counts (L - first, width)) over positions ``first``.. of real tokens."""
    ids = ids[:, first:]
    valid = np.ones_like(ids, dtype=bool) if mask is None else mask[:, first:].astype(bool)
    per_pos = np.zeros((ids.shape[1], width), np.int64)
    for p in range(ids.shape[1]):
        per_pos[p] = np.bincount(ids[valid[:, p], p], minlength=width)[:width]
    return per_pos.sum(0), per_pos


def _xent(counts: np.ndarray, probs: np.ndarray) -> float:
    """Total NLL (nats) of tokens with ``counts`` under ``probs`` (same shape; rows per position)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.where(counts > 0, np.log(np.where(probs > 0, probs, 1.0)), 0.0)
        bad = (counts > 0) & (probs <= 0)
    if bad.any():
        return math.inf
    return float(-(counts * logp).sum())


def _normalise(c: np.ndarray, alpha: float) -> np.ndarray:
    c = c.astype(np.float64) + alpha
    return c / np.maximum(c.sum(-1, keepdims=True), 1e-300)


def floors(split_dir: str, train_dir: str | None = None, alpha: float = 0.5) -> dict[str, Any]:
    """The floors of ``split_dir`` (module docstring), in nats per token, for all L positions and 1..L-1."""
    m = read_manifest(split_dir)
    width = max(m.vocab_size, m.mask_id + 1)
    ids, mask = read_rows(split_dir)
    tr = read_rows(train_dir) if train_dir else None
    out: dict[str, Any] = {"split": m.split_dir, "rows": int(ids.shape[0]), "length": m.length, "vocab": width,
                           "train": train_dir, "alpha": alpha}
    for name, first in (("all_positions", 0), ("skip_first", 1)):
        pooled, per_pos = _counts(ids, mask, width, first)
        n = int(pooled.sum())
        res = {"tokens": n,
               "unigram_in_sample": _xent(pooled, _normalise(pooled, 0.0)) / n,
               "unigram_position_in_sample": _xent(per_pos, _normalise(per_pos, 0.0)) / n}
        if tr is not None:
            t_pooled, t_per_pos = _counts(tr[0], tr[1], width, first)
            res["unigram_fit_on_train"] = _xent(pooled, _normalise(t_pooled, alpha)) / n
            res["unigram_position_fit_on_train"] = _xent(per_pos, _normalise(t_per_pos, alpha)) / n
        out[name] = res
    if m.truth:
        out["exact"] = {"all_positions": m.truth["floors"], "skip_first": m.truth["floors_skip_first"],
                        "entropy": {"all_positions": m.truth["entropy_per_token"],
                                    "skip_first": m.truth["entropy_per_token_skip_first"]}}
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"Floors of {res['split']} ({res['rows']:,} rows x {res['length']}, vocabulary {res['vocab']:,})", "",
             "| floor | positions | nats/token | PPL |", "|---|---|---|---|"]
    for pos in ("all_positions", "skip_first"):
        label = "all L" if pos == "all_positions" else "1..L-1"
        for k, v in res[pos].items():
            if k == "tokens":
                continue
            lines.append(f"| {k.replace('_', ' ')} | {label} | {v:.4f} | {math.exp(v):.1f} |")
        exact = (res.get("exact") or {}).get(pos)
        if exact:
            for k, v in exact.items():
                lines.append(f"| {k.replace('_', ' ')} (exact) | {label} | {v:.4f} | {math.exp(v):.1f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.studies.floors", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("split", help="a prepared split folder (holds manifest.json)")
    p.add_argument("--train", default=None, help="the training split: also fit the floors there and score the split")
    p.add_argument("--alpha", type=float, default=0.5, help="add-alpha smoothing of the train-fitted floors")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_logging_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), _run, argv, bad_input=(ManifestError, ValueError))


def _run(args: argparse.Namespace) -> int:
    res = floors(args.split, args.train, args.alpha)
    print(json.dumps(res, indent=1) if args.json else table(res))
    for pos in ("all_positions", "skip_first"):
        for k, v in res[pos].items():
            if k != "tokens":
                print(f"RESULT {k}_{pos}={v:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
