"""The ``accuracy`` suite: the answer accuracy of an ACoT-fine-tuned version on a reasoning split.

    python -m pipelines.evaluate --model models:/acot-prosqa@candidate --suite accuracy --in-process
    python -m pipelines.evaluate --model models:/acot-prosqa@candidate --suite accuracy --data DIR \\
        --set accuracy_split=test

The version's checkpoint names its arm and the stage its weights were kept at (``n_ant``, ``removed_steps``:
``pipelines/training/acot_run.py``); every row of the split is laid out at that stage, its answer decoded
greedily and scored by exact match, the same ``answer_accuracy`` the fine-tuning validates with
(``pipelines/training/acot.py``), so the suite on the validation split gives the version's ``accuracy`` tag again.
The figures are ``answer_accuracy`` with Wilson's 95% interval (``answer_accuracy_lo``, ``answer_accuracy_hi``:
``metrics.wilson_interval``) and the counts; every row's record (question, gold answer, generated text, answer
read, match) is the evaluation run's artifact ``answers/<split>.jsonl``.

The planner refuses, in one line and before any weights load, a diffusion kind (the answers are decoded by a
causal network), a checkpoint that names no arm (not fine-tuned by ``acot``), a split that holds no reasoning
rows, one tokenized otherwise than the checkpoint's data, and a model whose context cannot hold the split's
longest prompt.
"""

from __future__ import annotations

import json
from typing import Any

from adlm_model.kinds import model_kind
from adlm_model.train.stages import ARMS, Stage
from pipelines.core.storage import join
from pipelines.evaluation.config import EvalError
from pipelines.evaluation.datasets import has_manifest, under_workdir
from pipelines.evaluation.jobs import load_eval_model
from pipelines.evaluation.metrics import wilson_interval
from pipelines.training.acot import answer_accuracy, decode_limit, read_split

ANSWERS_DIR = "answers"


def _split_dir(plan: Any) -> str:
    name = plan.cfg.accuracy_split
    here = under_workdir(name, plan.workdir)
    return here if has_manifest(here) else join(plan.data_dir(), name)


def plan_accuracy(plan: Any) -> None:
    """The checks of the module docstring; fills ``plan.accuracy`` with what the job needs."""
    kind, meta = plan.model_cfg.kind, plan.meta
    if model_kind(kind).diffusion:
        raise EvalError(f"suite accuracy decodes answers greedily with a causal network; {plan.ref.uri} is a {kind} "
                        "model (a diffusion kind): evaluate a version fine-tuned by python -m pipelines.train with "
                        "an acot recipe (model.kind=ar)")
    arm = meta.get("arm")
    if arm not in ARMS:
        raise EvalError(f"suite accuracy: checkpoint {plan.ref.local_dir} names no ACoT arm (meta arm={arm!r}); "
                        "evaluate a version fine-tuned by python -m pipelines.train with an acot recipe")
    split_dir = _split_dir(plan)
    split = read_split(split_dir, f"suite accuracy (accuracy_split={plan.cfg.accuracy_split})")
    m = split.manifest
    want = meta.get("tokenizer_hash")
    if want and m.tokenizer.get("hash") != want:
        raise EvalError(f"suite accuracy: {split_dir} was tokenized by {m.tokenizer.get('name')}, not by the "
                        f"tokenizer {plan.ref.uri} was trained with; pass --data DIR of splits prepared with it")
    if m.vocab_size != plan.model_cfg.vocab_size:
        raise EvalError(f"suite accuracy: {split_dir} has a vocabulary of {m.vocab_size}, the model "
                        f"{plan.model_cfg.vocab_size}; pass --data DIR of splits prepared with its tokenizer")
    if not split.rows:
        raise EvalError(f"suite accuracy: {split_dir} holds no rows")
    stage = Stage(0, int(meta.get("n_ant") or 0), int(meta.get("removed_steps") or 0), 1)
    seq_len = plan.model_cfg.seq_len
    longest = max(x.prompt_len for x in split.laid(stage, arm))
    if longest >= seq_len:
        raise EvalError(f"suite accuracy: the longest prompt of {split_dir} at {stage.n_ant} [ANT] has {longest} "
                        f"tokens, the model's context {seq_len}: no token is left to decode")
    max_new = int(((meta.get("train_config") or {}).get("acot") or {}).get("max_new") or 0)
    plan.accuracy = {"split_dir": m.split_dir, "split": m.split or plan.cfg.accuracy_split, "arm": arm,
                     "n_ant": stage.n_ant, "removed_steps": stage.removed_steps, "max_new": max_new,
                     "decoded": decode_limit(split, stage, arm, seq_len, max_new), "rows": len(split.rows),
                     "manifest_hash": m.content_hash(), "task": split.task}


