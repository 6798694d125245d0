"""The offline tasks' datasets, as lm-eval's ``custom_dataset: !function tasks.NAME`` loads them (the harness
imports this file by its path; the data itself is made by ``pipelines.evaluation.lm_eval_data``)."""

from __future__ import annotations

from typing import Any

from pipelines.evaluation.lm_eval_data import load_task


def lastword(**_: Any) -> Any:
    return load_task("lastword")


def choice(**_: Any) -> Any:
    return load_task("choice")


def generate(**_: Any) -> Any:
    return load_task("generate")
