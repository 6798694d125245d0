"""The offline lm-eval tasks' data: JSONL files made deterministically from the embedded corpus's test split.

The embedded corpus (``pipelines.data.embedded``: gensim's Wikipedia sample and the King James Bible, shipped
by pip packages) has a held-out ``test`` split that no demo model trains on. Its sentences become three task
files, written once into the node's cache (``$ADLM_CACHE/lm_eval_tasks-v2``) and read by the YAML tasks of
``lm_eval_tasks/`` through ``datasets.load_dataset("json", ...)``:

- ``lastword.jsonl`` (``adlm_lastword``, LAMBADA-style): a passage of one sentence of at least 15 words or two
  consecutive sentences of one document; the target is its
  last word (``text``, as LAMBADA's field; the task splits it). Scored by loglikelihood: perplexity and the
  greedy accuracy of the last word.
- ``choice.jsonl`` (``adlm_choice``): the first half of a sentence and four endings, the true one and three
  other sentences' endings of similar length (``gold`` its index). Scored by loglikelihood of each ending:
  ``acc`` and ``acc_norm``.
- ``generate.jsonl`` (``adlm_generate``): the first words of a sentence; the target is the rest of it up to the
  period. Generated with the stop sequence ``"."``: ``exact_match``.

Same corpus, same files: sentences are picked by a fixed rule and shuffled with ``random.Random(0)``; the
multiple-choice and generation items come from sentences no last-word passage uses.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

from pipelines.core.storage import node_cache_dir
from pipelines.data.embedded import embedded_corpus

TASKS_VERSION = "lm_eval_tasks-v2"
ROWS = {"lastword": 200, "choice": 100, "generate": 50}
"""Rows per task file (the suite's ``lm_eval_limit`` takes fewer)."""


def _sentences(text: str) -> list[list[str]]:
    """Runs of consecutive plain sentences of one document (8-30 words ending with a period after a lower-case
    word; no titles, lists, digits or markup): a run breaks wherever a sentence fails the rule."""
    runs: list[list[str]] = [[]]
    for para in text.split("\n"):
        for s in re.split(r"(?<=\.)\s+", para.strip()):
            words = s.split()
            if 8 <= len(words) <= 30 and re.fullmatch(r"[a-z]+\.", words[-1]) and not re.search(r"[\d=|{}\[\]<>]", s):
                runs[-1].append(" ".join(words))
            elif runs[-1]:
                runs.append([])
        if runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def build_rows(texts: list[str]) -> dict[str, list[dict[str, Any]]]:
    """The three tasks' rows from the corpus's test documents ``texts`` (module docstring)."""
    rng = random.Random(0)
    runs = [run for text in texts for run in _sentences(text)]
    rng.shuffle(runs)
    lastword, single = [], []
    for run in runs:
        # A passage: a long sentence alone, or a short one with the sentence that follows it in the document.
        if len(run[0].split()) < 15 and len(run) > 1 and len(lastword) < ROWS["lastword"]:
            lastword.append({"text": f"{run[0]} {run[1]}"[:-1]})  # the final period dropped: the last word is the target
            single.extend(run[2:])
        elif len(run[0].split()) >= 15 and len(lastword) < ROWS["lastword"]:
            lastword.append({"text": run[0][:-1]})
            single.extend(run[1:])
        else:
            single.extend(run)
    rng.shuffle(single)
    pool = single
    choice = []
    halves = [(s.split()[:len(s.split()) // 2], s.split()[len(s.split()) // 2:]) for s in pool]
    for i, (head, tail) in enumerate(halves[:ROWS["choice"]]):
        others = [t for j, (_, t) in enumerate(halves) if j != i and abs(len(t) - len(tail)) <= 2]
        wrong = rng.sample(others, 3)
        endings = [" ".join(tail)] + [" ".join(w) for w in wrong]
        order = list(range(4))
        rng.shuffle(order)
        choice.append({"context": " ".join(head), "endings": [endings[k] for k in order], "gold": order.index(0)})
    generate = []
    for s in pool[ROWS["choice"]:ROWS["choice"] + ROWS["generate"]]:
        words = s.split()
        generate.append({"prompt": " ".join(words[:6]), "target": " ".join(words[6:])[:-1]})
    return {"lastword": lastword, "choice": choice, "generate": generate}


def task_files(cache: str | os.PathLike | None = None) -> dict[str, Path]:
    """``{task: JSONL file}``, written once into ``cache`` (default: this node's cache)."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.parquet as pq

    d = Path(cache) if cache else node_cache_dir() / TASKS_VERSION
    files = {name: d / f"{name}.jsonl" for name in ROWS}
    if all(f.is_file() for f in files.values()):
        return files
    texts = pq.read_table(embedded_corpus(None)["test"]).column("text").to_pylist()
    d.mkdir(parents=True, exist_ok=True)
    for name, rows in build_rows(texts).items():
        tmp = files[name].with_name(files[name].name + f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        os.replace(tmp, files[name])
    return files


def load_task(name: str) -> Any:
    """The ``datasets.DatasetDict`` (split ``test``) of one task, from its local JSONL file."""
    # lazy: keeps datasets out of this module's import
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(task_files()[name])})