def accuracy_job(model: str, split_dir: str, arm: str, n_ant: int, removed_steps: int, max_new: int,
                 settings: Any) -> dict[str, Any]:
    """Greedy answers of every row of ``split_dir`` at the stage ``(n_ant, removed_steps)`` for ``arm``, scored by
    exact match (``pipelines.training.acot.answer_accuracy``): the counts and every row's record."""
    net, model_cfg, _ = load_eval_model(model, settings)
    split = read_split(split_dir, "suite accuracy")
    acc = answer_accuracy(net, split, Stage(0, n_ant, removed_steps, 1), arm, seq_len=model_cfg.seq_len,
                          max_new=max_new)
    return {"correct": acc.correct, "total": acc.total, "records": [vars(r) for r in acc.records]}


def run_accuracy(state: Any) -> None:
    """The figures, the table's row and the per-row artifact of the suite (module docstring)."""
    a = state.plan.accuracy
    job = {"model": state.model, "settings": state.settings,
           **{k: a[k] for k in ("split_dir", "arm", "n_ant", "removed_steps", "max_new")}}
    r = state.executor.run(accuracy_job, [job], f"greedy answers ({a['split']}, {a['rows']} rows)", unit="split",
                           large=state.large_model)[0]
    correct, total = int(r["correct"]), int(r["total"])
    lo, hi = wilson_interval(correct, total)
    state.metrics.update({"answer_accuracy": correct / total, "answer_accuracy_lo": lo, "answer_accuracy_hi": hi,
                          "answer_correct": float(correct), "answer_total": float(total)})
    state.row("answer accuracy (exact match)", correct / total,
              f"{correct}/{total} rows of {a['task'] or 'the'} {a['split']} split, Wilson 95% [{lo:.4f}, {hi:.4f}]; "
              f"greedy, arm {a['arm']}, {a['n_ant']} [ANT], {a['removed_steps']} step(s) removed, at most "
              f"{a['decoded']} tokens decoded")
    state.artifacts[f"{ANSWERS_DIR}/{a['split']}.jsonl"] = "".join(json.dumps(x) + "\n" for x in r["records"])
    state.settings_out["accuracy"] = {k: a[k] for k in ("split_dir", "split", "arm", "n_ant", "removed_steps",
                                                        "max_new", "manifest_hash")}


def accuracy_tags(result: Any, cfg: Any) -> dict[str, str]:
    """The version tag that says how the accuracy was measured."""
    a = result.settings.get("accuracy") or {}
    m = result.metrics
    return {"answer_accuracy.settings": (
        f"split={a.get('split')} rows={m.get('answer_total', 0):.0f} correct={m.get('answer_correct', 0):.0f} "
        f"arm={a.get('arm')} n_ant={a.get('n_ant')} removed_steps={a.get('removed_steps')} greedy exact-match "
        f"wilson95=[{m.get('answer_accuracy_lo', float('nan')):.4f}, {m.get('answer_accuracy_hi', float('nan')):.4f}] "
        f"data={str(a.get('manifest_hash', ''))[:16]}")}
